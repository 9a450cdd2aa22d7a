"""The hang watchdog: a process that stops progressing is found, named, its stacks kept.

Each agent watches its own children (docs/faults.md, "Hangs"):

* a process that trains (SCRIPT) counts its scheduled functions in a progress file
  (keras_distrib/progress.py), and marks when it is inside fit/evaluate; the watchdog
  reads the counters every ``poll`` seconds;
* every process, TF servers included (ps, and workers of the ps layouts, which only
  serve), is probed through ``/proc/PID/stat``: state ``T`` is a stopped process (SIGSTOP,
  a debugger), ``D`` one blocked in the kernel (a dead NFS mount): frozen, not busy.

``Watch`` is the policy (pure, driven by a clock in the tests); ``Watchdog`` the thread
that samples the children, keeps the stacks of the stuck ones (py-spy, else /proc) in the
job's log directory before anything is killed, and posts ``Hung`` to the agent.

When the job acts: a process stopped (or in ``D``) for ``hang_timeout`` seconds, or a
SCRIPT inside fit/evaluate whose counter did not move for ``max(hang_timeout, 3 x its
longest gap between two counts so far)`` once it has counted in that call (the start-up
and the first step's compilation come before the first count: --startup-timeout covers
those; what SCRIPT does outside fit is not judged). Stopped processes
are named first: a ps or worker frozen under a chief is the cause of the chief's silence,
and the SCRIPTs it silenced start their clocks anew when it is named (they wait for its restart).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import progress

logger = logging.getLogger(__name__)

#: /proc states of a process that cannot progress by itself.
STOPPED = frozenset("Tt")  # SIGSTOP / job control, or stopped under a tracer
BLOCKED = frozenset("D")  # uninterruptible sleep: I/O that does not come back (dead NFS mount)
#: How long a process must stay in ``D`` before a peer's exit is blamed on it: a healthy
#: process on a loaded disk was seen in ``D`` at every look for 2 s (a page read), while a
#: dead network mount holds it for good. Blame without it is a restart; with it, a failure.
BLOCKED_PROOF_SECONDS = 10.0
#: A SCRIPT's limit is at least this many times its longest healthy gap between two counts.
GAP_FACTOR = 3.0
#: How long py-spy may take on one process.
DUMP_TIMEOUT = 30.0


# -- what /proc says ----------------------------------------------------------------------


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``D``, ``T``, ``Z``...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (2nd field) may hold spaces and parentheses: the state follows the last ')'.
    return stat[stat.rfind(b")") + 2:][:1].decode() or None


def stays_blocked(pid: int, seconds: float | None = None, every: float = 0.05) -> bool:
    """``pid`` is in uninterruptible sleep at every look for ``seconds``.

    One look proves nothing: a busy process passes through ``D`` on every page it reads
    from a loaded disk (CI saw a peer failing its collective in ``folio_wait_bit_common``).
    """
    deadline = time.monotonic() + (BLOCKED_PROOF_SECONDS if seconds is None else seconds)
    while True:
        if proc_state(pid) not in BLOCKED:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(every)


def _wchan(pid: int, tid: int | None = None) -> str:
    where = f"/proc/{pid}/task/{tid}/wchan" if tid else f"/proc/{pid}/wchan"
    try:
        text = Path(where).read_text().strip()
    except OSError:
        return ""
    return "" if text in ("", "0") else text


def describe_state(pid: int, letter: str | None) -> str:
    """``stopped``, ``disk sleep in nfs_wait...``, ``sleeping``, ``running``, ``gone``."""
    if letter is None:
        return "gone"
    words = {"T": "stopped", "t": "stopped by a tracer", "R": "running", "S": "sleeping",
             "D": "uninterruptible disk sleep", "Z": "zombie", "I": "idle"}
    text = words.get(letter, f"state {letter}")
    if letter in "SD":
        wchan = _wchan(pid)
        if wchan:
            text += f" in {wchan}"
    return text


# -- the policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One look at one process: its /proc state letter (None: gone) and its progress counter."""

    state: str | None
    progress: int | None = None  # None: no counter (a TF server, or not counted yet)
    runs_script: bool = False
    busy: bool = True  # inside a watched call (fit, evaluate): only then is silence judged


