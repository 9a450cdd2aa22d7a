"""The chief's closure queue (`ClosureQueue`), shared by training and evaluation (`EpochRun`:
what it schedules, how it folds the results in, and what a failure during the epoch
means, decided in `EpochRun.end`) and by predict (`PredictRun`).

Nothing here imports TensorFlow at import time.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from .. import _private_apis as private
from ..base import ChunkHooks
from ..metrics import Totals, unpack_totals
from .handout import HandOut, files_changed, shards_can_fill, sizes_kept

logger = logging.getLogger(__name__)


def settled_step(base: int, folded: int, lost: list[int], counted: int) -> int | None:
    """The step counter a training run's closures should have left, once every one has landed,
    where it counted more (else None).

    ``base``: the counter as the run began; ``folded``: the steps of the results the chief
    folded; ``lost``: the steps of those whose results were lost with their workers (each ran);
    ``counted``: the counter read now. Each closure counts its steps on the ps as its last act;
    one whose worker is lost after that, before the chief has its result, is run again by the
    coordinator and counts again.
    """
    expected = base + folded + sum(lost)
    return expected if counted > expected else None


class ClosureQueue:
    """Closures in flight on the workers: scheduled while the run wants more (its window
    allows, it is not complete), folded oldest first, until none is left in flight."""

    pending: deque

    def wants_more(self) -> bool:
        """Whether to schedule another closure now."""
        raise NotImplementedError

    def schedule_next(self) -> None:
        raise NotImplementedError

    def fold_oldest(self) -> None:
        """Fold the oldest closure's result in (it waits for it)."""
        raise NotImplementedError

    def after_fold(self) -> None:
        """What follows each fold (a stop, a checkpoint): nothing by default."""

    def drain(self) -> None:
        while True:
            while self.wants_more():
                self.schedule_next()
            if not self.pending:
                return
            self.fold_oldest()
            self.after_fold()


