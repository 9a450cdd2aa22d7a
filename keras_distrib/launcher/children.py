"""Child processes of an agent: prefixed unbuffered output, clean stop (their env: contract.child_env)."""

from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from ..plan import Process

_PR_SET_PDEATHSIG = 1
# Signals whose disposition a child must start with at default, whatever the agent
# inherited: a launcher started with `&` from a script ignores SIGINT (POSIX shells do
# that for background jobs), and SIG_IGN survives exec, so Ctrl-C would never reach
# the script. subprocess's restore_signals only covers SIGPIPE/SIGXFZ/SIGXFSZ.
DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# SIGUSR1 (the time-limit warning) starts ignored: its default action kills, and a process
# still importing TensorFlow has no handler yet. `fit`'s handler (or the script's own)
# replaces SIG_IGN; `signal_when_caught` delivers a warning the process was not ready for.
IGNORED_SIGNALS = (signal.SIGUSR1,)


def _pre_exec_hook() -> Callable[[], None] | None:
    """A pre-exec hook: default signal dispositions, none blocked, SIGKILL if the agent dies.

    libc is looked up here, in the parent, because the hook runs between fork and exec
    where taking loader locks could deadlock; only plain libc calls run in the child.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl, set_disposition = libc.prctl, libc.signal
    except (OSError, AttributeError):
        return None
    set_disposition.restype = ctypes.c_void_p
    set_disposition.argtypes = (ctypes.c_int, ctypes.c_void_p)
    sig_dfl, sig_ign = ctypes.c_void_p(0), ctypes.c_void_p(1)

    def hook() -> None:
        for sig in DEFAULT_SIGNALS:
            set_disposition(int(sig), sig_dfl)
        for sig in IGNORED_SIGNALS:
            set_disposition(int(sig), sig_ign)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


# TensorFlow's start-up banners, which TF_CPP_MIN_LOG_LEVEL does not silence: absl prints
# them before its logging is initialised (measured with TF 2.21: one absl notice, the
# oneDNN and "Could not find cuda drivers" INFO lines, once per import, and cuInit's
# ERROR on machines without a GPU). C++ INFO/WARNING lines (I/W + glog header) go too;
# other ERROR lines (e.g. "Failed to add port") always stay.
_NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|[IW]\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.-]+:\d+\] )"
)
# cuInit's error is expected noise only in a process the plan gives no GPU.
_NO_GPU_NOISE = re.compile(rb"^E\d{4} \d\d:\d\d:[\d.]+ +\d+ cuda_\w+\.cc:\d+\] failed call to cuInit")
_TRACEBACK_START = b"Traceback (most recent call last):"
# One of our own errors that explains itself (a user mistake, ending in a HINT): its frames
# say nothing to the user, so the console shows the error line alone (the process's log file
# keeps the whole traceback).
_OWN_HINTED_ERROR = re.compile(rb"^keras_distrib\.[\w.]+: .*HINT:")
TAIL_LINES = 30
# A Python warning as the warnings module prints it: "path:line: SomeWarning: text".
_PY_WARNING = re.compile(rb"^\S+:\d+: \w*Warning: ")
# One of our own warning or error lines (a script's, or a server's bare one).
_OWN_LINE = re.compile(rb"^(?:keras_distrib: )?(?:warning|error): ")


@dataclass
class SharedErrors:
    """The errors and warnings this agent has shown, by text, and which process showed each.

    Shared by the OutputFilters of one agent's children: several processes failing the same
    way (all-reduce workers, jax processes) show one traceback and a line for each other;
    a warning (or one of our own error lines) every process repeats is shown once. Log
    files keep everything.
    """

    first: dict[bytes, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def shown_by(self, text: bytes, name: str) -> str | None:
        """The other process that showed ``text`` first; None (and ``name`` is recorded) if none did."""
        with self.lock:
            first = self.first.setdefault(text.strip(), name)
        return first if first != name else None


@dataclass
class OutputFilter:
    """Decides which of a child's output lines are shown.

    * ``banners``: show TensorFlow's start-up banners (``--verbose``); hidden otherwise;
    * ``quiet``: show nothing, but keep the last lines for when the process fails;
    * a traceback that ends in ``KeyboardInterrupt`` (Ctrl-C) becomes one line;
    * a traceback that ends in one of keras_distrib's own errors with a HINT (a user
      mistake) is shown as that error line alone.
    """

    banners: bool = False
    quiet: bool = False
    has_gpus: bool = False
    tail: collections.deque[bytes] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    # The process's name, and the agent's record of what its children showed (None: no sharing).
    name: str = ""
    shared: SharedErrors | None = None
    last_error: bytes | None = None  # the exception line of its last traceback
    _traceback: list[bytes] = field(default_factory=list)
    _hiding_warning: bool = False

    def feed(self, line: bytes) -> list[bytes]:
        """The lines to show now, for one line of output."""
        if not self.banners and (_NOISE.match(line) or (not self.has_gpus and _NO_GPU_NOISE.match(line))):
            return []
        self.tail.append(line)
        if self._hiding_warning:  # the source line the warnings module prints under a warning
            self._hiding_warning = False
            if line[:1] in (b" ", b"\t"):
                return []
        # A quiet child shows nothing, so it must not claim a line: the one that speaks would stay silent.
        sharing = self.shared is not None and not self.quiet and not self._traceback
        if sharing and _PY_WARNING.match(line):
            if self.shared.shown_by(line, self.name) is not None:
                self._hiding_warning = True
                return []
        if sharing and (own := _OWN_LINE.match(line)):
            if self.shared.shown_by(b"own: " + line[own.end():], self.name) is not None:
                return []
        if self._traceback or line.startswith(_TRACEBACK_START):
            self._traceback.append(line)
            # Indented frames, and blank lines (Python prints one where a frame's source
            # line is missing), belong to the traceback.
            if line[:1] in (b" ", b"\t") or not line.strip() or line.startswith(_TRACEBACK_START):
                return []
            # The first unindented line after the header is the exception itself.
            held, self._traceback = self._traceback, []
            if line.startswith(b"KeyboardInterrupt"):
                return [] if self.quiet else [b"interrupted (KeyboardInterrupt)\n"]
            if _OWN_HINTED_ERROR.match(line):
                return [] if self.quiet else [line]
            self.last_error = line
            first = self.shared.shown_by(line, self.name) if self.shared is not None and not self.quiet else None
            if first is not None:
                return [self.same_error_line(first)]
            return [] if self.quiet else held
        return [] if self.quiet else [line]

    def same_error_line(self, first: str) -> bytes:
        assert self.last_error is not None
        return (f"the same error as {first} (its traceback is shown; this one is in the log directory): ".encode()
                + self.last_error.strip() + b"\n")

    def repeats_an_error(self) -> str | None:
        """A quiet child's failure: the process that already showed its last error, if any."""
        if self.shared is None or self.last_error is None:
            return None
        return self.shared.shown_by(self.last_error, self.name)

    def flush(self) -> list[bytes]:
        """Lines still held (an unfinished traceback) when the output ends."""
        held, self._traceback = self._traceback, []
        return [] if self.quiet else held


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
    # Set once the agent signalled it: its end is then expected, its output tail not needed.
    signalled: bool = False
    # Its last output lines (the OutputFilter's): the hang watchdog reads which peer a failure blames.
    tail: Sequence[bytes] = ()

    @property
    def label(self) -> str:
        return f"{self.proc.name} on {self.proc.node}"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (scripts may fork)."""
        if sig != signal.SIGUSR1:
            self.signalled = True
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass


def catches(pid: int, sig: int) -> bool | None:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask); None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def signal_when_caught(child: Child, sig: int, poll: float = 0.2) -> None:
    """Send ``sig`` to ``child`` once it has a handler for it, from a thread; never if it ends first.

    A child started with ``sig`` ignored (IGNORED_SIGNALS) would drop it while it imports.
    Where /proc cannot tell, the signal is sent at once.
    """
    def deliver() -> None:
        while child.popen.poll() is None:
            if catches(child.popen.pid, sig) is not False:
                child.signal(sig)
                return
            time.sleep(poll)

    threading.Thread(target=deliver, name=f"warn-{child.proc.name}", daemon=True).start()


def spawn(
    proc: Process,
    argv: Sequence[str],
    env: Mapping[str, str],
    runs_script: bool,
    on_exit: Callable[[Child, int], None],
    out: BinaryIO | None = None,
    output: OutputFilter | None = None,
    log: BinaryIO | None = None,
) -> Child:
    """Start ``argv`` with exactly ``env``; its output lines go to ``out`` with a prefix.

    ``output`` filters the lines (default: banners hidden). A quiet child that fails on
    its own (not signalled by the agent) still shows its last lines. ``log`` (a file the
    pump closes at the end) gets every line, unfiltered and without the prefix.
    ``on_exit(child, returncode)`` is called from the pump thread once the output is
    drained and the process has ended.
    """
    output = output if output is not None else OutputFilter()
    popen = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_pre_exec_hook(),
    )
    prefix = f"[{proc.node} {proc.name}] ".encode()
    sink = out if out is not None else sys.stdout.buffer
    child = Child(proc, popen, runs_script, threading.Thread(), tail=output.tail)

    def pump() -> None:
        assert popen.stdout is not None
        for line in iter(popen.stdout.readline, b""):
            line = line if line.endswith(b"\n") else line + b"\n"
            if log is not None:
                _keep(log, line)
            for shown in output.feed(line):
                write_line(sink, prefix + shown)
        for shown in output.flush():
            write_line(sink, prefix + shown)
        code = popen.wait()
        if output.quiet and code != 0 and not child.signalled and output.tail:
            first = output.repeats_an_error()
            if first is not None:
                write_line(sink, prefix + f"(quiet) failed with {describe_exit(code)}; ".encode()
                           + output.same_error_line(first))
            else:
                write_line(sink, prefix + f"(quiet) failed with {describe_exit(code)}; its last lines:\n".encode())
                for shown in output.tail:
                    write_line(sink, prefix + shown)
        if log is not None:
            _keep(log, f"--- {proc.name} on {proc.node} ended with {describe_exit(code)}\n".encode())
            log.close()
        on_exit(child, code)

    child.pump = threading.Thread(target=pump, name=f"pump-{proc.name}", daemon=True)
    child.pump.start()
    return child


_write_lock = threading.Lock()


def _keep(log: BinaryIO, data: bytes) -> None:
    """Append to a process's log file; a full or lost disk must not stop the job (or its console)."""
    try:
        log.write(data)
        log.flush()
    except (OSError, ValueError):
        pass


def write_line(sink: BinaryIO, data: bytes) -> None:
    """Write whole lines atomically so children's output never interleaves mid-line."""
    with _write_lock:
        sink.write(data)
        sink.flush()