@dataclass
class _Track:
    state: str | None
    state_since: float
    value: int | None
    changed_at: float
    counted: bool = False  # the counter moved at least once: the watch on it is armed
    longest_gap: float = 0.0
    reported: bool = False


@dataclass(frozen=True)
class Verdict:
    """The process the job must act on, and the others stuck with it on this node."""

    key: Hashable
    seconds: float  # how long it made no progress
    state: str  # its /proc state letter (or "" when gone)
    stopped: bool  # frozen (T or D), not merely silent
    others: tuple[Hashable, ...] = ()  # other stuck processes here (their stacks are kept too)


@dataclass
class Watch:
    """Decides, from samples of this node's processes, when and on whom the job acts.

    ``margin``: extra seconds a silent SCRIPT is given when the processes that may cause
    its silence run under other agents (their agents name a stopped one first).
    """

    hang_timeout: float
    poll: float
    margin: float = 0.0
    tracks: dict[Hashable, _Track] = field(default_factory=dict)
    last: float | None = None

    def limit(self, track: _Track) -> float:
        """Seconds without a count after which a SCRIPT counts as stuck."""
        return max(self.hang_timeout, GAP_FACTOR * track.longest_gap)

    def observe(self, now: float, samples: Mapping[Hashable, Sample]) -> Verdict | None:
        """Take one round of samples; the verdict when the job must act, else None."""
        # A watchdog that did not run for a long while was itself stopped (the whole job
        # suspended, `scontrol suspend`): what it missed is no evidence against anyone.
        paused = self.last is not None and now - self.last > 3 * self.poll + 10
        self.last = now
        for key in list(self.tracks):
            if key not in samples:
                del self.tracks[key]
        for key, sample in samples.items():
            track = self.tracks.get(key)
            if track is None:
                self.tracks[key] = _Track(sample.state, now, sample.progress, now)
                continue
            if paused:
                track.state_since = track.changed_at = now
            if sample.state != track.state:
                track.state, track.state_since = sample.state, now
            if sample.progress is not None and sample.progress != track.value:
                if track.counted:
                    track.longest_gap = max(track.longest_gap, now - track.changed_at)
                # A count inside fit/evaluate (not the file appearing: fit's entry creates it).
                track.counted = sample.busy and track.value is not None and sample.progress > 0
                track.value, track.changed_at = sample.progress, now
            elif not sample.busy:
                track.counted = False  # fit ended: what SCRIPT does next is its own business
        return self._verdict(now, samples)

    def restart_clocks(self, now: float) -> None:
        """A process the others may wait for is being restarted: their silence starts anew."""
        for track in list(self.tracks.values()):  # also called from the agent's thread
            if not track.reported:
                track.changed_at = now

    def _verdict(self, now: float, samples: Mapping[Hashable, Sample]) -> Verdict | None:
        frozen: list[tuple[int, float, Hashable]] = []
        silent: list[tuple[float, Hashable]] = []
        for key, track in self.tracks.items():
            if track.reported:
                continue
            if track.state in STOPPED or track.state in BLOCKED:
                frozen.append((0 if track.state in STOPPED else 1, now - track.state_since, key))
            # Across nodes, + the margin and one more gap: the chunk in flight when the cause froze.
            extra = self.margin + track.longest_gap if self.margin else 0.0
            if samples[key].runs_script and track.counted and now - track.changed_at >= self.limit(track) + extra:
                silent.append((now - track.changed_at, key))
        due = [f for f in frozen if f[1] >= self.hang_timeout]
        if not due and not silent:
            return None
        if frozen:
            # The job is silent, or a process stayed frozen for hang_timeout: the frozen
            # one (stopped before blocked, the longest first) is the cause.
            frozen.sort(key=lambda f: (f[0], -f[1]))
            _, seconds, key = frozen[0]
            track = self.tracks[key]
            # Its counter may have stopped before /proc showed it stopped: the longer clock.
            seconds = max(seconds, now - track.changed_at) if track.counted else seconds
            culprit = Verdict(key, seconds, track.state or "", True)
        else:
            silent.sort(key=lambda s: -s[0])
            seconds, key = silent[0]
            culprit = Verdict(key, seconds, self.tracks[key].state or "", False)
        others = tuple(k for _, _, k in frozen if k != culprit.key) + tuple(k for _, k in silent if k != culprit.key)
        for key in (culprit.key, *others):
            self.tracks[key].reported = True
        if culprit.stopped:
            self.restart_clocks(now)  # the SCRIPTs it silenced also wait for its restart
        return Verdict(culprit.key, culprit.seconds, culprit.state, culprit.stopped, others)


