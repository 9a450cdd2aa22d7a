"""Asynchronous parameter-server training of a Keras 3 model on JAX (the ps layouts under
``KERAS_BACKEND=jax``): the chief hands out the epoch's parts and runs the callbacks, the
workers train on the parts with the model's own compiled ``train_step`` and push their weight
deltas to the ps tasks (docs/training.md, "Parameter servers on JAX").
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ... import contract, progress
from ...checkpoints import Preempted, Schedule, interval_from_env, preemption_requested, preemption_signals
from ...contract import PREEMPTED_EXIT_CODE
from .. import callbacks as cb_utils
from .._common import TrainerError
from ..base import fit_sources
from .inputs import EpochInput, batch_rows, epoch_input
from .handout import DONE, HELLO, STARTED, STOP, EpochHandOut, Part, Queues, Report, parts_of_epoch
from .steps import (
    LocalSteps, delta_scales, flat_variables, held_indices, metric_state_size, resumed_iterations, set_metric_states,
)
from .store import ParameterStore, slots_for

logger = logging.getLogger(__name__)

_MODEL_NUMBERS = itertools.count()
#: Seconds the chief waits, at the end of a fit, for the workers to take their stop.
STOP_WAIT = 10.0


@dataclass
class EpochTally:
    """What the chief folded of one epoch's parts."""

    states: np.ndarray
    examples: int = 0
    steps: int = 0
    worker_steps: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # the folded parts' first batches

    @classmethod
    def of(cls, within: dict[str, Any] | None, size: int) -> "EpochTally":
        """A fresh tally, or the one a preempted run saved (`Run.stop_preempted`)."""
        if within is None:
            return cls(np.zeros(size))
        return cls(np.asarray(within["states"], np.float64), int(within["examples"]), int(within["steps"]),
                   {int(w): int(n) for w, n in within["worker_steps"].items()}, set(within["done"]))

    def record(self, epoch: int, num_batches: int, per_part: int) -> dict[str, Any]:
        """What a checkpoint inside ``epoch`` keeps of this tally (`Keeper.save`'s ``within``)."""
        return {"epoch": epoch, "num_batches": num_batches, "per_part": per_part, "done": sorted(self.done),
                "states": self.states.tolist(), "examples": self.examples, "steps": self.steps,
                "worker_steps": {str(w): n for w, n in self.worker_steps.items()}}

    def add(self, part: Part, report: Report) -> None:
        self.states += report.states
        self.examples += report.examples
        self.steps += part.batches
        self.worker_steps[report.worker] = self.worker_steps.get(report.worker, 0) + part.batches
        self.done.add(part.first)


@dataclass(frozen=True)
class StepCount:
    """`AsyncJaxTrainer.global_step`: an int with the ``.numpy()`` of a step variable."""

    value: int

    def numpy(self) -> np.int64:
        return np.int64(self.value)


