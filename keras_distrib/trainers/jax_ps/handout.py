"""The epoch's parts handed out to the JAX workers, and their reports back to the chief.

TensorFlow queues on the first ps task, found by shared name like the variables. Each has
one reader, who dequeues only what `size` says is there: a dequeue that waits on the ps holds up
every other client's ops on that task (measured), so nothing here ever waits on the ps.
* ``parts<w>``: worker w's next parts, ``(run, epoch, first batch, batches, seed)``. The chief
  keeps `DEPTH` parts in each and adds one each time the worker starts one, so a fast worker
  takes more parts than a slow one (the dynamic hand-out); ``epoch == STOP`` ends its fit
  (its ``first``: the signal of a preemption, which ends the worker's SCRIPT too).
  The queue outlives a worker's restart: only the parts it had taken are lost.
* ``history<w>``: the chief's History at the fit's end, for worker w's ``fit`` to return.
* ``reports``: each worker says `HELLO` when it starts, `STARTED` when it takes a part and
  `DONE` after the part's deltas are on the ps, with its examples and metric states. Only the
  chief reads it.

``run`` is the chief's random token for one fit: a report or part of another fit (a chief
that restarted) is dropped.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ... import progress
from ...plan import PS

logger = logging.getLogger(__name__)

STOP = -1
HELLO, STARTED, DONE = 0, 1, 2
#: Report fields before the metric states.
HEADER = ("run", "kind", "worker", "pid", "epoch", "first", "examples")
#: Seconds between looks at an empty queue (the chief's reports, a worker's parts).
POLL = 0.002
#: The longest pause between a waiting worker's looks (the chief validating, saving).
IDLE_POLL = 0.05
#: The longest pause between the chief's looks at the reports while none come. Each look is an
#: op on the first ps task: a look every POLL kept the chief and that task busy, a third of a
#: core each, beside workers that compute for a part's whole length (docs/performance.md).
REPORT_POLL = 0.02
QUEUE_CAPACITY = 1 << 20
#: Parts in each worker's queue: the next one is always there, and a restart loses at most these.
DEPTH = 2
#: Seconds between the chief's lines while it waits for parts.
WAIT_LINE = 60.0


@dataclass(frozen=True)
class Part:
    """``batches`` batches of the epoch's order from batch ``first`` on."""

    run: int
    epoch: int
    first: int
    batches: int
    seed: int

    def vector(self) -> np.ndarray:
        return np.array([self.run, self.epoch, self.first, self.batches, self.seed], np.int64)


@dataclass(frozen=True)
class Report:
    run: int
    kind: int
    worker: int
    pid: int
    epoch: int
    first: int
    examples: int
    states: np.ndarray  # the metric states, flat (`DONE`), else empty


def parts_of_epoch(run: int, epoch: int, num_batches: int, per_part: int, seed: int) -> list[Part]:
    """The epoch's batches in parts of ``per_part`` (the last one shorter), in order (pure)."""
    return [Part(run, epoch, first, min(per_part, num_batches - first), seed)
            for first in range(0, num_batches, per_part)]


class SharedQueue:
    """A FIFO queue of rows on the first ps task, by shared name, through raw ops: no Python
    object owns it, so no client's exit or garbage collection deletes it under the others
    (an eager ``tf.queue.FIFOQueue`` does, and the ps then crashed: measured)."""

    def __init__(self, name: str, dtype: str, width: int) -> None:
        import tensorflow as tf

        self.device, self.dtype = f"/job:{PS}/task:0", tf.as_dtype(dtype)
        with tf.device(self.device):
            self.handle = tf.raw_ops.FIFOQueueV2(component_types=[self.dtype], shapes=[[width]],
                                                 capacity=QUEUE_CAPACITY, shared_name=name, container="")

    def size(self) -> int:
        import tensorflow as tf

        with tf.device(self.device):
            return int(tf.raw_ops.QueueSizeV2(handle=self.handle))

    def put(self, rows: np.ndarray) -> None:
        import tensorflow as tf

        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueManyV2(handle=self.handle, components=[tf.constant(rows, self.dtype)])

    def take(self, n: int) -> np.ndarray:
        """``n`` rows; only ever asked for rows `size` said are there, by the queue's one reader."""
        import tensorflow as tf

        with tf.device(self.device):
            return tf.raw_ops.QueueDequeueManyV2(handle=self.handle, n=n, component_types=[self.dtype])[0].numpy()


