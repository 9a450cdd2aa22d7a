"""The time-limit warning (SIGUSR1) never kills a child that is still starting; it arrives once
the child has a handler, also in a SCRIPT started after it (a restart during the warning)."""

from __future__ import annotations

import io
import os
import queue
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cluster_parsers import JobInfo
from keras_distrib.launcher.children import OutputFilter, catches, signal_when_caught, spawn
from keras_distrib.launcher.workers import ChildSettings, Launch, LocalProcesses
from keras_distrib.plan import build_plan

pytestmark = pytest.mark.unit

# A script that takes a while to install its handler, as one importing TensorFlow does.
SLOW_HANDLER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    note = Path(sys.argv[1])
    note.write_text("started\\n")
    time.sleep(float(sys.argv[2]))
    signal.signal(signal.SIGUSR1, lambda *_: (note.write_text(note.read_text() + "warned\\n"), sys.exit(75)))
    note.write_text(note.read_text() + "handler\\n")
    time.sleep(30)
    """
)


def wait_until(check, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def start(tmp_path: Path, delay: float, name: str = "note"):
    proc = build_plan(JobInfo("local", "1", ("n1",), (1,)), layout="allreduce").processes[0]
    done: queue.Queue[int] = queue.Queue()
    note = tmp_path / name
    child = spawn(proc, [sys.executable, "-c", SLOW_HANDLER, str(note), str(delay)], dict(os.environ), True,
                  lambda c, rc: done.put(rc), out=io.BytesIO(), output=OutputFilter())
    assert wait_until(note.exists), "the child did not start"
    return child, note, done


def test_a_child_starts_with_the_warning_ignored_and_gets_it_once_it_has_a_handler(tmp_path: Path) -> None:
    child, note, done = start(tmp_path, delay=1.5)
    assert catches(child.popen.pid, signal.SIGUSR1) is False
    child.signal(signal.SIGUSR1)  # sent at once, as before: ignored, not fatal
    signal_when_caught(child, signal.SIGUSR1)
    assert done.get(timeout=20) == 75, "the warning must reach the handler, not kill the child"
    assert note.read_text().split() == ["started", "handler", "warned"]


def test_a_script_started_after_the_warning_gets_it_too(tmp_path: Path) -> None:
    codes: queue.Queue[int] = queue.Queue()
    processes = LocalProcesses(on_exit=lambda c, rc: codes.put(rc), settings=ChildSettings(startup_timeout=30))
    plan = build_plan(JobInfo("local", "1", ("n1",), (1,)), layout="allreduce")
    note = tmp_path / "note"
    launch = Launch(plan.processes[0], (sys.executable, "-c", SLOW_HANDLER, str(note), "0.5"), runs_script=True)
    processes.start(plan, [launch])
    try:
        assert wait_until(note.exists)
        processes.forward(signal.SIGUSR1)
        assert codes.get(timeout=20) == 75
        note.unlink()
        processes.restart([launch.proc.name])  # the restart after the warning
        assert codes.get(timeout=20) == 75, "a SCRIPT started after the warning must get it"
        assert note.read_text().split() == ["started", "handler", "warned"]
    finally:
        processes.shutdown(grace=2)


def test_a_child_that_never_handles_the_warning_keeps_running(tmp_path: Path) -> None:
    child, note, done = start(tmp_path, delay=30)
    signal_when_caught(child, signal.SIGUSR1, poll=0.05)
    child.signal(signal.SIGUSR1)
    time.sleep(0.5)
    assert child.popen.poll() is None, "an ignored warning must not end the child"
    child.signal(signal.SIGKILL)
    assert done.get(timeout=10) == -signal.SIGKILL
