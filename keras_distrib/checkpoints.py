"""Checkpoints that survive crashes, mid-epoch saves, visible resume, preemption signals.

* One writer (the chief, or all-reduce worker 0). Each checkpoint is written into a
  hidden ``.partial-*`` directory and then renamed to ``ckpt-<step>``; a rename is atomic,
  so a kill during a write leaves at most a stray partial directory (removed at the next
  start) and never spoils an earlier checkpoint. The newest ``keep`` are kept.
* ``meta.json`` in each checkpoint: step, epoch, position in the epoch, layout, a model
  signature and the callbacks' resume state; a checkpoint of another layout or model is
  refused with a HINT.
* Interval (`Interval`): every N steps or S seconds, from ``KERAS_DISTRIB_CHECKPOINT_EVERY``
  (launcher ``--checkpoint-every``); default `DEFAULT_EVERY`, plus one at every epoch end.
* Preemption: `preemption_signals()` installs SIGUSR1/SIGTERM handlers that only set a
  flag (`preemption_requested()`); the trainer saves at its next step boundary, outside
  the handler, and raises `Preempted` (exit code `PREEMPTED_EXIT_CODE`, which the
  launcher turns into a requeue).

TensorFlow is only imported by the functions that write or read a TF checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .checkpoint_interval import DEFAULT_EVERY, Interval, IntervalError, parse_interval
from . import contract, progress
from .contract import CHECKPOINT_EVERY_VAR, PREEMPTED_EXIT_CODE

logger = logging.getLogger(__name__)

#: Complete checkpoints kept in the directory.
DEFAULT_KEEP = 3
FORMAT = 1
META = "meta.json"
PROGRESS = "progress.json"
PARTIAL_PREFIX = ".partial-"
_NAME = re.compile(r"^ckpt-(\d+)$")
#: Progress notes (for "N steps lost" on resume) are written at most this often.
PROGRESS_EVERY_SECONDS = 1.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run; the message ends with a HINT."""


class Preempted(SystemExit):
    """Raised by the trainer after the checkpoint a preemption signal asked for."""

    def __init__(self, signum: int) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum = signum


# ---------------------------------------------------------------- interval


def interval_from_env(environ: Mapping[str, str] | None = None) -> Interval:
    env = os.environ if environ is None else environ
    try:
        return parse_interval(env.get(CHECKPOINT_EVERY_VAR) or DEFAULT_EVERY)
    except IntervalError as exc:
        raise CheckpointError(f"{CHECKPOINT_EVERY_VAR}={exc}") from None


