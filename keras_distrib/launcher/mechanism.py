"""What the agent's policy acts through, as protocols: its node's processes, timers, the scheduler.

``agent.Agent`` decides; these carry its decisions out. Production passes
``workers.LocalProcesses``, ``ThreadTimers`` and ``SchedulerCalls()``; the lifecycle tests
pass fakes that implement the same protocols in full, so no production code asks which
one it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..plan import Plan, Process
from . import requeue as scheduler_ops
from .messages import Event


class Processes(Protocol):
    """This node's children, as the policy sees them (workers.LocalProcesses, or a fake)."""

    def start(self, plan: Plan, launches: list[Any]) -> None: ...
    def restart(self, names: list[str]) -> int: ...
    def reform(self, plan: Plan, launches: list[Any]) -> None: ...
    def current(self, child: Any) -> bool: ...
    def has_script(self) -> bool: ...
    def script_running(self) -> bool: ...
    def forward(self, signum: int) -> None: ...
    def shutdown(self, grace: float) -> None: ...

    def watched(self) -> list[Any]:
        """The running operating-system processes the hang watchdog samples (a fake has none)."""
        ...

    def progress_file(self, proc: Process) -> Path | None:
        """Where ``proc`` notes its steps and checkpoints (progress.py); None before any start."""
        ...


class Timers(Protocol):
    def after(self, seconds: float, event: Event) -> None: ...


@dataclass
class ThreadTimers:
    """Posts ``event`` after ``seconds`` (daemon threads: an agent that ended waits for none)."""

    post: Callable[[Event], None]

    def after(self, seconds: float, event: Event) -> None:
        timer = threading.Timer(seconds, self.post, (event,))
        timer.daemon = True
        timer.start()


@dataclass(frozen=True)
class SchedulerCalls:
    """What an agent asks of its scheduler: requeue the job, end the job step (requeue.py)."""

    environ: Mapping[str, str]
    requeue_job: Callable[..., int] = scheduler_ops.requeue
    end_job_step: Callable[..., None] = scheduler_ops.end_step

    def requeue(self, scheduler: str, enabled: bool, say: Callable[[str], None]) -> int:
        """Requeue if ``enabled`` and possible; the agent's exit code."""
        return self.requeue_job(scheduler, self.environ, enabled, say)

    def end_step(self, scheduler: str, say: Callable[[str], None]) -> None:
        self.end_job_step(scheduler, self.environ, say)