class EpochRun(ClosureQueue):
    """One epoch (or ``steps`` of it) of ``inp`` on ``trainer``'s workers: closures of K steps
    scheduled until the epoch is complete, their results folded in order into `totals`."""

    def __init__(self, trainer: Any, inp: HandOut, epoch: int, *, training: bool, steps: int | None,
                 hooks: ChunkHooks) -> None:
        self.trainer, self.inp, self.epoch, self.training, self.hooks = trainer, inp, epoch, training, hooks
        self.k = trainer.steps_per_execution
        self.fn = trainer._fn(training)  # the closure's function, then its iterator, as ever
        # The iterator before anything else reads inp for this epoch.
        self.iterator = inp.epoch_iterator(epoch, trainer._last_epoch if training else None)
        self.steps = inp.start_epoch(epoch, training=training, steps=steps, k=self.k)
        self.reset = trainer.metrics.reset_numpy()
        self.totals = Totals(self.reset)
        self.pending: deque = deque()
        self.exhausted: set[int] = set()
        self.scheduled = 0  # steps scheduled so far (an upper bound of what will run)
        self.done: dict[int, int] = {}  # steps folded per shard
        # Where each shard's size is known, closures beyond what its shards still need are
        # not scheduled (see `ParameterServerTrainer._window`).
        self.per_shard = inp.window_shards(self.steps)
        # Seconds each worker's closures ran, on its own clock: a worker whose shard is smaller
        # (files dealt whole) idles after it, and one the chief folds late is not slow for that.
        self.busy: dict[int, float] = {}
        if training:
            trainer.worker_steps, trainer.worker_busy = self.done, self.busy
            trainer.workers_recovered = False
        self.lost: list[int] = []  # closures whose results were lost with their workers
        self.ended_early: list[Exception] = []  # what the sure closures that found their shard's end raised
        self.window = trainer._window()
        self.sure_steps = self._sure_steps()
        # A closure whose worker fails is queued again behind the later ones, so a sure one
        # may run after guarded ones that read its shard to the end, and find the end (`end`).
        self.run_again = private.closures_run_again(trainer.coordinator)
        self.stopped = self.by_hook = False
        self.base_step = int(trainer.global_step.numpy()) if training else 0

    def _sure_steps(self) -> list[int] | None:
        """Each shard's known steps, where closures it can fill may run unguarded (else None)."""
        sure = self.inp.sure_steps_for(self.steps)
        if sure is not None and not shards_can_fill(sure, {}, self.k * self.window, self.k):
            # Hardly a closure could be sure (shards within a window of their ends): one
            # closure kind, one trace.
            return None
        return sure

    def run(self) -> Totals:
        """Schedule and fold closures until the epoch is complete, then `end` it."""
        trainer, inp = self.trainer, self.inp
        self.schedule = trainer._scheduler(self.fn, self.iterator)
        if self.sure_steps is not None:
            # Both kinds traced before the epoch's first closure: see `PerWorkerInput`.
            for closure in inp.sure_kinds(self.k):
                self.schedule.trace(*closure.args())
        with sizes_kept(inp, trainer.coordinator):
            self.drain()
        self.settle_step_counter()
        return self.end()

    def settle_step_counter(self) -> None:
        """With every closure landed, after a worker failed in this run: a closure run again
        counts again (`settled_step`); the counter is set back to the steps run, so it stays
        epochs x steps. That closure's updates were applied twice."""
        if not self.training or not (self.failed_over() or self.lost):
            return
        counted = int(self.trainer.global_step.numpy())
        settled = settled_step(self.base_step, self.totals.steps, self.lost, counted)
        if settled is not None:
            self.trainer.global_step.assign(settled)
            logger.warning("a closure ran again after its worker failed and counted its steps twice (the step "
                           "counter read %d, not %d); the counter is set back to %d. Its updates were applied "
                           "twice, as a lost attempt's are.", counted, settled, settled)

    def failed_over(self) -> bool:
        """Whether a closure was queued again in this run (its worker failed): the epoch's
        shards were read anew, and a closure may have counted twice."""
        return private.closures_run_again(self.trainer.coordinator) != self.run_again

    def wants_more(self) -> bool:
        return (not self.stopped and not self.complete()
                and len(self.pending) < self.trainer._window(self.per_shard, self.done))

    def complete(self) -> bool:
        if self.steps is not None:
            return self.scheduled >= self.steps
        if len(self.exhausted) == self.trainer.num_workers:
            return True
        counted = self.totals.count if not self.inp.source.batched else self.totals.steps
        return self.inp.expected is not None and counted >= self.inp.expected

    def schedule_next(self) -> None:
        """One more closure, from the hand-out: the next part, or K steps of a free worker's shard."""
        import tensorflow as tf

        n = self.k if self.steps is None else min(self.k, self.steps - self.scheduled)
        in_flight = sum(m for m, _ in self.pending)
        self.hooks.before(self.totals.steps + in_flight)
        # Sure: every shard holds n more steps past all those in flight, wherever they run.
        sure = (self.sure_steps is not None and not self.lost and not self.ended_early
                and shards_can_fill(self.sure_steps, self.done, in_flight, n))
        n, closure = self.inp.next_closure(self.epoch, self.k, n, sure)
        try:
            self.pending.append((n, self.schedule(*closure.args())))
        except tf.errors.OutOfRangeError as e:  # raised once, the queue cancelled
            self.shard_ended(e)
            return
        self.scheduled += n

    def after_fold(self) -> None:
        """The callbacks' stop, the epoch's completion, and a due checkpoint, after each fold."""
        self.by_hook = self.by_hook or (not self.stopped and self.hooks.stop())
        self.stopped = self.stopped or self.by_hook
        if self.steps is None and self.complete():
            self.stopped = True  # the rest in flight find their shards empty
        if not self.stopped and self.hooks.checkpoint_due(self.totals.steps):
            # A mid-epoch checkpoint (or a preemption): let the closures in flight land
            # so the saved step counter is exact, then save (and stop if preempted).
            while self.pending:  # every part before the checkpoint has run
                self.fold_oldest()
            self.settle_step_counter()
            self.trainer._after_train_epoch()
            self.hooks.checkpoint_now()

    def shard_ended(self, error: Exception) -> None:
        if self.sure_steps is None:
            raise error
        if not any(error is seen for seen in self.ended_early):  # the queue raises a closure's error again
            self.ended_early.append(error)
        logger.debug("a closure sent unguarded found its shard's end: %s", str(error).splitlines()[0])

    def fold_oldest(self) -> None:
        """The oldest closure's result folded into `totals` (or its loss noted)."""
        import tensorflow as tf

        n, rv = self.pending.popleft()
        try:
            vector, logs = rv.fetch(), None
        except tf.errors.OutOfRangeError as e:  # its updates up to the end were applied
            self.shard_ended(e)
            return
        except tf.errors.CancelledError:
            if not self.ended_early:
                raise
            return  # cancelled with the queue when a closure found its shard's end: never ran
        except (tf.errors.UnavailableError, tf.errors.AbortedError):
            self.lost.append(n)  # where its steps ran is unknown: no closure is sure any more
            # The closure ran (a failed one is re-run by the coordinator, and its value is
            # set only by a run that finished), but its worker was lost before the chief
            # copied the result off it. Its updates and steps are on the ps (the step
            # counter stays exact); only its logs are gone.
            logger.warning("the result of a closure (%d steps) was lost with its worker before "
                           "the chief read it; its updates were applied, its loss and metrics are missing "
                           "from this epoch's logs.", n)
            return
        if isinstance(vector, dict):  # the model's own step: its logs come along
            vector, logs = vector["vector"], vector["logs"]
        shard = int(vector[0])  # the worker's: steps per worker (stragglers, `_window`)
        if vector[1]:
            self.exhausted.add(shard)
        out = unpack_totals(vector[3:], self.reset)
        out["logs"] = logs
        self.done[shard] = self.done.get(shard, 0) + int(out["steps"])
        self.totals.add(out)
        if out["steps"]:  # a closure past its shard's end is no measure of its worker's speed
            self.busy[shard] = self.busy.get(shard, 0.0) + float(vector[2])
            self.hooks.after(self.totals.steps - 1, self.totals)

    def end(self) -> Totals:
        """The epoch's outcome, decided in one place: closures that found their shard's end
        early (after a worker failed and its closures ran again: a warning; else changed
        files: an error), and the first epoch's count of each shard of files learned."""
        inp, workers = self.inp, self.trainer.num_workers
        failed_over = self.failed_over()
        if self.training and (failed_over or self.lost):
            self.trainer.workers_recovered = True  # this epoch's rates say nothing of a worker's speed
        if self.ended_early:
            if not failed_over and not self.lost:
                if inp.learned:
                    raise files_changed(inp, "a closure found its shard's end early")
                raise self.ended_early[0]
            logger.warning("%d closure(s) sent unguarded found their shard's end after a worker failed and its "
                           "closures ran again: this epoch went on with guarded closures to every shard's end "
                           "(its logs miss the steps those closures ran; some examples were seen twice).",
                           len(self.ended_early))
        whole = not self.by_hook and not self.lost and len(self.exhausted) == workers
        if self.steps is None and whole and not self.ended_early:
            # Every shard ran to its end in this epoch. Sure closures pay off where every
            # shard fills one past a full window in flight.
            inp.learn_epoch(self.done, self.k * (self.window + 1))
        if self.sure_steps is not None and whole and not failed_over:
            inp.check_held([self.done.get(i, 0) for i in range(workers)])
        return self.totals