# -- evidence: the stacks -----------------------------------------------------------------


def stacks_file(directory: Path, name: str) -> Path:
    """``LOG_DIR/ps-1.stacks.txt`` for ``ps:1`` (beside its output, ``ps-1.log``)."""
    return directory / f"{name.replace(':', '-')}.stacks.txt"


def py_spy() -> str | None:
    """The py-spy program: beside this Python (its venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def _run_py_spy(program: str, pid: int, stopped: bool) -> tuple[bool, str]:
    # py-spy suspends a running process while it reads it, which fails on a stopped one
    # ("Failed to suspend process"); a stopped process holds still anyway: --nonblocking.
    attempts = [["--nonblocking"]] if stopped else [[], ["--nonblocking"]]
    text = ""
    for extra in attempts:
        try:
            done = subprocess.run([program, "dump", "--pid", str(pid), *extra], capture_output=True,
                                  text=True, timeout=DUMP_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"py-spy failed: {exc}"
            continue
        if done.returncode == 0:
            return True, done.stdout
        text = f"py-spy exited with {done.returncode}: {(done.stderr or done.stdout).strip().splitlines()[:3]}"
    return False, text


def _threads(pid: int) -> str:
    """Each thread's name, state and kernel wait channel, from /proc (no Python frames)."""
    lines = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return "(the process is gone)\n"
    for tid in tids:
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        lines.append(f"  thread {tid} {comm!r}: {describe_state(pid, proc_state_task(pid, tid))}"
                     + (f" (wchan {_wchan(pid, tid)})" if _wchan(pid, tid) else ""))
    return "\n".join(lines) + "\n"


def proc_state_task(pid: int, tid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:][:1].decode() or None


def dump_stacks(pid: int, path: Path, header: str) -> str:
    """Append every thread's Python stack of ``pid`` to ``path``; how (``py-spy`` or why not)."""
    letter = proc_state(pid)
    program = py_spy()
    if program is None:
        ok, text = False, "py-spy is not installed (pip install py-spy): no Python frames, only the threads below"
    else:
        ok, text = _run_py_spy(program, pid, stopped=letter in STOPPED)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    body = (f"=== {stamp}: {header}\n--- Python stacks (py-spy dump)\n{text.rstrip()}\n"
            f"--- threads (/proc/{pid}/task)\n{_threads(pid)}\n")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(body)
    except OSError as exc:
        return f"not kept: cannot write {path} ({exc.strerror})"
    return "py-spy" if ok else text


# -- peers that failed because of another -----------------------------------------------

# MultiWorkerMirroredStrategy's coordination service, in the error a healthy peer exits with
# when another stops (measured with TF 2.21, a SIGSTOPped all-reduce worker).
_TASK_PATH = rb"/job:\w+/(?:replica:\d+/)?task:\d+"
_UNHEALTHY = re.compile(rb"tasks are unhealthy \(stopped sending heartbeats\):?\s*(" + _TASK_PATH
                        + rb"(?:[, \t]+" + _TASK_PATH + rb")*)")
_TASK = re.compile(rb"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")


# The exception line of a traceback, and those of a lost connection: what TensorFlow raises when
# a peer or the network fails under it (a collective aborted by the coordination service's
# missed heartbeats, a ps out of reach), and JAX's runtime errors with the same gRPC statuses.
_EXCEPTION_LINE = re.compile(rb"^[A-Za-z_][\w.]*(?:Error|Exception)\b")
_LOST_CONNECTION = re.compile(rb"^(?:[\w.]+\.)?(UnavailableError|DeadlineExceededError|AbortedError)\b"
                              rb"|^[\w.]*(?:XlaRuntimeError|JaxRuntimeError): (UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED)\b")