class Queues:
    """The queues, as this process sees them (every SCRIPT process finds the same ones)."""

    def __init__(self, model_number: int, report_size: int, workers: int) -> None:
        prefix = f"keras_distrib/m{model_number}"
        self.parts = [SharedQueue(f"{prefix}/parts{w}", "int64", 5) for w in range(workers)]
        self.reports = SharedQueue(f"{prefix}/reports", "float64", len(HEADER) + report_size)
        self.histories = [SharedQueue(f"{prefix}/history{w}", "string", 1) for w in range(workers)]

    def send_history(self, history: str) -> None:
        """The chief's: the fit's History (JSON) to every worker, before their stops."""
        for queue in self.histories:
            queue.put(np.array([[history.encode()]], dtype=object))

    def fit_ended(self, worker: int) -> bool:
        """A worker's, before it runs a part: whether the chief has sent its History (it does
        so after the fit's last fold, before the stops), so the parts still queued ahead of the
        stop are not needed."""
        return self.histories[worker].size() > 0

    def take_history(self, worker: int) -> str | None:
        """A worker's, after its stop: the History the chief sent (None: none came)."""
        queue = self.histories[worker]
        return queue.take(1)[0][0].decode() if queue.size() else None

    # -- the chief ----------------------------------------------------------------

    def hand_out(self, worker: int, parts: Sequence[Part]) -> None:
        if parts:
            self.parts[worker].put(np.stack([p.vector() for p in parts]))

    def waiting(self, worker: int) -> int:
        """How many parts ``worker`` has not taken yet."""
        return self.parts[worker].size()

    def stop_workers(self, run: int, wait: float, signum: int = 0) -> None:
        """End every worker's fit; wait up to ``wait`` seconds for each to take its stop, so
        none is still reading from a ps that ends with the chief's SCRIPT. ``signum``: the
        preemption signal that stops the job (the stop's ``first``), 0 at the fit's end."""
        for worker in range(len(self.parts)):
            self.hand_out(worker, [Part(run, STOP, signum, 0, 0)])
        deadline = time.monotonic() + wait
        while any(self.waiting(w) for w in range(len(self.parts))) and time.monotonic() < deadline:
            time.sleep(POLL)

    def next_reports(self, timeout: float) -> list[Report]:
        """The reports waiting (none after ``timeout`` seconds); looks less often while none come
        (`REPORT_POLL`: a worker holds `DEPTH` parts, so a late look does not leave it idle)."""
        deadline, pause = time.monotonic() + timeout, POLL
        while True:
            waiting = self.reports.size()
            if waiting:
                return [_report(v) for v in self.reports.take(waiting)]
            if time.monotonic() > deadline:
                return []
            time.sleep(pause)
            pause = min(2 * pause, REPORT_POLL)

    # -- a worker -----------------------------------------------------------------

    def next_part(self, worker: int) -> Part:
        """``worker``'s next part, once the chief has handed one out (looks less often while idle).

        Waiting counts as progress once a second: an idle worker is not a frozen one (the chief
        validating, saving), and a frozen worker cannot count."""
        pause, alive_at = POLL, time.monotonic()
        while not self.waiting(worker):
            time.sleep(pause)
            pause = min(2 * pause, IDLE_POLL)
            if time.monotonic() - alive_at >= 1.0:
                progress.tick(1)
                alive_at = time.monotonic()
        return Part(*(int(v) for v in self.parts[worker].take(1)[0]))

    def report(self, run: int, kind: int, worker: int, pid: int, epoch: int = 0, first: int = 0,
               examples: int = 0, states: Any = None, report_size: int = 0) -> None:
        head = np.array([run, kind, worker, pid, epoch, first, examples], np.float64)
        tail = np.zeros(report_size) if states is None else np.asarray(states, np.float64)
        self.reports.put(np.concatenate([head, tail])[None])