class PredictRun(ClosureQueue):
    """Predict: closures of K batches over every worker's shard until every row is predicted;
    the chief keeps every result (``parts``: keys and predictions)."""

    def __init__(self, trainer: Any, inp: HandOut, schedule: Any, k: int, progress: Any) -> None:
        self.trainer, self.inp, self.schedule, self.k, self.progress = trainer, inp, schedule, k, progress
        self.parts: list[tuple[Any, Any]] = []
        self.pending = deque()
        self.exhausted: set[int] = set()
        self.rows = self.batches = 0
        self.done: dict[int, int] = {}  # batches predicted per shard (see `_window`)

    def complete(self) -> bool:
        if len(self.exhausted) == self.trainer.num_workers:
            return True
        counted = self.batches if self.inp.source.batched else self.rows
        return self.inp.expected is not None and counted >= self.inp.expected

    def wants_more(self) -> bool:
        return not self.complete() and len(self.pending) < self.trainer._window(self.inp.per_shard, self.done, self.k)

    def schedule_next(self) -> None:
        self.pending.append(self.schedule(self.k))

    def fold_oldest(self) -> None:
        out = self.pending.popleft().fetch()
        shard = int(out["shard"])
        if out["exhausted"]:
            self.exhausted.add(shard)
        self.done[shard] = self.done.get(shard, 0) + int(out["batches"])
        if out["batches"]:
            self.parts.append((out["keys"], out["preds"]))
            self.rows += len(out["keys"])
            self.batches += int(out["batches"])
            self.progress(self.batches)