class Schedule:
    """When the next mid-epoch checkpoint is due (a step count or a clock)."""

    def __init__(self, interval: Interval, step: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.mark(step)

    def mark(self, step: int) -> None:
        self.last_step, self.last_time = step, self.clock()

    def due(self, step: int) -> bool:
        if self.interval.steps and step - self.last_step >= self.interval.steps:
            return True
        return bool(self.interval.seconds) and self.clock() - self.last_time >= (self.interval.seconds or 0)


# ---------------------------------------------------------------- preemption

_requested: list[int] = []


def preemption_requested() -> int | None:
    """The signal number that asked for a checkpoint-and-stop, or None."""
    return _requested[0] if _requested else None


def _note_signal(signum: int, _frame: Any) -> None:
    # Only a flag: writing a checkpoint inside a handler can deadlock (locks held by the
    # interrupted code); the trainer saves at its next step boundary instead.
    if not _requested:
        _requested.append(signum)


@contextlib.contextmanager
def preemption_signals(enabled: bool = True) -> Iterator[None]:
    """During training: SIGUSR1 (time limit coming) and SIGTERM (preemption) set the flag."""
    import threading

    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested.clear()
    previous = {s: signal.signal(s, _note_signal) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- the store


@dataclass(frozen=True)
class Meta:
    """What ``meta.json`` records about one checkpoint."""

    step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int | None
    layout: str | None
    signature: str
    saved_at: float
    format: int = FORMAT
    #: State of the callbacks whose decisions depend on earlier epochs (ModelCheckpoint's
    #: best value...), restored on resume; see ``trainers/callbacks.py``.
    callbacks: Any = None
    #: The job's workers when it was saved: an elastic job that resumes on fewer (or more)
    #: tells its callbacks (``on_workers_changed``); None: not in a launched job, or older.
    workers: int | None = None


def model_signature(model: Any) -> str:
    """A short hash of the model's weight shapes and dtypes, in order (names vary between runs)."""
    parts = [f"{tuple(v.shape)}:{getattr(v.dtype, 'name', v.dtype)}" for v in model.weights]
    return hashlib.sha1(";".join(parts).encode()).hexdigest()[:12] + f"-{len(parts)}w"


def where_in_training(meta: Meta) -> str:
    """``meta``'s place in training, in words: "the end of epoch 3" or "epoch 4, 20 steps into it"."""
    if meta.step_in_epoch == 0 and meta.epoch:
        return f"the end of epoch {meta.epoch}"
    return f"epoch {meta.epoch + 1}, {meta.step_in_epoch} steps into it"


def display_epoch(epoch: int, step_in_epoch: int) -> int:
    """The 1-based epoch a checkpoint at (``epoch``, ``step_in_epoch``) lies in: the end of an epoch counts as in it."""
    return epoch if step_in_epoch == 0 and epoch else epoch + 1


def position(step: int, steps_per_epoch: int | None, origin: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """(epoch, step within the epoch) of the global ``step``.

    ``origin``: (the step at which epoch N began, N): after a resume with another number of
    steps per epoch (an elastic job's workers changed) epochs count from there, not from 0.
    """
    origin_step, origin_epoch = origin
    if not steps_per_epoch:
        return origin_epoch, step - origin_step
    return origin_epoch + (step - origin_step) // steps_per_epoch, (step - origin_step) % steps_per_epoch


def resume_position(meta: Meta, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, steps of it done) to resume ``meta`` with ``steps_per_epoch`` steps per epoch now.

    The same count as at the save: the meta's own place. Another count (an elastic job's
    workers changed, so its shards and their batches did): the same epoch, and the same
    fraction of it done, rounded, so the step counter stays the updates applied and each later
    epoch is a full pass (docs/faults.md, Node loss).
    """
    if meta.steps_per_epoch == steps_per_epoch:
        return meta.epoch, meta.step_in_epoch
    if not meta.steps_per_epoch:  # saved without a count: epochs from step 0
        return divmod(meta.step, steps_per_epoch)
    done = round(meta.step_in_epoch * steps_per_epoch / meta.steps_per_epoch)
    return meta.epoch, min(done, steps_per_epoch - 1)  # a begun epoch keeps a step: its end (validation) still comes


class CheckpointStore:
    """A directory of complete checkpoints ``ckpt-<step>/`` written atomically by one process."""

    def __init__(self, directory: str | os.PathLike[str], *, writer: bool, keep: int = DEFAULT_KEEP) -> None:
        self.directory = Path(directory)
        self.writer = writer
        self.keep = max(1, keep)
        self._progress_time = 0.0
        if writer:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stray in self.directory.glob(PARTIAL_PREFIX + "*"):
                shutil.rmtree(stray, ignore_errors=True)  # a write killed in the middle

    def complete(self) -> list[tuple[Path, Meta]]:
        """Complete checkpoints, oldest first (a directory without readable meta is skipped)."""
        found = []
        if not self.directory.is_dir():
            return found
        for path in self.directory.iterdir():
            if not _NAME.match(path.name):
                continue
            try:
                meta = Meta(**json.loads((path / META).read_text()))
            except (OSError, ValueError, TypeError):
                continue
            found.append((path, meta))
        return sorted(found, key=lambda item: item[1].step)

    def latest(self) -> tuple[Path, Meta] | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, write: Callable[[str], Any], meta: Meta) -> Path | None:
        """``write(prefix)`` writes the TF checkpoint; every process calls it, one keeps it."""
        final = self.directory / f"ckpt-{meta.step:012d}"
        if not self.writer:
            scratch = tempfile.mkdtemp(prefix="keras_distrib_ckpt_")
            try:
                write(os.path.join(scratch, "ckpt"))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        if final.exists():
            return final  # this step is saved already (an epoch end right after a mid-epoch save)
        partial = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{meta.step}-", dir=self.directory))
        write(str(partial / "ckpt"))
        with open(partial / META, "w") as fh:
            json.dump(asdict(meta), fh)
            fh.flush()
            os.fsync(fh.fileno())
        for name in os.listdir(partial):  # data before the rename that publishes it
            _fsync_path(partial / name)
        os.rename(partial, final)
        _fsync_path(self.directory)
        for old, _ in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def note_progress(self, step: int, force: bool = False) -> None:
        """Record the last step reached (so a resume can say how many steps were lost)."""
        now = time.monotonic()
        if not self.writer or (not force and now - self._progress_time < PROGRESS_EVERY_SECONDS):
            return
        self._progress_time = now
        tmp = self.directory / f"{PARTIAL_PREFIX}{PROGRESS}"
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, self.directory / PROGRESS)

    def last_progress(self) -> int | None:
        try:
            return int(json.loads((self.directory / PROGRESS).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_compatible(path: Path, meta: Meta, layout: str | None, signature: str) -> None:
    """Refuse a checkpoint of another layout or model, with a HINT."""
    if meta.layout and layout and meta.layout != layout:
        raise CheckpointError(
            f"checkpoint {path} was written by a {meta.layout} run (step {meta.step}); this run's layout is {layout}. "
            f"HINT: resume with --layout {meta.layout}, or give this run another checkpoint_dir."
        )
    if meta.signature != signature:
        raise CheckpointError(
            f"checkpoint {path} holds another model (signature {meta.signature}, this model {signature}). "
            "HINT: give this model its own checkpoint_dir, or build the same model as the run that wrote it."
        )


# ---------------------------------------------------------------- the trainers' side


class Checkpointer:
    """What a trainer needs: restore the newest usable checkpoint, save (periodically, on demand)."""

    def __init__(self, directory: str, tf_checkpoint: Any, model: Any, *, writer: bool, keep: int = DEFAULT_KEEP,
                 layout: str | None = None, interval: Interval | None = None, show: bool | None = None) -> None:
        self.store = CheckpointStore(directory, writer=writer, keep=keep)
        self.tf_checkpoint = tf_checkpoint
        self.signature = model_signature(model)
        self.layout = layout if layout is not None else contract.layout(os.environ)
        self.interval = interval if interval is not None else interval_from_env()
        self.show = writer if show is None else show
        self.steps_per_epoch: int | None = None
        #: (step, epoch) where epochs are counted from: see ``position`` (the trainer sets it on resume).
        self.origin: tuple[int, int] = (0, 0)
        self.workers = contract.worker_count(os.environ)
        self.schedule: Schedule | None = None
        self._write_fn: Callable[[Any], Any] | None = None
        #: Returns what ``meta.json`` records as ``callbacks`` at each save (set by the trainer).
        self.callback_state: Callable[[], Any] = lambda: None
        #: The meta of the checkpoint `restore` used, or None.
        self.restored: Meta | None = None

    def restore(self) -> int | None:
        """Restore the newest complete checkpoint; its step, or None when there is none."""
        found = self.store.latest()
        if found is None:
            return None
        path, meta = found
        check_compatible(path, meta, self.layout, self.signature)
        self.tf_checkpoint.read(str(path / "ckpt")).expect_partial()
        self.restored = meta
        progress.checkpointed(meta.step, display_epoch(meta.epoch, meta.step_in_epoch))
        if self.show:
            reached = self.store.last_progress()
            lost = f"; the {reached - meta.step} steps trained after it are redone" if reached and reached > meta.step else ""
            logger.info(f"resuming from {path} ({where_in_training(meta)}, step {meta.step}){lost}.")
        return meta.step

    def save(self, step: int) -> Path | None:
        epoch, in_epoch = position(step, self.steps_per_epoch, self.origin)
        meta = Meta(step, epoch, in_epoch, self.steps_per_epoch, self.layout, self.signature, time.time(),
                    callbacks=self.callback_state(), workers=self.workers)
        path = self.store.save(self._write, meta)
        if path is not None:  # the writer: its agent names this point if the job re-forms (progress.py)
            progress.checkpointed(step, display_epoch(epoch, in_epoch))
        self.store.note_progress(step, force=True)
        if self.schedule is not None:
            self.schedule.mark(step)
        return path

    def _write(self, prefix: str) -> None:
        import tensorflow as tf

        # Inside one tf.function traced once (the prefix is a tensor): called eagerly with
        # variables on several tasks (the ps), TF defines and traces a new save function
        # at every write, which costs about a second each time.
        if self._write_fn is None:
            self._write_fn = tf.function(lambda path: self.tf_checkpoint.write(path))
        self._write_fn(tf.constant(prefix))

    def wants_save(self, step: int) -> bool:
        """At a step boundary: is a periodic checkpoint due, or did a preemption signal come?"""
        if self.schedule is None:
            self.schedule = Schedule(self.interval, step)
        self.store.note_progress(step)
        return preemption_requested() is not None or self.schedule.due(step)

    def at_boundary(self, step: int) -> None:
        """Save now (the caller made ``step`` exact); after a preemption signal, stop training."""
        self.save(step)
        signum = preemption_requested()
        if signum is not None:
            epoch, in_epoch = position(step, self.steps_per_epoch, self.origin)
            if self.show:
                logger.info(f"got {signal.Signals(signum).name}: saved a checkpoint at step {step} (epoch {epoch + 1}, "
                            f"{in_epoch} steps into it); stopping with exit code {PREEMPTED_EXIT_CODE} so the job can be "
                            "requeued.")
            raise Preempted(signum)

    def nothing_left(self, step: int, epochs: int) -> bool:
        """Warn (once, on the writer) when the checkpoint already covers every epoch asked for."""
        if not self.steps_per_epoch:
            return False
        epoch, _ = position(step, self.steps_per_epoch, self.origin)
        if epoch < epochs:
            return False
        if self.show:
            logger.warning(f"the checkpoint in {self.store.directory} is at step {step}, the end of epoch "
                           f"{epoch}; nothing is left to train for epochs={epochs}. "
                           "HINT: raise epochs= to train more, or use a fresh checkpoint_dir to start over.")
        return True
