"""This node's processes (mechanism): start, restart, signal and stop them; the plan file.

The agent's policy decides what runs (``Launch``); ``LocalProcesses`` does it with real
processes (children.spawn), each child's environment from ``contract.child_env``. The
lifecycle tests replace it with a fake of the same methods.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import contract
from ..plan import Plan, Process
from .children import Child, OutputFilter, SharedErrors, signal_when_caught, spawn


@dataclass(frozen=True)
class Launch:
    """One process this node starts: what runs, and how its output is shown."""

    proc: Process
    argv: tuple[str, ...]
    runs_script: bool
    banners: bool = False  # TensorFlow's start-up banners shown (--verbose)
    quiet: bool = False  # nothing shown unless it fails on its own (allreduce workers > 0)


@dataclass(frozen=True)
class ChildSettings:
    """What the options say about every child's environment (see contract.child_env)."""

    startup_timeout: float
    verbose: bool = False
    checkpoint_every: str | None = None
    interface: str | None = None
    log_dir: Path | None = None  # every child's full output goes to LOG_DIR/JOB-INDEX.log
    require_gpus: bool = False


def log_file_name(proc: Process) -> str:
    """``worker-1.log``: one file per process of the job (task names are unique job-wide)."""
    return f"{proc.job}-{proc.index}.log"


@dataclass
class LocalProcesses:
    """The children of this agent, started as ``Launch`` says with the contract's environment."""

    on_exit: Callable[[Child, int], None]
    settings: ChildSettings
    # How a child is started, and the cluster as JSON: the control-plane benchmark, which
    # simulates thousands of agents in one process, passes a fake and a shared encoding.
    spawner: Callable[..., Any] = spawn
    cluster_json: str | None = None
    plan_file: Path | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    children: list[Any] = field(default_factory=list)
    # What this agent's children showed: one traceback per error, one copy of each warning.
    shown: SharedErrors = field(default_factory=SharedErrors)
    # How each child was started (its launch and environment), for restarts.
    _started: dict[str, tuple[Launch, dict[str, str]]] = field(default_factory=dict)
    # The job got the time-limit warning (SIGUSR1): every SCRIPT started later gets it too.
    warned: bool = False

    def start(self, plan: Plan, launches: Sequence[Launch]) -> None:
        """Write the plan file once for this node, then start ``launches``."""
        if self.plan_file is None:
            self.plan_file = contract.write_plan_file(json.dumps(plan.to_json()))
        # Encoded once per node: TF_CONFIG is only built when the cluster can fit in it.
        cluster_json = self.cluster_json or json.dumps(plan.cluster_spec())
        for launch in launches:
            env = contract.child_env(
                self.environ, plan, launch.proc, self.plan_file, startup_timeout=self.settings.startup_timeout,
                verbose=self.settings.verbose, checkpoint_every=self.settings.checkpoint_every,
                require_gpus=self.settings.require_gpus,
                interface=self.settings.interface, cluster_json=cluster_json,
            )
            self._started[launch.proc.name] = (launch, env)
            self.children.append(self._spawn(launch, env))

    def _spawn(self, launch: Launch, env: dict[str, str]) -> Any:
        output = OutputFilter(banners=launch.banners, quiet=launch.quiet, has_gpus=bool(launch.proc.gpus),
                              name=launch.proc.name, shared=self.shown)
        extra = {"log": self._open_log(launch.proc)} if self.settings.log_dir is not None else {}
        child = self.spawner(launch.proc, list(launch.argv), env, launch.runs_script, self.on_exit, output=output,
                             **extra)
        if self.warned and launch.runs_script:
            signal_when_caught(child, signal.SIGUSR1)
        return child

    def _open_log(self, proc: Process) -> Any:
        """The process's log file, appended to: a restart or a requeued run adds to the same file."""
        assert self.settings.log_dir is not None
        try:
            log = open(self.settings.log_dir / log_file_name(proc), "ab")  # noqa: SIM115 - the pump closes it
        except OSError:
            return None  # the directory was checked at start; a disk that went away costs the file only
        log.write(f"--- {proc.name} on {proc.node} started: {' '.join(self._started[proc.name][0].argv)}\n".encode())
        log.flush()
        return log

    def restart(self, names: Collection[str]) -> int:
        """Kill this node's processes among ``names`` (if alive), start them again as before; how many."""
        old = [c for c in self.children if c.proc.name in names]
        for child in old:
            child.signal(signal.SIGKILL)
            child.popen.wait()
        for child in old:
            self.children[self.children.index(child)] = self._spawn(*self._started[child.proc.name])
        return len(old)

    def reform(self, plan: Plan, launches: Sequence[Launch]) -> None:
        """An elastic re-forming: kill every child here, rewrite the plan file, start ``launches`` of ``plan``.

        The old children's exits are no longer ``current``; the plan file keeps its path, so
        the progress files beside it stay where the watchdog and the agent read them.
        """
        for child in self.children:
            child.signal(signal.SIGKILL)
        for child in self.children:
            child.popen.wait()
        self.children = []
        self._started.clear()
        if self.plan_file is not None:
            contract.rewrite_plan_file(self.plan_file, json.dumps(plan.to_json()))
        self.cluster_json = None  # the cluster changed: encode the new one
        self.start(plan, launches)

    def current(self, child: Child) -> bool:
        """False for a child a restart replaced (its exit is no news)."""
        return child in self.children

    def watched(self) -> list[Child]:
        """Every child: the hang watchdog samples them all."""
        return list(self.children)

    def progress_file(self, proc: Process) -> Path | None:
        return None if self.plan_file is None else contract.progress_file(self.plan_file, proc)

    def has_script(self) -> bool:
        """Whether SCRIPT runs on this node (alive or ended)."""
        return any(c.runs_script for c in self.children)

    def script_running(self) -> bool:
        return any(c.runs_script and c.popen.poll() is None for c in self.children)

    def forward(self, signum: int) -> None:
        """Pass a signal the agent got to its children.

        A server gets SIGTERM for a SIGINT: it keeps serving through its grace (the script
        may checkpoint on KeyboardInterrupt, with variables on the ps), and a server still
        starting exits quietly instead of dying in a traceback.
        """
        if signum == signal.SIGUSR1:
            self.warned = True
            for child in self.children:
                if child.runs_script:  # delivered once it has a handler: it may still be importing
                    signal_when_caught(child, signum)
                else:
                    child.signal(signum)
            return
        for child in self.children:
            child.signal(signal.SIGTERM if signum == signal.SIGINT and not child.runs_script else signum)

    def shutdown(self, grace: float) -> None:
        """SIGTERM every child's process group, SIGKILL after ``grace``, drain output; remove the plan file."""
        for child in self.children:
            # TF servers hold nothing to save and outlive SIGTERM (servers.py): kill them.
            child.signal(signal.SIGTERM if child.runs_script else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for child in self.children:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        for child in self.children:
            child.signal(signal.SIGKILL)
            child.popen.wait()
            child.pump.join(timeout=2)
        if self.plan_file is not None:
            contract.remove_plan_file(self.plan_file)