class AsyncJaxTrainer:
    """fit / evaluate / predict of one model in a ps layout on JAX (one per model)."""

    def __init__(self, model: Any, strategy: Any, steps_per_execution: int | None = None) -> None:
        """``strategy``: `keras_distrib.strategies.AsyncJaxStrategy`."""
        self.model = model
        self.strategy = strategy
        self.number = next(_MODEL_NUMBERS)  # the same on every process: SCRIPT builds its models in order
        compiled = int(getattr(model, "steps_per_execution", 1) or 1)
        self.steps_per_execution = int(steps_per_execution or (compiled if compiled > 1 else 10))
        self.store: ParameterStore | None = None
        self.queues: Queues | None = None
        self.epoch_stats: list[dict[str, Any]] = []
        self.folded_steps = 0  # the chief's: batches folded into the model, over every fit and resume

    @property
    def is_chief(self) -> bool:
        return self.strategy.info.is_chief

    @property
    def global_step(self) -> "StepCount":
        """The batches the chief folded (each exactly once, a resumed run's included), read with
        ``.numpy()`` as the TensorFlow trainers' step variable. 0 on a worker."""
        return StepCount(self.folded_steps)

    def reset_functions(self) -> None:
        """Nothing to retrace: the part size is read at every fit."""

    # -- shared set-up --------------------------------------------------------------

    def _connect_model(self, data: EpochInput) -> None:
        """Build the model's, its loss's, metrics' and optimizer's variables, and find their ps slots."""
        from .. import _private_apis as private

        if self.model.optimizer is None:
            raise TrainerError("the model is not compiled. HINT: call model.compile(optimizer, loss, metrics) "
                               "in the function you pass to build(), as for model.fit.")
        private.symbolic_build(self.model, data.sample())
        if self.store is None:
            values = self._held_values()
            self.store = ParameterStore(slots_for(self.number, values, self.strategy.num_ps))
            self.queues = Queues(self.number, metric_state_size(self.model), self.strategy.num_workers)

    def _variables(self) -> list[Any]:
        return flat_variables(self.model)

    def _held_values(self) -> list[np.ndarray]:
        variables = self._variables()
        return [np.asarray(variables[i].value) for i in held_indices(self.model)]

    def _pull_into_model(self) -> None:
        assert self.store is not None
        variables = self._variables()
        for i, value in zip(held_indices(self.model), self.store.pull()):
            variables[i].assign(value)

    # -- fit ------------------------------------------------------------------------

    @progress.watched
    def fit(self, x: Any = None, y: Any = None, *, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Sequence[Any] | None = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, class_weight: dict[int, float] | None = None,
            sample_weight: Any = None, initial_epoch: int = 0, seed: int | None = 0,
            checkpoint_dir: str | None = None, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int = 1, **unsupported: Any) -> Any:
        """Train like ``model.fit`` (see `keras_distrib.trainers.fit`); the chief returns the History."""
        refuse_unsupported(unsupported)
        source, val_source = fit_sources(x, y, sample_weight, class_weight, validation_split, validation_data)
        data = epoch_input(source, batch_size, shuffle, steps_per_epoch)
        self._connect_model(data)
        run = Run(self, data, seed)
        if not self.is_chief:
            return run.work()
        if validation_data is None and val_source is not None:
            validation_data = val_source.rows_in_memory()  # validation_split's arrays
        validation = None if validation_data is None else Validation(validation_data,
                                                                     validation_batch_size or batch_size,
                                                                     validation_steps)
        return run.lead(epochs, initial_epoch, verbose, callbacks, validation, validation_freq, checkpoint_dir)

    def evaluate(self, x: Any = None, y: Any = None, **kwargs: Any) -> Any:
        """Keras' ``evaluate`` in this process, on the ps tasks' current weights."""
        if self.store is not None:
            self._pull_into_model()
        if isinstance(x, tuple) and y is None:
            x, y = x[0], x[1] if len(x) > 1 else None
        return self.model.evaluate(x, y, **{"verbose": 0, **kwargs})

    def predict(self, x: Any, **kwargs: Any) -> Any:
        """Keras' ``predict`` in this process, on the ps tasks' current weights."""
        if self.store is not None:
            self._pull_into_model()
        return self.model.predict(x, **{"verbose": 0, **kwargs})


def refuse_unsupported(options: dict[str, Any]) -> None:
    given = {k: v for k, v in options.items() if v not in (None, 0, 0.0, False)}
    if given:
        raise TrainerError(
            f"fit({', '.join(f'{k}={v!r}' for k, v in given.items())}) is not supported by the parameter-server "
            "layouts on JAX. HINT: drop it, or use KERAS_BACKEND=tensorflow for the TensorFlow trainer's "
            "options (docs/training.md, Parameter servers on JAX).")