def _report(vector: np.ndarray) -> Report:
    head = [int(v) for v in vector[: len(HEADER)]]
    return Report(*head, states=vector[len(HEADER):])


class EpochHandOut:
    """The chief's side of one epoch: `DEPTH` parts in each worker's queue, each part folded
    once, and the parts a restarted worker had taken handed out again."""

    def __init__(self, queues: Queues, parts: Sequence[Part], live: dict[int, int]) -> None:
        """``live``: worker -> the pid of its latest start, kept by the caller across epochs."""
        self.queues = queues
        self.run, self.epoch = parts[0].run, parts[0].epoch
        self.todo = collections.deque(parts)  # not handed out yet
        self.open = {p.first: p for p in parts}  # not folded yet
        workers = range(len(queues.parts))
        self.queued: dict[int, list[Part]] = {w: [] for w in workers}  # in the worker's queue, in order
        self.taken: dict[int, list[Part]] = {w: [] for w in workers}  # taken, not reported done
        self.live = live
        self.said_at = time.monotonic()
        for worker in workers:
            self._refill(worker)

    def _refill(self, worker: int) -> None:
        batch = []
        while self.todo and len(self.queued[worker]) + len(batch) < DEPTH:
            batch.append(self.todo.popleft())
        self.queues.hand_out(worker, batch)
        self.queued[worker].extend(batch)

    def wait(self) -> list[Report]:
        """The next reports, or none after a while (with a line now and then)."""
        reports = self.queues.next_reports(1.0)
        if not reports and time.monotonic() - self.said_at >= WAIT_LINE:
            self.said_at = time.monotonic()
            busy = sorted(w for w, parts in self.taken.items() if parts)
            logger.info("epoch %d: waiting for %d part(s); taken by %s", self.epoch + 1, len(self.open),
                        ", ".join(f"worker {w}" for w in busy) or "no worker")
        return reports

    def fold(self, report: Report) -> Part | None:
        """The part ``report`` completes (its first report only), else None."""
        if report.kind == HELLO:
            self._hello(report.worker, report.pid)
            return None
        if report.run != self.run or report.epoch != self.epoch:
            return None  # of another fit, or a part handed out twice in an earlier epoch
        part = self.open.get(report.first)
        if report.kind == STARTED:
            self._taken(report.worker, report.first)
            return None
        self.taken[report.worker] = [p for p in self.taken[report.worker] if p.first != report.first]
        if part is None:
            return None  # folded already: the report of its other run
        del self.open[report.first]
        return part

    def _taken(self, worker: int, first: int) -> None:
        queued = self.queued[worker]
        at = next((i for i, p in enumerate(queued) if p.first == first), None)
        if at is not None:  # FIFO: every part before it was taken too
            self.taken[worker].extend(queued[: at + 1])
            del queued[: at + 1]
        self._refill(worker)

    def _hello(self, worker: int, pid: int) -> None:
        """A worker (re)started: what its earlier run took and did not finish goes out again."""
        known = self.live.get(worker)
        self.live[worker] = pid
        if known is None or known == pid:
            return
        left = self.queues.waiting(worker)
        queued = self.queued[worker]
        gone = self.taken[worker] + queued[: max(0, len(queued) - left)]
        self.queued[worker], self.taken[worker] = queued[len(queued) - left:] if left else [], []
        lost = [p for p in gone if p.first in self.open]
        if lost:
            logger.warning("epoch %d: worker %d restarted; the %d part(s) it had taken are handed out again "
                           "(their examples count once; the updates it pushed before it stopped stay)",
                           self.epoch + 1, worker, len(lost))
            self.todo.extendleft(reversed(lost))
        for w in self.queued:
            self._refill(w)