def lost_connection(lines: Sequence[bytes]) -> str | None:
    """The error's name when the last exception in a failed process's output is a lost
    connection (``DeadlineExceededError``), not the script's own error; None otherwise."""
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            match = _LOST_CONNECTION.match(line)
            return None if match is None else (match.group(1) or match.group(2)).decode()
    return None


def blamed_peers(lines: Sequence[bytes]) -> list[str]:
    """``job:index`` of the peers a failed process's last output lines say stopped (oldest first).

    The lines are read as one text: the task list may follow the message on the next line.
    JAX's coordination service (the same XLA code) names its tasks ``/job:jax_worker/...``.
    """
    found: list[str] = []
    for match in _UNHEALTHY.finditer(b"".join(lines)):
        for job, index in _TASK.findall(match.group(1)):
            name = f"{job.decode()}:{int(index)}"
            if name not in found:
                found.append(name)
    return found


# -- the thread -------------------------------------------------------------------------


@dataclass
class Watchdog:
    """Samples this node's children every ``watch.poll`` seconds; posts what ``on_verdict`` makes.

    ``children()``: the current children (objects with ``proc``, ``popen.pid``,
    ``runs_script``); ``progress_path(child)``: its counter file, or None.
    ``on_verdict(verdict)`` runs on this thread (it keeps the stacks, then posts).
    """

    watch: Watch
    children: Callable[[], Sequence[Any]]
    progress_path: Callable[[Any], Path | None]
    on_verdict: Callable[[Verdict], None]
    clock: Callable[[], float] = time.monotonic
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> dict[Hashable, tuple[Any, Sample]]:
        """``(name, pid)``: a restarted process is a new key, watched anew."""
        samples: dict[Hashable, tuple[Any, Sample]] = {}
        for child in list(self.children()):
            if child.popen.poll() is not None:
                continue  # ended: its exit is the agent's news, not ours
            path = self.progress_path(child) if child.runs_script else None
            count, busy = (progress.read(path) if path is not None else None) or (None, False)
            sample = Sample(proc_state(child.popen.pid), count, child.runs_script, busy)
            samples[(child.proc.name, child.popen.pid)] = (child, sample)
        return samples

    def round(self) -> Verdict | None:
        """One sampling round (the thread calls it; tests may too); the verdict's keys are children."""
        samples = self.sample()
        verdict = self.watch.observe(self.clock(), {k: s for k, (_, s) in samples.items()})
        if verdict is None:
            return None
        verdict = Verdict(samples[verdict.key][0], verdict.seconds, verdict.state, verdict.stopped,
                          tuple(samples[k][0] for k in verdict.others))
        self.on_verdict(verdict)
        return verdict

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=DUMP_TIMEOUT + 5)

    def _loop(self) -> None:
        while not self._stop.wait(self.watch.poll):
            try:
                self.round()
            except Exception:  # a watchdog that dies silently is worse than none
                logger.exception("the hang watchdog failed one round; it goes on")


# -- the agent's side ------------------------------------------------------------------


def poll_interval(hang_timeout: float) -> float:
    """How often the counters and states are read: a tenth of the timeout, 0.5 to 5 s."""
    return min(5.0, max(0.5, hang_timeout / 10))


def default_stacks_dir(scheduler: str, job_id: str) -> Path:
    """Where stacks go for an agent built without a log directory (tests): under /tmp."""
    return Path(tempfile.gettempdir()) / f"keras_distrib-{scheduler}-{job_id}"