class Run:
    """One fit: the chief's loop over epochs (`lead`) or a worker's over parts (`work`)."""

    def __init__(self, trainer: AsyncJaxTrainer, data: EpochInput, seed: int | None) -> None:
        self.trainer, self.data = trainer, data
        self.seed = random.getrandbits(31) if seed is None else int(seed)
        self.num_batches = data.num_batches
        self.store, self.queues = trainer.store, trainer.queues
        self.run_id = random.getrandbits(48)  # the chief's: its parts and their reports carry it
        self.live: dict[int, int] = {}  # the chief's: worker -> the pid of its latest start
        self.tally: EpochTally | None = None  # the chief's: the epoch being folded
        self.keeper: Keeper | None = None  # the chief's checkpoint, and when the next mid-epoch one is due
        self.schedule: Schedule | None = None
        assert self.store is not None and self.queues is not None

    # -- a worker -------------------------------------------------------------------

    def work(self) -> Any:
        """Take parts until the chief says stop; push each part's deltas, then report it."""
        info = self.trainer.strategy.info
        self.store.wait_initialized(contract.startup_timeout(os.environ), f"{info.job}:{info.index}")
        steps = LocalSteps(self.trainer.model)
        base = self.store.pull()
        state = steps.with_held(steps.initial_state(), base)
        scales = delta_scales(self.trainer.model, self.trainer.strategy.num_workers)
        size = metric_state_size(self.trainer.model)
        me, pid = info.index, os.getpid()
        self.queues.report(0, HELLO, me, pid, report_size=size)
        counted = False
        while (part := self.queues.next_part(me)).epoch != STOP:
            if self.queues.fit_ended(me):  # not needed: a loaded worker would spend tens of seconds on them
                continue
            self.queues.report(part.run, STARTED, me, pid, part.epoch, part.first, report_size=size)
            if not counted:
                counted = True
                state = steps.with_iterations(state, resumed_iterations(part.epoch, part.first, self.num_batches,
                                                                        self.trainer.strategy.num_workers))
            batches = self.data.batches(part.epoch, part.seed, part.first, part.batches)
            state = steps.run(state, batches)
            values = self.store.push_pull([(new - old) * scale for new, old, scale
                                           in zip(steps.held_values(state), base, scales)])
            self.queues.report(part.run, DONE, me, pid, part.epoch, part.first, sum(map(batch_rows, batches)),
                               steps.metric_states(state), size)
            state, base = steps.with_held(state, values), values
            progress.tick(part.batches)
        steps.write_back(steps.with_held(state, base))
        if part.first:  # the chief saved a checkpoint on a preemption signal: the job stops to be requeued
            logger.info("%s:%d stops: the job was preempted (%s)", info.job, me, signal.Signals(part.first).name)
            raise Preempted(part.first)
        return self.chiefs_history(me)

    def chiefs_history(self, me: int) -> Any:
        """The History the chief's fit returned, so SCRIPT reads the same one on every process."""
        import keras

        history = keras.callbacks.History()
        history.set_model(self.trainer.model)
        sent = self.queues.take_history(me)
        if sent is not None:
            saved = json.loads(sent)
            history.history, history.epoch, history.params = saved["history"], saved["epoch"], saved["params"]
        self.trainer.model.history = history
        return history

    # -- the chief ------------------------------------------------------------------

    def lead(self, epochs: int, initial_epoch: int, verbose: Any, callbacks: Sequence[Any] | None,
             validation: "Validation | None", validation_freq: int, checkpoint_dir: str | None) -> Any:
        """Hand out every epoch, fold the reports, run the callbacks and keep the checkpoint."""
        model, callbacks = self.trainer.model, cb_utils.with_history(callbacks)
        keeper = self.keeper = Keeper(checkpoint_dir, model, callbacks)
        resumed = keeper.restore()
        start = max(initial_epoch, 0 if resumed is None else resumed + 1)
        self.trainer.folded_steps = start * self.num_batches
        if checkpoint_dir is not None:
            self.schedule = Schedule(interval_from_env(), 0)
        if resumed is not None:  # CSVLogger files continue, not restart
            cb_utils.continue_csv_logs(callbacks, start)
        within = keeper.within_epoch(start, self.num_batches, self.trainer.steps_per_execution)
        self.store.assign(self.trainer._held_values())
        cbs = cb_utils.callback_list(callbacks, model, epochs=epochs, steps=self.num_batches,
                                     verbose=verbose_level(verbose), show=True)
        self.batch_logs = cb_utils.needs_batch_logs(cbs)
        model.stop_training = False
        cbs.on_train_begin()
        keeper.restore_callbacks()
        logs: dict[str, Any] = {}
        progress.training_ended(False)
        with preemption_signals(enabled=checkpoint_dir is not None):
            for epoch in range(start, epochs):
                cbs.on_epoch_begin(epoch)
                logs = self.lead_epoch(epoch, epochs, cbs, within if epoch == start else None)
                self.trainer._pull_into_model()
                if (signum := preemption_requested()) is not None:
                    self.stop_preempted(keeper, epoch, signum)
                if validation is not None and (epoch + 1) % max(1, validation_freq) == 0:
                    logs.update(validation.run(model))
                cbs.on_epoch_end(epoch, logs)
                progress.training_ended(epoch + 1 >= epochs or model.stop_training)  # before the checkpoint is noted
                keeper.save(epoch, steps=(epoch + 1) * self.num_batches)
                if self.schedule is not None:
                    self.schedule.mark(0)
                if model.stop_training:
                    break
        if start >= epochs:
            logger.info("every one of the %d epochs was done (checkpoint in %s): nothing to train", epochs,
                        checkpoint_dir)
        history = model.history
        self.queues.send_history(json.dumps({"history": history.history, "epoch": history.epoch,
                                             "params": history.params}, default=float))
        self.queues.stop_workers(self.run_id, STOP_WAIT)
        cbs.on_train_end(logs)
        return history

    def stop_preempted(self, keeper: "Keeper", epoch: int, signum: int) -> None:
        """Save where the epoch is (its parts folded so far), stop every worker, exit to be requeued."""
        tally = self.tally
        assert tally is not None
        self.save_within(keeper, epoch, tally)
        logger.info("got %s: saved a checkpoint in %s at epoch %d, %d of %d batches into it; stopping with exit code "
                    "%d so the job can be requeued.", signal.Signals(signum).name, keeper.directory, epoch + 1,
                    tally.steps, self.num_batches, PREEMPTED_EXIT_CODE)
        self.queues.stop_workers(self.run_id, STOP_WAIT, signum)
        raise Preempted(signum)

    def save_within(self, keeper: "Keeper", epoch: int, tally: EpochTally) -> None:
        """A checkpoint inside ``epoch``: the ps's values now and the parts folded so far.

        Parts in flight may have pushed already: a run resumed from it trains them again (at
        least once, as the TensorFlow trainer re-runs a dead worker's closures); the metrics
        count each example once (the tally is restored with the weights)."""
        self.trainer._pull_into_model()
        keeper.save(epoch - 1, steps=epoch * self.num_batches + tally.steps,
                    within=tally.record(epoch, self.num_batches, self.trainer.steps_per_execution))

    def lead_epoch(self, epoch: int, epochs: int, cbs: Any, within: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hand out one epoch's parts and fold each one's report exactly once (``within``: the
        parts a preempted run folded already, from its checkpoint). A preemption signal ends the
        hand-out early: `tally` then holds what was folded."""
        started_at = time.perf_counter()
        model = self.trainer.model
        for metric in model.metrics:
            metric.reset_state()
        reset = [np.asarray(v.value) for v in model.metrics_variables]
        tally = self.tally = EpochTally.of(within, metric_state_size(model))
        self.trainer.folded_steps = epoch * self.num_batches + tally.steps
        parts = [p for p in parts_of_epoch(self.run_id, epoch, self.num_batches, self.trainer.steps_per_execution,
                                           self.seed) if p.first not in tally.done]
        hand = EpochHandOut(self.queues, parts, self.live) if parts else None
        while hand is not None and hand.open and preemption_requested() is None:
            for report in hand.wait():
                part = hand.fold(report)
                if part is None:
                    continue
                tally.add(part, report)
                self.trainer.folded_steps += part.batches
                progress.tick(part.batches)
                if self.schedule is not None and self.keeper is not None and self.schedule.due(tally.steps) \
                        and tally.steps < self.num_batches:
                    self.save_within(self.keeper, epoch, tally)
                    self.schedule.mark(tally.steps)
                if self.batch_logs:
                    set_metric_states(model, tally.states, reset)
                    cbs.on_train_batch_end(tally.steps - 1, running_logs(model))
        set_metric_states(model, tally.states, reset)
        if preemption_requested() is not None:
            return running_logs(model)
        if self.data.rows is not None and tally.examples != self.data.rows:
            raise AssertionError(f"epoch {epoch}: {tally.examples} examples folded of {self.data.rows}")
        seconds = time.perf_counter() - started_at
        stats = {"epoch": epoch, "seconds": seconds, "steps": tally.steps, "examples": tally.examples,
                 "steps_per_sec": tally.steps / max(seconds, 1e-9), "parts_per_worker": dict(tally.worker_steps)}
        self.trainer.epoch_stats.append(stats)
        logger.info("epoch %d/%d: %.1f s, %.1f steps/s (%s)", epoch + 1, epochs, seconds, stats["steps_per_sec"],
                    ", ".join(f"worker {w}: {n} steps" for w, n in sorted(tally.worker_steps.items())))
        return running_logs(model)


def running_logs(model: Any) -> dict[str, float]:
    return {k: float(v) for k, v in model.get_metrics_result().items()}


def verbose_level(verbose: Any) -> int:
    """Keras' ``verbose``: "auto" is one line per epoch here (a job's output is a log file)."""
    return 2 if verbose == "auto" else int(verbose)


@dataclass(frozen=True)
class Validation:
    """fit's validation: Keras' ``evaluate`` on the chief, on the epoch's final weights (the ``val_`` logs)."""

    data: Any
    batch_size: int | None
    steps: int | None

    def run(self, model: Any) -> dict[str, float]:
        options = {"batch_size": self.batch_size, "steps": self.steps, "verbose": 0, "return_dict": True}
        if isinstance(self.data, tuple):
            x, y, *rest = self.data
            result = model.evaluate(x, y, sample_weight=rest[0] if rest else None, **options)
        else:
            result = model.evaluate(self.data, **options)
        return {f"val_{k}": float(v) for k, v in result.items()}


