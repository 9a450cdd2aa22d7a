"""Child processes of an agent: explicit env, prefixed unbuffered output, clean stop."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from ..plan import Process

_PR_SET_PDEATHSIG = 1


def _death_signal_setter() -> Callable[[], None] | None:
    """A pre-exec hook so a child is SIGKILLed if its agent dies; None off Linux.

    libc is looked up here, in the parent, because the hook runs between fork and exec
    where taking loader locks could deadlock.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


def describe_exit(code: int) -> str:
    """'exit code 3' or 'signal 9 (SIGKILL)'."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def shell_exit_code(code: int) -> int:
    """A Popen return code as a shell would report it (128+N for signal N)."""
    return 128 - code if code < 0 else code


@dataclass
class Child:
    """One running process of the plan."""

    proc: Process
    popen: subprocess.Popen[bytes]
    runs_script: bool
    pump: threading.Thread

    @property
    def label(self) -> str:
        return f"{self.proc.name} on {self.proc.node}"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (scripts may fork)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass


def spawn(
    proc: Process,
    argv: Sequence[str],
    env: Mapping[str, str],
    runs_script: bool,
    on_exit: Callable[[Child, int], None],
    out: BinaryIO | None = None,
) -> Child:
    """Start ``argv`` with exactly ``env``; its output lines go to ``out`` with a prefix.

    ``on_exit(child, returncode)`` is called from the pump thread once the output is
    drained and the process has ended.
    """
    popen = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_death_signal_setter(),
    )
    prefix = f"[{proc.node} {proc.name}] ".encode()
    sink = out if out is not None else sys.stdout.buffer
    child = Child(proc, popen, runs_script, threading.Thread())

    def pump() -> None:
        assert popen.stdout is not None
        for line in iter(popen.stdout.readline, b""):
            write_line(sink, prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        on_exit(child, popen.wait())

    child.pump = threading.Thread(target=pump, name=f"pump-{proc.name}", daemon=True)
    child.pump.start()
    return child


_write_lock = threading.Lock()


def write_line(sink: BinaryIO, data: bytes) -> None:
    """Write whole lines atomically so children's output never interleaves mid-line."""
    with _write_lock:
        sink.write(data)
        sink.flush()


def child_env(base: Mapping[str, str], plan_json: str, tf_config: str, proc: Process, layout: str) -> dict[str, str]:
    """The explicit environment of one child: the agent's, plus its role and GPUs."""
    env = dict(base)
    env.update(
        TF_CONFIG=tf_config,
        KERAS_DISTRIB_PLAN=plan_json,
        KERAS_DISTRIB_LAYOUT=layout,
        KERAS_DISTRIB_TASK=proc.name,
        KERAS_DISTRIB_NODE=proc.node,
        # Our ids are the ones the scheduler gave; an empty value hides every GPU, which
        # is what ps and chief processes need (tensorflow#56894: TF's resolver can't).
        CUDA_VISIBLE_DEVICES=",".join(proc.gpus),
        PYTHONUNBUFFERED="1",
        # One chatty C++ logger per process on a shared terminal is noise; users may override.
        TF_CPP_MIN_LOG_LEVEL=base.get("TF_CPP_MIN_LOG_LEVEL", "1"),
    )
    return env