@dataclass
class HangGuard:
    """What an agent does about hangs: runs the ``Watchdog``, keeps stacks, reads blame.

    Disabled (every method a no-op) with --hang-timeout 0 and for the cluster check. It
    sees the agent's processes only through ``watched`` (the children to sample) and
    ``progress_of`` (each one's progress file), and the plan through ``plan_processes``.
    """

    post: Callable[[Any], None]
    watched: Callable[[], Sequence[Any]]
    progress_of: Callable[[Any], Path | None]
    plan_processes: Callable[[], Sequence[Any]]
    stacks_dir: Path
    hang_timeout: float
    agents: int = 1
    enabled: bool = True
    watchdog: Watchdog | None = None

    def _children(self) -> list[Any]:
        return list(self.watched())

    def _progress_path(self, child: Any) -> Path | None:
        return self.progress_of(child.proc)

    def start(self) -> None:
        if not self.enabled:
            return
        poll = poll_interval(self.hang_timeout)
        # Across nodes a silent SCRIPT waits a little longer, so the agent of a frozen
        # process elsewhere (the cause) names it first.
        margin = 2 * poll + 5 if self.agents > 1 else 0.0
        self.watchdog = Watchdog(Watch(self.hang_timeout, poll, margin), self._children, self._progress_path,
                                 self._on_verdict)
        self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def restart_clocks(self) -> None:
        """A stuck process (here or on another node) is being restarted: the SCRIPTs here
        that wait for it are not judged on that wait."""
        if self.watchdog is not None:
            self.watchdog.watch.restart_clocks(self.watchdog.clock())

    def keep(self, child: Any, what: str) -> str:
        """Keep ``child``'s stacks; where they are, for the line (with why no frames if so)."""
        path = stacks_file(self.stacks_dir, child.proc.name)
        how = dump_stacks(child.popen.pid, path, f"{child.proc.name} on {child.proc.node} {what}")
        if how == "py-spy":
            return str(path)
        return f"{path} ({how})" if not how.startswith("not kept") else how

    def _on_verdict(self, verdict: Verdict) -> None:
        """On the watchdog's thread: keep the stacks of every stuck process here, then tell the agent."""
        child = verdict.key
        state = describe_state(child.popen.pid, verdict.state or None)
        where = self.keep(child, f"made no progress for {verdict.seconds:.0f} s (state: {state})")
        for other in verdict.others:
            self.keep(other, f"stuck too (state: {describe_state(other.popen.pid, proc_state(other.popen.pid))})")
        from .messages import Hung

        self.post(Hung(child, verdict.seconds, state, where))

    def blame(self, failed: Any) -> tuple[Any, str] | None:
        """The process whose freeze made ``failed`` exit, and the line's rest; None: its own error."""
        if not self.enabled:
            return None
        alive = [c for c in self._children() if c is not failed and c.popen.poll() is None]
        jobs = {p.job for p in self.plan_processes()}

        def in_plan(name: str) -> str:
            # All-reduce and jax have one kind of process: /job:jax_worker/task:1 is worker:1.
            job, index = name.split(":")
            return f"{next(iter(jobs))}:{index}" if job not in jobs and len(jobs) == 1 else name

        names = [n for n in map(in_plan, blamed_peers(list(failed.tail))) if n != failed.proc.name]
        if names:
            local = next((c for c in alive if c.proc.name == names[0]), None)
            why = f"stopped sending heartbeats (named by {failed.proc.name}'s error)"
            if local is None:
                proc = next((p for p in self.plan_processes() if p.name == names[0]), None)
                if proc is None:
                    return None
                where = stacks_file(self.stacks_dir, proc.name)
                return proc, f"{why}; its node's agent keeps its Python stacks in {where} if it is frozen"
            state = describe_state(local.popen.pid, proc_state(local.popen.pid))
            return local, f"{why} (state: {state}); its Python stacks: {self.keep(local, why)}"
        for child in alive:
            letter = proc_state(child.popen.pid)
            if letter in STOPPED or (letter in BLOCKED and stays_blocked(child.popen.pid)):
                state = describe_state(child.popen.pid, letter)
                return child, f"made no progress (state: {state}); its Python stacks: {self.keep(child, 'is frozen')}"
        return None

    def keep_frozen_stacks(self, targets: Sequence[str]) -> None:
        """Before a restart kills them: keep the stacks of this node's frozen targets."""
        if not self.enabled:
            return
        for child in self._children():
            if child.proc.name in targets and child.popen.poll() is None:
                letter = proc_state(child.popen.pid)
                if letter in STOPPED or letter in BLOCKED:
                    path = stacks_file(self.stacks_dir, child.proc.name)
                    if not path.exists() or time.time() - path.stat().st_mtime > 60:  # not just kept
                        self.keep(child, f"is frozen (state: {describe_state(child.popen.pid, letter)}) at its restart")
