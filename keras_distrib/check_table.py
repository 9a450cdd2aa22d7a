"""The cluster check's table (one row per task) and its summary, shared by the TensorFlow
check (check.py) and the jax check (jax_check.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .plan import Process


@dataclass(frozen=True)
class CheckRow:
    proc: Process
    gpus_seen: tuple[str, ...]
    rtt_ms: float | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.gpus_seen) == len(self.proc.gpus)


def format_table(rows: list[CheckRow]) -> str:
    header = ("NODE", "ROLE", "ADDRESS", "GPUS PLANNED", "GPUS SEEN", "RTT MS", "STATUS")
    lines = [header]
    for r in rows:
        status = "OK" if r.ok else f"FAILED {r.error or 'GPU count differs'}"
        rtt = f"{r.rtt_ms:.2f}" if r.rtt_ms is not None else "-"
        lines.append((r.proc.node, r.proc.name, r.proc.address, ",".join(r.proc.gpus) or "-",
                      str(len(r.gpus_seen)), rtt, status))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def report(rows: list[CheckRow]) -> int:
    """Print the table and the summary; the exit code is 1 if any task failed."""
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} OK, {len(failed)} FAILED", flush=True)
    return 1 if failed else 0
