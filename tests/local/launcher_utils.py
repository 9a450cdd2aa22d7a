"""Helpers for tests that run the launcher in local mode as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
NOISE = re.compile(r"^\[[^\]]+\] ([IWE]\d{4} |WARNING: All log messages)")


def launcher_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "LSB_", "KERAS_DISTRIB_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def start_local(args: list[str], cwd: Path, **extra_env: str) -> subprocess.Popen[str]:
    """Start ``python -m keras_distrib.local ARGS`` with stdout and stderr merged."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_distrib.local", *args],
        cwd=cwd,
        env=launcher_env(**extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_in_session(argv: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` in a session of its own: on a
    timeout the whole process group is killed (a bench program's training job with it), not
    only ``argv[0]``, so nothing is left running for the next test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"{argv} timed out after {timeout:g} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def meaningful(output: str) -> list[str]:
    """Output lines without TensorFlow's start-up chatter."""
    return [line for line in output.splitlines() if line and not NOISE.match(line)]


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def processes_with_env(key: str, value: str, parent: int | None = None) -> list[int]:
    """PIDs whose environment has key=value, optionally only children of ``parent``."""
    found = []
    needle = f"{key}={value}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                if parent is None or parent_of(int(entry.name)) == parent:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(pids: list[int]) -> list[int]:
    """PIDs still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def wait_for(predicate, timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def listening_ports(pid: int | str = "self") -> set[int]:
    """TCP ports listening in the network namespace of process ``pid`` (a local job has its own)."""
    ports = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class Job:
    """A local launcher run whose output is collected line by line while the test acts."""

    def __init__(self, args: list[str], cwd: Path, **extra_env: str) -> None:
        self.proc = start_local(args, cwd, **extra_env)
        self.lines: list[str] = []
        self.seen: set[int] = set()  # every child PID seen, to check none is left
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def count(self, needle: str) -> int:
        return sum(needle in line for line in self.lines)

    def pids(self, task: str) -> list[int]:
        found = alive(processes_with_env("KERAS_DISTRIB_TASK", task, self.proc.pid))
        self.seen.update(found)
        return found

    def kill(self, task: str, timeout: float = 300) -> None:
        assert wait_for(lambda: len(self.pids(task)) == 1, timeout), f"{task} never ran\n{self.text()[-3000:]}"
        subprocess.run(["kill", "-9", str(self.pids(task)[0])], check=True)

    def wait_after(self, act: Callable[[], None], timeout: float = 600) -> int:
        """Do ``act`` (faults at their moments), then wait for the end; the job is killed if ``act`` fails."""
        try:
            act()
            return self.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def wait(self, timeout: float = 600) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(timeout=10)
        return code

    def result(self, prefix: str) -> dict:
        rows = [json.loads(line.split("] ", 1)[1]) for line in self.lines if line.startswith(prefix) and '] {"step"' in line]
        assert rows, self.text()[-3000:]
        return rows[-1]