class Keeper:
    """The chief's checkpoint in ``checkpoint_dir``: the weights after the last whole epoch,
    and the state of the callbacks that remember earlier epochs (EarlyStopping's, ...)."""

    def __init__(self, directory: str | None, model: Any, callbacks: Sequence[Any]) -> None:
        self.directory = None if directory is None else os.path.join(directory, "jax-ps")
        self.model, self.callbacks = model, callbacks
        self.saved_callbacks: Any = None
        self.within: dict[str, Any] | None = None

    def restore(self) -> int | None:
        """The last epoch done (None without a checkpoint); the model holds its weights."""
        if self.directory is None or not os.path.exists(os.path.join(self.directory, "epoch.json")):
            return None
        with open(os.path.join(self.directory, "epoch.json")) as f:
            saved = json.load(f)
        self.model.load_weights(os.path.join(self.directory, "model.weights.h5"))
        self.saved_callbacks = saved.get("callbacks")
        self.within = saved.get("within")
        if self.within:
            logger.info("resuming from %s: epoch %d, %d of %d batches into it", self.directory,
                        self.within["epoch"] + 1, self.within["steps"], self.within["num_batches"])
        else:
            logger.info("resuming from %s: epoch %d done", self.directory, saved["epoch"] + 1)
        return None if saved["epoch"] < 0 and not self.within else int(saved["epoch"])

    def within_epoch(self, epoch: int, num_batches: int, per_part: int) -> dict[str, Any] | None:
        """The parts of ``epoch`` a preempted run folded, where they are parts of this run's epoch."""
        within = self.within
        if not within or within["epoch"] != epoch:
            return None
        if (within["num_batches"], within["per_part"]) != (num_batches, per_part):
            logger.warning("the checkpoint in %s was saved %d batches into epoch %d, with %d batches an epoch in parts "
                           "of %d; this run has %d in parts of %d, so the epoch runs whole again.", self.directory,
                           within["steps"], epoch + 1, within["num_batches"], within["per_part"], num_batches, per_part)
            return None
        return within

    def restore_callbacks(self) -> None:
        """After ``on_train_begin``, which resets them."""
        cb_utils.restore_callback_state(self.callbacks, self.saved_callbacks)

    def save(self, epoch: int, steps: int, within: dict[str, Any] | None = None) -> None:
        """Weights first, then the epoch (``within``: the parts of the next epoch folded, after a
        preemption): a crash between the two resumes from the newer weights and runs those
        parts once more; the files are never half written (each replaced whole). ``steps``:
        the batches trained in all, for the agent's re-forming line."""
        if self.directory is None:
            return
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(self.directory, "next.weights.h5")
        self.model.save_weights(tmp)
        os.replace(tmp, os.path.join(self.directory, "model.weights.h5"))
        with open(os.path.join(self.directory, "epoch.json.tmp"), "w") as f:
            json.dump({"epoch": epoch, "callbacks": cb_utils.callback_state(self.callbacks), "within": within}, f)
        os.replace(os.path.join(self.directory, "epoch.json.tmp"), os.path.join(self.directory, "epoch.json"))
        progress.checkpointed(steps, epoch + 1 if within is None else epoch + 2)
