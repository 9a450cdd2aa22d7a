"""A training process's progress counter, read by its node's agent (the hang watchdog).

The agent gives each child the path of a file of 40 bytes (``KERAS_DISTRIB_PROGRESS_FILE``,
contract.py): five little-endian 64-bit words, the count, how many ``watched`` calls
(fit, evaluate) are running, the last checkpoint's step + 1 (0: none yet) and the
1-based epoch it lies in (``checkpointed``: what an elastic re-forming line names), and 1
once the running fit's last epoch is done (``training_ended``: no node joins after it). ``tick()`` adds one to the count through a shared memory
map: no system call, no RPC, a few hundred nanoseconds per scheduled function. The agent
reads the file with one ``pread`` every few seconds (launcher/watchdog.py), and watches
for silence only while a watched call runs: what a script does after ``fit`` (export,
its own evaluation) may take as long as it likes.

Outside a launched job (no variable) ``tick`` does nothing. Pure Python, no TensorFlow.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from . import contract

_SIZE = 40
_WATCH_SIZE = 16  # the count and the depth: what the watchdog reads
_F = TypeVar("_F", bound=Callable[..., Any])
_lock = threading.Lock()
_counter: _Counter | None = None
_opened_for: str | None = None  # the path _counter maps ("" : no variable, nothing to do)


class _Counter:
    """The mapped counter of one file."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self.map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)  # the map keeps the file
        self.value = struct.unpack_from("<Q", self.map, 0)[0]
        self.depth = 0

    def add(self, n: int) -> None:
        # One aligned 8-byte store: a reader never sees half of it.
        self.value += n
        struct.pack_into("<Q", self.map, 0, self.value)

    def enter(self, step: int) -> None:
        self.depth = max(0, self.depth + step)
        struct.pack_into("<Q", self.map, 8, self.depth)

    def checkpointed(self, step: int, epoch: int) -> None:
        # The epoch first: a reader that sees the new step sees its epoch (x86 keeps store order;
        # a torn pair costs a wrong epoch in one log line, nothing else).
        struct.pack_into("<Q", self.map, 24, epoch)
        struct.pack_into("<Q", self.map, 16, step + 1)

    def ended(self, done: bool) -> None:
        struct.pack_into("<Q", self.map, 32, int(done))


def reset() -> None:
    """Read the variable again at the next call (a test that changes it in-process)."""
    global _opened_for
    _opened_for = None


def _current() -> _Counter | None:
    global _counter, _opened_for
    if _opened_for is not None:  # the variable is read once per process: tick() stays a few stores
        return _counter
    path = os.environ.get(contract.PROGRESS_FILE_VAR, "")
    if path != _opened_for:
        with _lock:
            if path != _opened_for:
                try:
                    _counter = _Counter(path) if path else None
                except OSError:
                    _counter = None  # the agent's directory went away: the watchdog sees no progress
                _opened_for = path
    return _counter


def tick(n: int = 1) -> None:
    """Count ``n`` units of progress (scheduled functions done) for the agent's watchdog."""
    counter = _current()
    if counter is not None:
        counter.add(n)


def announce() -> None:
    """Say that this process called into keras_distrib: its counter file exists from now on.

    The agent reads a missing file after SCRIPT's exit as "SCRIPT never used keras_distrib"
    (a single-process script launched unchanged, the other processes idle).
    """
    _current()


def announced(path: str | os.PathLike[str]) -> bool:
    """The agent's side of ``announce``: whether the process behind ``path`` called it."""
    return os.path.exists(path)


def watched(fn: _F) -> _F:
    """Decorate a call whose silence the watchdog judges (a trainer's fit, evaluate)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        counter = _current()
        if counter is not None:
            counter.enter(+1)
        try:
            return fn(*args, **kwargs)
        finally:
            if counter is not None:
                counter.enter(-1)

    return call  # type: ignore[return-value]


def _pread(path: str | os.PathLike[str], size: int, offset: int) -> bytes | None:
    """Up to ``size`` bytes of ``path`` at ``offset``; None: no file yet."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def checkpointed(step: int, epoch: int) -> None:
    """Note that a checkpoint holds ``step`` (in the 1-based ``epoch``), for the agent's re-forming line."""
    counter = _current()
    if counter is not None:
        counter.checkpointed(step, epoch)


def training_ended(done: bool) -> None:
    """Note that the running fit has done its last epoch (True), or that a fit starts (False).
    Called before that epoch's checkpoint is noted, so the agent sees the two in that order."""
    counter = _current()
    if counter is not None:
        counter.ended(done)


def fit_running(path: str | os.PathLike[str]) -> bool:
    """The agent's side of ``watched``: a fit (or evaluate) runs in the process behind ``path``."""
    state = read(path)
    return state is not None and state[1]


def training_done(path: str | os.PathLike[str]) -> bool:
    """The agent's side of ``training_ended``: the running fit has done its last epoch."""
    data = _pread(path, 8, 32)
    return data is not None and len(data) == 8 and struct.unpack("<Q", data)[0] == 1


def last_checkpoint(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """The agent's side of ``checkpointed``: (step, 1-based epoch) of the last checkpoint; None: none yet."""
    data = _pread(path, 16, 16)
    if data is None or len(data) < 16:
        return None
    step, epoch = struct.unpack("<QQ", data)
    return (step - 1, epoch) if step else None


def read(path: str | os.PathLike[str]) -> tuple[int, bool] | None:
    """(count, whether a watched call runs) from ``path`` (the agent's side); None: no file yet."""
    data = _pread(path, _WATCH_SIZE, 0)
    if data is None:
        return None
    if len(data) < _WATCH_SIZE:
        return 0, False
    count, depth = struct.unpack("<QQ", data)
    return count, depth > 0
