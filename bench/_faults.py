"""Seeded fault schedules for bench/chaos.py: the same seed, the same schedule.

Pure: no processes, no clock. A schedule is a list of `Fault`, each at a time after the
job's first checkpoint, with at least ``min_gap`` seconds between two (0: the next one
lands during the recovery from the previous).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: Every kind of fault the harness injects, and what it does.
KINDS: dict[str, str] = {
    "kill-worker": "SIGKILL to a worker process",
    "kill-ps": "SIGKILL to a parameter server (ps layouts)",
    "kill-chief": "SIGKILL to the process that runs SCRIPT on the first node",
    "freeze": "SIGSTOP to a worker, SIGCONT after SECONDS",
    "cut-link": "a node's link down for SECONDS, then up",
    "cut-link-for-good": "a node's link down until the job ends",
    "kill-agent": "SIGKILL to a node's agent, then a --join agent started on it",
    "preempt": "SIGUSR1 to the batch shell, as before a time limit (the job requeues)",
    "kill-in-checkpoint": "SIGKILL to a worker as a new checkpoint appears",
}
#: Kinds that make sense once per job at most.
ONCE = ("preempt", "cut-link-for-good", "kill-chief")
#: The layouts without parameter servers (and without a chief process of their own).
NO_PS = ("allreduce", "jax")


@dataclass(frozen=True)
class Fault:
    """One fault: ``at`` seconds after the job's first checkpoint, on ``node`` (``seconds``:
    how long a freeze or a cut lasts)."""

    at: float
    kind: str
    node: str
    seconds: float = 0.0

    def describe(self) -> str:
        lasting = f" for {self.seconds:.0f} s" if self.seconds else ""
        return f"{self.at:6.1f} s  {self.kind:<18} on {self.node}{lasting}"


def kinds_for(layout: str) -> list[str]:
    """The fault kinds that apply to ``layout``."""
    if layout in NO_PS:
        return [k for k in KINDS if k not in ("kill-ps", "kill-chief")]
    return list(KINDS)


def draw_schedule(seed: int, count: int, *, layout: str, nodes: Sequence[str], span: float, min_gap: float,
                  kinds: Sequence[str] | None = None) -> list[Fault]:
    """``count`` faults over about ``span`` seconds, drawn from ``seed`` alone.

    The first node is never cut off (its agent leads the job: losing it ends the job by
    design) and its agent is never killed; ``kill-chief`` is on the first node. A node is
    cut for good at most once, and only while another node is left beside the first.
    """
    rng = random.Random(seed)
    allowed = [k for k in (kinds or kinds_for(layout)) if k in kinds_for(layout)]
    others = list(nodes[1:])
    slack = max(span - count * min_gap, 0.0) / max(count, 1)
    at, faults, used = 0.0, [], set()
    for _ in range(count):
        at += (min_gap if faults else 0.0) + rng.uniform(0.0, 2 * slack)
        choices = [k for k in allowed if not (k in ONCE and k in used)]
        if len(others) < 2:  # one node beside the first: it may not be cut for good
            choices = [k for k in choices if k != "cut-link-for-good"]
        kind = rng.choice(choices)
        used.add(kind)
        node = nodes[0] if kind == "kill-chief" else rng.choice(others)
        seconds = round(rng.uniform(5.0, 25.0), 1) if kind in ("freeze", "cut-link") else 0.0
        faults.append(Fault(round(at, 1), kind, node, seconds))
        if kind == "cut-link-for-good":
            others.remove(node)
    return faults


def describe(seed: int, layout: str, faults: Sequence[Fault]) -> str:
    """The schedule as printed before a run (replay it with the same seed)."""
    head = f"seed {seed}, layout {layout}: {len(faults)} fault(s)"
    return "\n".join([head, *("  " + f.describe() for f in faults)])
