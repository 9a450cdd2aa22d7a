"""Asynchronous parameter-server training for Keras 3 models (ParameterServerStrategy).

Contracts (the decisions behind them, with their measurements: docs/performance.md,
"The parameter-server trainer's decisions"):

* A scheduled closure runs up to K steps (``steps_per_execution``, default 10) of one
  worker's shard and returns its loss/count/steps/metric-state sums packed in one float64
  vector; the chief folds the results in order, so epoch logs are exact.
* Exact step: an int64 ``global_step`` on a ps advances with atomic ``assign_add``; each
  closure reserves its K step numbers, and ``optimizer.iterations`` is set to the counter
  at every epoch end. A closure a dead worker ran is run again (at least once).
* Exact epochs: every example of every shard once per epoch. Arrays and ``tf.data`` of
  known size are handed out dynamically in parts (`DynamicInput`, `DynamicDatasetInput`)
  so a slow worker runs fewer; other inputs keep fixed per-worker shards
  (`PerWorkerInput`), files counted in their first epoch. A step that may find its shard
  ended is guarded; closures every shard can fill run unguarded.
* With ``steps_per_epoch`` the iterators repeat and exactly that many steps run.
* Callbacks see batch hooks at closure granularity; ``model.stop_training`` stops
  scheduling at the next closure.
* Opt-in modes that change the semantics: stale reads (gradients at the closure's first
  read of the weights) and local steps (K steps on a local copy, changes added to the ps).
* A model's own ``train_step``/``test_step`` runs for every step, variables on the ps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import Any, Callable, Iterator

from .. import data as kd_data
from . import _private_apis as private
from . import packing
from . import steps as step_contract
from ._common import FitStream, TrainerError, empty_like, refuse_keras_loops, resolve_strategy
from .base import ChunkHooks, Trainer, steps_for_shards
from .metrics import Totals, all_finite, batch_size_of, pack_totals, step_totals, unpack, unpack_totals, zeros_totals
from .lookups import warn_tables_on_the_chief
from .placement import placement_scope

logger = logging.getLogger(__name__)

_BOTH_MODES = ("ps_stale_reads and ps_local_steps cannot both be on. HINT: choose one of them "
               "(or neither, the default).")

#: Chunks up to this many steps are unrolled in the trace; longer ones use a graph loop.
MAX_UNROLLED_STEPS = 32
#: ...and only while steps x trainable variables stays below this: trace time and graph
#: size grow with both, and for big models the loop's per-step cost matters little.
MAX_UNROLLED_VARIABLE_STEPS = 4000
#: ...and only while the chunk's other steps would trace within this many seconds (at the
#: first step's trace time): a step that is slow to trace is a big step, which the loop's
#: per-step cost hardly slows, while each unrolled copy also costs the worker's compile.
UNROLL_TRACE_BUDGET_S = 5.0
#: Arrays up to this size are handed out dynamically (`DynamicInput`: each worker holds
#: them whole, sent as a constant of a graph, which protobuf caps at 2 GiB); bigger ones
#: keep fixed shards (1/k of them per worker).
MAX_DYNAMIC_BYTES = 1 << 30

#: The number of the empty batches after the end of a `DynamicDatasetInput` stream.
PAST_THE_END = 1 << 62
#: Run numbers of epoch ``e`` of a `DynamicDatasetInput` stream start at ``e * EPOCH_RUNS``:
#: one stream runs through every epoch of a fit, numbered without a gap or an overlap.
EPOCH_RUNS = 1 << 36


def with_countdown(ds: Any) -> Any:
    """``(left, element)`` for each element of the finite ``ds`` of known cardinality, where
    ``left`` counts the elements left, this one included (the last one has 1)."""
    left = ds.cardinality()
    return ds.enumerate().map(lambda i, element: (left - i, element))


def without_autotune(ds: Any, source: Any) -> Any:
    """``ds`` without tf.data's autotuning, unless the user's dataset sets it: a fresh
    pipeline each epoch under autotuning stalled the epoch's first closure about 1 s in 1
    epoch of 4 (docs/performance.md); without it, AUTOTUNE settings keep tf.data's defaults."""
    import tensorflow as tf

    dataset = getattr(source, "dataset", None)
    if dataset is not None and dataset.options().autotune.enabled is not None:
        return ds
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


class _Batches:
    """The batches of a counted iterator (`with_countdown`), ``first`` (already fetched)
    first; an iterator for the trace-time Python of the steps, as ``next()`` calls."""

    def __init__(self, iterator: Any, first: Any = None) -> None:
        self._iterator, self._first = iterator, first

    @property
    def element_spec(self) -> Any:
        return self._iterator.element_spec[1]

    def __next__(self) -> Any:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return next(self._iterator)[1]


class _RunBatches:
    """The batches of a `DynamicDatasetInput` stream from batch ``offset`` of the run
    ``first`` (already fetched): each run holds ``per_run`` batches in a row (one of each
    shard); an iterator for the trace-time Python of the steps, as ``next()`` calls, that
    fetches the next run after the last batch of this one."""

    def __init__(self, iterator: Any, first: Any, per_run: int, stacked: bool, offset: int = 0) -> None:
        self._iterator, self._run, self._per_run, self._stacked, self._at = iterator, first, per_run, stacked, offset

    @property
    def element_spec(self) -> Any:
        """The spec of one batch."""
        import tensorflow as tf

        run = self._iterator.element_spec[1]
        if not self._stacked:
            return run
        return tf.nest.map_structure(lambda spec: tf.TensorSpec([None, *spec.shape[2:]], spec.dtype), run[1])

    @property
    def left_in_run(self) -> int:
        """Batches of the current run not taken yet (0 before the first of a fresh one)."""
        return 0 if self._run is None else self._per_run - self._at

    def __next__(self) -> Any:
        if self._run is None or self._at == self._per_run:
            self._run, self._at = next(self._iterator)[1], 0
        self._at += 1
        return batch_of_run(self._run, self._at - 1, self._per_run, self._stacked)

    def loop(self, advance: Any, carry: Any, num_steps: Any) -> Any:
        """``num_steps`` more steps with the runs in a graph loop (the rest of this run and
        the last part-run unrolled): the loop body fetches a run and traces its steps."""
        import tensorflow as tf

        if isinstance(num_steps, tf.Tensor):
            return self._counted_loop(advance, carry, num_steps)
        now = min(num_steps, self.left_in_run)
        for _ in range(now):
            carry = advance(self, carry)
        runs, tail = divmod(num_steps - now, self._per_run)

        def body(i: Any, c: Any) -> tuple[Any, Any]:
            batches = _RunBatches(self._iterator, None, self._per_run, self._stacked)
            for _ in range(self._per_run):
                c = advance(batches, c)
            return i + 1, c

        if runs:
            carry = tf.while_loop(lambda i, _: i < runs, body, (tf.constant(0), carry))[1]
        batches = _RunBatches(self._iterator, None, self._per_run, self._stacked)
        for _ in range(tail):
            carry = advance(batches, carry)
        return carry

    def _counted_loop(self, advance: Any, carry: Any, num_steps: Any) -> Any:
        """``num_steps`` (a tensor) steps from the start of the current run, one run per
        iteration; one trace serves every count. The next run is fetched only while steps
        remain: a run read past the part would be missing from the next part on this worker."""
        import tensorflow as tf

        per_run, iterator = self._per_run, self._iterator

        def body(r: Any, c: Any, run: Any) -> tuple[Any, Any, Any]:
            # Batch 0 of a run the loop entered always runs; the others while steps remain.
            c = advance(_RunBatches(iterator, run, per_run, self._stacked, 0), c)
            for j in range(1, per_run):
                c = tf.cond(r * per_run + j < num_steps,
                            lambda j=j, c=c: advance(_RunBatches(iterator, run, per_run, self._stacked, j), c),
                            lambda c=c: c)
            run = tf.cond((r + 1) * per_run < num_steps, lambda: iterator.get_next()[1], lambda: run)
            return r + 1, c, run

        runs = (num_steps + per_run - 1) // per_run
        return tf.while_loop(lambda r, c, run: r < runs, body, (tf.zeros_like(num_steps), carry, self._run))[1]


def batch_of_run(run: Any, index: int, per_run: int, stacked: bool) -> Any:
    """Batch ``index`` of a run of a `DynamicDatasetInput` stream: of the examples of a run,
    rows ``index``, ``index + per_run``, ... (shard ``index``'s batch); of ``stacked``
    batches (``(rows of each, the batches padded to the longest)``), batch ``index``'s rows."""
    import tensorflow as tf

    if stacked:
        rows, batches = run
        return tf.nest.map_structure(lambda a: a[index][:rows[index]], batches)
    return run if per_run == 1 else tf.nest.map_structure(lambda a: a[index::per_run], run)


class PerWorkerInput:
    """Per-worker datasets over disjoint shards of a `Source`; iterators made per epoch."""

    def __init__(self, coordinator: Any, source: Any, *, batch_size: int | None, shuffle: bool,
                 seed: int | None, repeat: bool, countdown: bool = False) -> None:
        import tensorflow as tf

        self.coordinator = coordinator
        self.source = source
        self.repeat = repeat
        k = self.num_shards = len(private.coordinator_workers(coordinator))

        def dataset_fn(index: int, epoch: Any) -> Any:
            return kd_data.pipeline(source, index, k, batch_size=batch_size, shuffle=shuffle,
                                    seed=seed, repeat=repeat, epoch=epoch)

        self.sample = dataset_fn(0, 0)  # local, for building metrics on the chief
        #: Each element comes as ``(batches left in the shard, counting it, batch)``: every
        #: shard's size is known to tf.data (the same pipeline on every worker, so shard 0's
        #: cardinality tells), and a closure then decides once whether its K steps can run
        #: unguarded (see `ParameterServerTrainer._make_fn`).
        self.counted = countdown and not repeat and int(self.sample.cardinality()) >= 0
        # A pipeline that calls the chief's Python keeps one closure kind per epoch: a
        # second traced while it ran hung the chief in TF's Context.add_c_function.
        python = kd_data.dataset_runs_python(self.sample)
        # Files are dealt whole: num_examples dealt by example is not their shards' sizes,
        # and an epoch ends where every worker's files end (as in all-reduce).
        whole_files = getattr(source, "same_shard_sizes_every_epoch", False) and not repeat
        #: The shards' sizes are unknown to tf.data but the same every epoch (files dealt
        #: to workers): the first epoch that runs whole counts them (`learn`).
        self.learns = countdown and whole_files and not self.counted and not python
        self.learned = self._announce = False
        per_shard = steps_for_shards(source.num_examples, k, None if source.batched else batch_size)
        known = source.shard_sizes(k) if self.counted and not python else None
        #: Batches of each shard in every epoch, where they are sure (sizes the source
        #: states, or counted: `learn`): the chief then sends the closures that every shard
        #: can fill without a look or a guard (`shards_can_fill`). None else.
        self.sure_steps = None if known is None else (known if source.batched else
                                                       [-(-size // batch_size) for size in known])
        #: Steps of one epoch (sum over shards), None if the size is unknown.
        self.steps = None if per_shard is None else sum(per_shard)
        #: Steps of each shard in one epoch (shard i is worker i's), None if unknown.
        self.per_shard = None if whole_files else per_shard
        #: The iterators repeat and no shard is empty: a step can never find its input ended.
        self.endless = repeat and per_shard is not None and min(per_shard) > 0
        #: What the closures count until the epoch is complete: examples, or batches.
        self.expected = None if whole_files else source.num_examples
        self._persistent = None
        #: Iterators made per worker for the current epoch: more than one, a worker was
        #: recovered and read its shard again, and the epoch teaches no sizes.
        self.made = [0] * k

        #: An in-memory cache (``cache=True``) kept across the fit's epochs: each worker's
        #: shard, which holds the cache, is made once (`_shards`), and each epoch's pipeline
        #: reads it (a fresh shard each epoch parsed every epoch again: 0.71x / 0.79x).
        self.kept = not repeat and kd_data.keeps_cache(source)
        self._shards = None

        def worker_dataset(index: int, epoch: Any, elements: Any = None) -> Any:
            if elements is None:
                ds = dataset_fn(index, epoch)
            else:
                ds = kd_data.epoch_batches(source, elements, index, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                           epoch=epoch)
            if not repeat:  # a fresh pipeline each epoch
                ds = without_autotune(ds, source)
            return with_countdown(ds) if self.counted else ds

        epoch_spec = tf.TensorSpec([], tf.int64)
        if self.kept:
            shard_spec = tf.data.DatasetSpec(source.shard(0, k).element_spec)
            self._shard_fns = [tf.function(lambda i=i: source.shard(i, k)).get_concrete_function() for i in range(k)]
            def over_shard(index: int) -> Callable[[Any, Any], Any]:
                return lambda elements, epoch: worker_dataset(index, epoch, elements)

            self._concrete = [
                tf.function(over_shard(i), input_signature=[shard_spec, epoch_spec]).get_concrete_function()
                for i in range(k)
            ]
        else:
            self._concrete = [
                tf.function(lambda e, i=i: worker_dataset(i, e), input_signature=[epoch_spec]).get_concrete_function()
                for i in range(k)
            ]

    def learn(self, steps_per_shard: dict[int, int], least: int) -> None:
        """Take the batches each shard held in an epoch that ran whole as every later
        epoch's, if every shard holds at least ``least`` (else closures could hardly ever be
        sure, and their own trace would cost more than they save)."""
        if not self.learns or any(n != 1 for n in self.made):
            return
        self.learns = False
        sizes = [steps_per_shard.get(i, 0) for i in range(self.num_shards)]
        self.steps = sum(sizes)  # the later epochs' progress bars show it, not the estimate
        if min(sizes) < least:
            logger.debug("shards of %s batches: each step keeps its guard", sizes)
            return
        self.learned, self._announce, self.per_shard, self.sure_steps = True, True, sizes, sizes

    def iterator(self, epoch: int) -> Any:
        """Fresh finite iterators for ``epoch`` (one persistent repeated one with ``repeat``)."""
        import tensorflow as tf

        if self.repeat and self._persistent is not None:
            return self._persistent
        if self._announce:  # when first used: Keras' progress bar has ended its line
            self._announce = False
            logger.info("the shards of this %s hold %s batches every epoch, counted in the first: this epoch "
                        "and the later ones run without a guard up to each shard's last few steps.",
                        type(self.source).__name__, self.sure_steps)
        made = self.made = [0] * self.num_shards
        if self.kept and self._shards is None:
            self._shards = private.per_worker_values(self.coordinator, self._shard_fns)

        def make(index: int, concrete: Any, *shard: Any) -> Any:
            made[index] += 1  # the coordinator makes it again for a recovered worker
            return iter(concrete(*shard, tf.constant(epoch, tf.int64)))

        makers = [lambda *shard, i=i, c=c: make(i, c, *shard) for i, c in enumerate(self._concrete)]
        it = private.per_worker_iterator(self.coordinator, makers, self._concrete[0].structured_outputs,
                                         (self._shards,) if self.kept else None)
        if self.repeat:
            self._persistent = it
        return it


class _Gathered:
    """The batches of one closure's part of the epoch, gathered on the worker from the whole
    arrays (``full``) by the row ``indices`` the chief sent; an iterator for the trace-time
    Python of the steps, as ``next()`` calls (step ``s`` takes rows ``s*B`` to ``s*B+B``)."""

    def __init__(self, full: Any, indices: Any, batch_size: int, step: Any = 0) -> None:
        self._full, self._indices, self._batch_size, self._step = full, indices, batch_size, step

    @property
    def element_spec(self) -> Any:
        import tensorflow as tf

        return tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), self._full)

    def __next__(self) -> Any:
        import tensorflow as tf

        start = self._step * self._batch_size
        self._step += 1
        rows = self._indices[start:start + self._batch_size]
        return tf.nest.map_structure(lambda a: tf.gather(a, rows), self._full)

    def loop(self, advance: Any, carry: Any, num_steps: int) -> Any:
        """``num_steps`` more steps in a graph loop, step ``s`` of the part at its rows."""
        import tensorflow as tf

        first = self._step
        self._step += num_steps

        def body(i: Any, c: Any) -> tuple[Any, Any]:
            return i + 1, advance(_Gathered(self._full, self._indices, self._batch_size, first + i), c)

        return tf.while_loop(lambda i, _: i < num_steps, body, (tf.constant(0), carry))[1]


class DynamicInput:
    """Exact epochs handed out dynamically: the shards are today's (element ``i``
    to shard ``i % k``, each batched on its own, so the steps of an epoch are the same), but
    every worker holds the whole arrays and a part of any shard (up to K of its steps) goes
    to whichever worker is free, so a slow worker runs fewer parts instead of holding the
    epoch back. The chief draws each shard's order and sends a part's row numbers with its
    closure; the parts of an epoch are a fixed sequence (shards taken in turn), so a
    mid-epoch checkpoint resumes at exactly the next part.

    Not TensorFlow's tf.data service (``ShardingPolicy.DYNAMIC``): its guarantee is at most
    once, in an order that is not reproducible ("some may be missed if a tf.data service
    worker gets restarted", its API docs, TF 2.21), which neither exact epochs nor an exact
    resume allow, and it needs a dispatcher and workers of its own.

    For unbatched in-memory arrays (`keras_distrib.data.ArraySource`) up to
    `MAX_DYNAMIC_BYTES` only; every other input keeps fixed per-worker shards
    (`PerWorkerInput`).
    """

    repeat = False
    endless = False
    counted = False
    per_shard = None

    def __init__(self, coordinator: Any, source: Any, *, batch_size: int, shuffle: bool, seed: int | None) -> None:
        import tensorflow as tf

        self.source, self.batch_size, self.shuffle, self.seed = source, batch_size, shuffle, seed
        self.num_shards = len(private.coordinator_workers(coordinator))
        arrays = source.arrays
        # The whole arrays once per worker and fit (a constant of the dataset's graph, sent
        # when the iterator is made); each closure reads them by reference.
        per_worker = coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.from_tensors(arrays).repeat())
        self.full = iter(per_worker)
        self.sample = tf.data.Dataset.from_tensor_slices(kd_data.map_nest(lambda a: a[:batch_size], arrays)
                                                         ).batch(batch_size)  # for the chief's metrics
        #: Examples, and steps of one epoch (each shard's last batch may be short).
        self.expected = source.num_examples
        self.shard_steps = steps_for_shards(self.expected, self.num_shards, batch_size)
        self.steps = sum(self.shard_steps)

    @staticmethod
    def takes(source: Any) -> bool:
        """True for unbatched in-memory arrays nested in tuples and dicts (a list inside the
        nest is one tensor to tf.data, not rows to gather)."""
        def plain(nest: Any) -> bool:
            if isinstance(nest, dict):
                return all(plain(v) for v in nest.values())
            if isinstance(nest, tuple):
                return all(plain(v) for v in nest)
            return nest is not None and not isinstance(nest, list)

        if not (isinstance(source, kd_data.ArraySource) and not source.batched and source.num_examples
                and plain(source.arrays)):
            return False
        return sum(int(getattr(a, "nbytes", 0)) for a in kd_data.flatten_nest(source.arrays)) <= MAX_DYNAMIC_BYTES

    def parts(self, epoch: int, first_step: int, num_steps: int, k: int) -> Iterator[tuple[int, Any]]:
        """``(steps, rows)`` of each closure for steps ``first_step`` .. ``+ num_steps`` of
        the epoch (`keras_distrib.data.epoch_parts`)."""
        rows = kd_data.shard_rows(self.expected, self.num_shards, epoch=epoch, shuffle=self.shuffle, seed=self.seed)
        return kd_data.epoch_parts(rows, self.batch_size, k, first_step, num_steps)


class DynamicDatasetInput:
    """Exact epochs of a ``tf.data.Dataset`` of known size handed out dynamically.

    Every worker builds the same stream of the fit's epochs (the dataset's own shuffles are
    seeded alike on every worker, per epoch, as with fixed shards:
    `keras_distrib.data.DatasetSource`), in runs of ``k * B`` elements, numbered. A run holds one batch of each of the k fixed
    shards (rows ``s, s + k, ...`` are shard ``s``'s next batch), so the batches and the
    steps of an epoch are the same; batch ``j`` of the epoch is batch ``j % k`` of run
    ``j // k`` (a batched dataset: k of its batches stacked a run). A closure gets the number of its first
    batch (its part: whole runs, up to K batches), reads past the runs other workers took
    and trains on its own. Every worker reads the whole epoch, as it does with fixed shards
    (``Dataset.shard`` keeps 1 element in k of the whole pipeline); a whole run per element
    rather than a batch: a stream of batches, cut by ``flat_map``, cost about 1.5 ms more
    per step than fixed shards (docs/performance.md).

    A worker takes its closures in order, so its stream only moves forward; a closure the
    coordinator re-runs on another worker (its first worker was lost) may find that
    worker's stream past its part: it runs no step and says so, and the chief runs the part
    again on fresh streams (`ParameterServerTrainer._run`).

    For datasets whose elements are plain tensors of known rank (no ragged or sparse parts),
    whose size tf.data knows or one pass counted, and that run no Python (``from_generator``,
    ``tf.py_function``: every worker would read the whole epoch through the chief's Python;
    a 3-worker job of one hung when the chief removed a function meanwhile).
    """

    repeat = False
    endless = False
    counted = False
    per_shard = None

    def __init__(self, coordinator: Any, source: Any, *, batch_size: int | None, shuffle: bool,
                 seed: int | None) -> None:
        import tensorflow as tf

        self.coordinator, self.source, self.batch_size = coordinator, source, batch_size
        k = self.num_shards = len(private.coordinator_workers(coordinator))
        #: Batches in each run of the stream (the last run may hold fewer).
        self.per_run = k
        #: A batched dataset's runs are k of its batches stacked (see `batch_of_run`).
        self.stacked = source.batched

        def with_rows(*batch: Any) -> Any:
            batch = batch[0] if len(batch) == 1 else batch  # tf.data spreads a tuple over arguments
            return tf.shape(tf.nest.flatten(batch)[0])[0], batch

        def one_epoch(epoch: Any) -> Any:
            order = kd_data.Order(shuffle=shuffle, seed=seed, epoch=epoch)
            ds = source.epoch_elements(0, 1, order)  # the whole epoch, in the order every worker draws
            if source.batched:
                ds = ds.map(with_rows).padded_batch(k)
            else:
                ds = source.finish_batches(ds.batch(k * batch_size))
            return ds.enumerate(epoch * EPOCH_RUNS)

        def stream(first: Any, last: Any) -> Any:
            # Epochs first..last in one stream: the next epoch's runs are prefetched while
            # this one ends, as with a repeated input (a fresh stream each epoch cost the
            # epoch's first closure its wait).
            ds = tf.data.Dataset.range(first, last + 1).flat_map(one_epoch)
            # Past the last run, an endless empty one numbered beyond every part: a
            # stream that a re-run part finds at its end reads as "behind", not an error.
            empty = tf.nest.map_structure(empty_like, ds.element_spec[1])
            end = tf.data.Dataset.from_tensors((tf.constant(PAST_THE_END, tf.int64), empty)).repeat()
            return without_autotune(ds.prefetch(tf.data.AUTOTUNE).concatenate(end), source)

        self.sample = kd_data.pipeline(source, 0, 1, batch_size=batch_size, shuffle=False, seed=seed,
                                       repeat=False)  # for the chief's metrics
        epoch_spec = tf.TensorSpec([], tf.int64)
        self._concrete = tf.function(stream, input_signature=[epoch_spec, epoch_spec]).get_concrete_function()
        self._streams = FitStream(self._make)  # the streams of a fit's epochs
        self._epoch = 0  # the epoch a recovered worker's fresh stream starts at
        self.expected = source.num_examples
        #: Steps of one epoch: the batches of every shard (each shard's last one may be short).
        self.steps = sum(steps_for_shards(source.num_examples, k, None if source.batched else batch_size))

    @staticmethod
    def takes(source: Any) -> bool:
        """True for a `keras_distrib.data.DatasetSource` of known size, without Python in its
        pipeline, whose elements are plain tensors of known rank (a batch is cut by rows;
        the end is an empty batch)."""
        import tensorflow as tf

        if not isinstance(source, kd_data.DatasetSource) or not source.num_examples or source.runs_python():
            return False
        specs = tf.nest.flatten(source.dataset.element_spec)
        return all(type(s) is tf.TensorSpec and s.shape.rank is not None for s in specs)

    def iterator(self, epoch: int, last: int | None = None) -> tuple[Any, Any]:
        """``(streams, sources)``, one of each per worker: the streams hold ``epoch`` and
        the epochs after it up to ``last`` (None: ``epoch`` alone, made anew each call: an
        evaluation); training asks for each epoch with the fit's last one and gets the same
        streams, at that epoch's runs or ahead of them. A source yields, for each epoch of
        the streams, ``(epoch, a fresh stream from it)``: a closure whose part its worker's
        stream has passed (it was re-run there after its own worker was lost) reads its
        runs from a fresh one (`skip_to`)."""
        self._epoch = epoch
        return self._make(epoch, epoch) if last is None else self._streams.get(epoch, last)

    def _make(self, first: int, last: int) -> tuple[Any, Any]:
        import tensorflow as tf

        def start() -> tuple[Any, Any]:
            # The coordinator runs the makers again for a recovered worker: its streams
            # start at the epoch running then, not at the fit's first.
            return tf.constant(max(first, self._epoch), tf.int64), tf.constant(last, tf.int64)

        def sources(begin: Any, end: Any) -> Any:
            return tf.data.Dataset.from_tensors(tf.data.Dataset.range(begin, end + 1).map(
                lambda e: (e, self._concrete(e, end)))).repeat()

        streams = private.per_worker_iterator(self.coordinator, [lambda: iter(self._concrete(*start()))] * self.num_shards,
                                              self._concrete.structured_outputs)
        spec = sources(tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        fresh = private.per_worker_iterator(self.coordinator, [lambda: iter(sources(*start()))] * self.num_shards, spec)
        return streams, fresh

    def first_batch(self, epoch: int, first: int) -> int:
        """The number a closure gets for batch ``first`` of ``epoch``: its place in the
        stream of every epoch (`EPOCH_RUNS`)."""
        return epoch * EPOCH_RUNS * self.per_run + first

    def parts(self, epoch: int, first_step: int, num_steps: int, k: int) -> Iterator[tuple[int, int]]:
        """``(steps, number of the first batch)`` of each closure: whole runs in a row, K
        batches or the most whole runs below that (at least one run; fewer near the end,
        `keras_distrib.data.tail_part_limit`); a start inside a run (a checkpoint of another
        worker count) first goes up to a run's end."""
        at, end = first_step, first_step + num_steps
        while at < end:
            size = kd_data.tail_part_limit(end - at, k, self.per_run, self.per_run)
            n = min(end - at, size - at % self.per_run)
            yield n, at
            at += n

    def offset(self, first: int) -> int:
        """Where in its run the part starting at batch ``first`` starts (0 but after a
        resume inside a run)."""
        return first % self.per_run

    def full_part(self, k: int) -> int:
        """The size of every part but the epoch's last ones: the most whole runs within K
        (9 batches of 3 workers' runs for K=10), run unrolled like K (`steps_arg`)."""
        return max(self.per_run, k - k % self.per_run)


def files_changed(inp: Any, held: str) -> TrainerError:
    """The error for counted shards (`PerWorkerInput.learn`) that now hold other batches."""
    return TrainerError(
        f"the shards of this {type(inp.source).__name__} no longer hold the {inp.sure_steps} batches per worker "
        f"counted in its first epoch ({held}). HINT: keep the input's files unchanged during training "
        "(steps_per_epoch= avoids the counted path).")


@contextlib.contextmanager
def sizes_kept(inp: Any, coordinator: Any) -> Iterator[None]:
    """A shard shorter than counted in an earlier epoch (`PerWorkerInput.learn`), found by
    a closure sent unguarded: an error that says so, not TensorFlow's end of sequence."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.OutOfRangeError:
        if not getattr(inp, "learned", False):
            raise
        # Closures in flight may have failed too: their errors, raised by the coordinator
        # one at a time, would fail the next fit's first closure.
        for _ in range(1 + 4 * len(private.coordinator_workers(coordinator))):
            try:
                coordinator.join()
                break
            except tf.errors.OpError:
                continue
        raise files_changed(inp, "a closure found its shard's end early") from None


def shards_can_fill(sizes: list[int], done: dict[int, int], in_flight: int, n: int) -> bool:
    """True if a closure of ``n`` steps finds at least ``n`` batches left wherever it runs:
    every shard (``sizes`` batches, ``done`` of them folded) holds ``n`` more past all
    ``in_flight`` steps, which may all have gone to it."""
    return all(size - done.get(i, 0) - in_flight >= n for i, size in enumerate(sizes))


def steps_arg(n: int, k: int, offset: int = 0) -> Any:
    """A closure's step count as `run_chunk` takes it: a full part (``k``: K, or a stream's
    `DynamicDatasetInput.full_part`) as a Python int (its steps unrolled, the fast path),
    fewer as a tensor, so every remainder size shares one trace (a graph loop; each size
    traced unrolled cost one more trace of up to K-1 steps per epoch size). A part that
    starts inside a run (``offset``, after a resume) keeps its Python count."""
    import tensorflow as tf

    return n if n == k or offset else tf.constant(n, tf.int32)


def skip_to(iterator: Any, sources: Any, first: Any, per_run: int, stacked: bool, offset: int) -> "_RunBatches":
    """The batches of one closure: a numbered stream of runs (``(number, run)``) moved past
    the runs before the one of batch ``first``. A stream already past that run (the closure
    was re-run on this worker after its own was lost) is replaced by a fresh one of the
    epoch from ``sources`` (`DynamicDatasetInput.iterator`). Only the choice of the stream
    is conditional: a ``tf.cond`` around the steps, waiting for the stream, cost 6-10 % of
    the MLP's steps/s (docs/performance.md)."""
    import tensorflow as tf

    wanted = first // per_run
    number, run = iterator.get_next()
    behind = number > wanted

    def fresh() -> Any:
        epoch = wanted // EPOCH_RUNS
        epochs = next(sources).filter(lambda e, _: tf.equal(e, epoch))
        return iter(next(iter(epochs))[1])

    stream = tf.cond(behind, fresh, lambda: iterator)
    number = tf.where(behind, tf.constant(-1, number.dtype), number)
    number, run = tf.while_loop(lambda i, _: i < wanted, lambda i, _: stream.get_next(), (number, run))
    return _RunBatches(stream, run, per_run, stacked, offset)


class ParameterServerTrainer(Trainer):
    """Trains a compiled Keras 3 model asynchronously with a ParameterServerStrategy."""

    def __init__(self, model: Any, strategy: Any = None, *, steps_per_execution: int | None = None,
                 stale_reads: bool = False, local_steps: bool = False) -> None:
        import tensorflow as tf

        super().__init__(model, resolve_strategy(strategy, allow=("ps",)), steps_per_execution=steps_per_execution)
        self._stale_reads = self._local_steps = False
        refuse_keras_loops(model)  # a model built under strategy.scope() gets the clear error too
        warn_tables_on_the_chief(model)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)
        self.num_workers = len(private.coordinator_workers(self.coordinator))
        with placement_scope(model), self.strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
            self._global_step = tf.Variable(
                int(self.optimizer.iterations.numpy()), dtype=tf.int64, trainable=False, name="global_step"
            )
        private.make_increments_atomic(self.optimizer.iterations)  # no per-step round trip to the worker
        # Each worker's shard index, read by every closure to report whose shard ran out.
        ids = [lambda i=i: iter(tf.data.Dataset.from_tensors(tf.constant(i, tf.int64)).repeat())
               for i in range(self.num_workers)]
        self._shard_ids = private.per_worker_iterator(self.coordinator, ids, tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).repeat())
        self._fns: dict[Any, Any] = {}  # training flag (or predict key) -> chunk function
        #: Exact epochs of unbatched arrays and tf.data of known size handed out dynamically
        #: (`DynamicInput`, `DynamicDatasetInput`); False:
        #: fixed per-worker shards, as for every other input (a slow worker then holds the
        #: epoch back).
        self.dynamic_epochs = True
        #: Opt-in (changes the training semantics): each closure reads the variables once and
        #: computes all its K gradients at those values (see the module docstring).
        self.stale_reads = stale_reads
        #: Opt-in (changes the training semantics): each closure runs its K steps on a local
        #: copy of the weights and optimizer state, then adds the change to the ps once.
        self.local_steps = local_steps

    @property
    def stale_reads(self) -> bool:
        return self._stale_reads

    @stale_reads.setter
    def stale_reads(self, on: bool) -> None:
        if on and self._local_steps:
            raise TrainerError(_BOTH_MODES)
        step_contract.refuse_custom_step_modes(self.model, stale_reads=bool(on), local_steps=False)
        if bool(on) != self._stale_reads:
            self._stale_reads = bool(on)
            self.reset_functions()

    @property
    def local_steps(self) -> bool:
        return self._local_steps

    @local_steps.setter
    def local_steps(self, on: bool) -> None:
        if on and self._stale_reads:
            raise TrainerError(_BOTH_MODES)
        step_contract.refuse_custom_step_modes(self.model, stale_reads=False, local_steps=bool(on))
        if on:
            try:  # validated now, before any closure is traced or scheduled
                private.stateless_optimizer(self.optimizer, self.model.trainable_variables)
            except TypeError as exc:
                raise TrainerError(
                    f"ps_local_steps=True cannot run {type(self.optimizer).__name__} on a local copy: {exc}. "
                    "HINT: use Adam, AdamW, SGD, RMSprop, Adagrad, Lion (without gradient_accumulation_steps), "
                    "or drop ps_local_steps."
                ) from None
        if bool(on) != self._local_steps:
            self._local_steps = bool(on)
            self.reset_functions()

    @property
    def global_step(self) -> Any:
        """Exact number of optimizer updates (an int64 variable advanced atomically)."""
        return self._global_step

    def reset_functions(self) -> None:
        self._fns.clear()

    # ------------------------------------------------------------ steps (one batch each)
    #
    # As Keras' backend trainers: one method per step, compiled into the chunk function by
    # `_make_fn`. Each takes one batch and the metric state and returns
    # ``(loss, examples, metric state, finite, ...)``; the model's own train_step/test_step
    # replace them when its class overrides them (`steps`).

    def _forward(self, x: Any, y: Any, sw: Any, values: list[Any], held: list[Any],
                 state: list[Any]) -> tuple[Any, Any, list[Any], Any]:
        """The gradient block, written once: ``(loss, y_pred, grads, scope)`` with the trainable
        variables read as ``values``, the layer state as ``held`` and the loss trackers as
        their part of the metric ``state`` (a StatelessScope, so the step's new layer state
        and loss trackers are read from ``scope`` and nothing is written meanwhile)."""
        import keras
        import tensorflow as tf

        model = self.model
        mapping = (list(zip(model.trainable_variables, values)) + list(zip(model.non_trainable_variables, held))
                   + self.metrics.loss_mapping(state))
        with tf.GradientTape() as tape:
            tape.watch(values)
            with keras.StatelessScope(state_mapping=mapping) as scope:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True)
        return loss, y_pred, tape.gradient(loss, values), scope

    @staticmethod
    def _new_state(scope: Any, state_variables: list[Any], held: list[Any]) -> list[Any]:
        return [h if scope.get_current_value(v) is None else scope.get_current_value(v)
                for v, h in zip(state_variables, held)]

    def train_step(self, batch: Any, state: list[Any]) -> tuple[Any, Any, list[Any], Any]:
        """One step: packed read of the variables, gradients, packed update on the ps."""
        variables, state_variables = self.model.trainable_variables, self.model.non_trainable_variables
        groups, state_groups = self._groups
        x, y, sw = unpack(batch)
        values = packing.read_packed(variables, groups)
        held = packing.read_packed(state_variables, state_groups)
        loss, y_pred, grads, scope = self._forward(x, y, sw, values, held, state)
        packing.add_back(scope, state_variables, held)  # no update lost between workers
        self.optimizer.apply_gradients(zip(packing.send_packed(grads, groups), variables))
        finite = all_finite([loss] + list(grads))
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), finite

    def test_step(self, batch: Any, state: list[Any]) -> tuple[Any, Any, list[Any], Any]:
        import tensorflow as tf

        model = self.model
        x, y, sw = unpack(batch)
        y_pred = model(x, training=False)
        with self.metrics.loss_scope(state) as scope:
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False)
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), tf.constant(True)

    def _metrics_after(self, state: list[Any], batch: Any, y_pred: Any, scope: Any) -> list[Any]:
        """The metric ``state`` after one step of ``batch`` (``scope``: where compute_loss ran)."""
        x, y, sw = unpack(batch)
        n = batch_size_of(x)
        return self.metrics.update(state, y, y_pred, sw, loss_scope=scope, rows=n, examples=n)

    def stale_train_step(self, batch: Any, state: list[Any], values: list[Any], held: list[Any]) -> tuple[Any, ...]:
        """Gradients at the closure's snapshot ``values`` (opt-in stale reads); the layer
        state is carried locally from step to step and written back by `apply_stale`."""
        import tensorflow as tf

        x, y, sw = unpack(batch)
        loss, y_pred, grads, scope = self._forward(x, y, sw, values, held, state)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, values)]
        new_held = self._new_state(scope, self.model.non_trainable_variables, held)
        finite = all_finite([loss] + grads)
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), finite, grads, new_held

    def apply_stale(self, grads: list[Any], before: list[Any], after: list[Any]) -> Any:
        import tensorflow as tf

        groups, _ = self._groups
        self.optimizer.apply_gradients(zip(packing.send_packed(grads, groups), self.model.trainable_variables))
        packing.add_changes(self.model.non_trainable_variables, before, after)  # no update lost between workers
        return tf.constant(True)

    def local_train_step(self, batch: Any, state: list[Any], local: tuple[Any, ...], view: Any) -> tuple[Any, ...]:
        """One step on the closure's local copy (``local``: weights, layer state, optimizer
        variables, iterations): Keras' own optimizer math on tensors, nothing on the ps."""
        import keras
        import tensorflow as tf

        opt, variables = self.optimizer, self.model.trainable_variables
        opt_floats = self._opt_floats
        values, held, slots, iterations = local
        x, y, sw = unpack(batch)
        loss, y_pred, grads, scope = self._forward(x, y, sw, values, held, state)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        new_held = self._new_state(scope, self.model.non_trainable_variables, held)
        finite = all_finite([loss] + grads)
        mapping = list(zip(variables, values)) + list(zip(opt_floats, slots)) + [(opt.iterations, iterations)]
        with keras.StatelessScope(state_mapping=mapping) as applied:
            private.stateless_apply(view, grads, variables)
            now = [applied.get_current_value(v) for v in [*variables, *opt_floats, opt.iterations]]
        old = [*values, *slots, iterations]
        now = [o if n is None else n for n, o in zip(now, old)]
        local = (now[:len(values)], new_held, now[len(values):-1], now[-1])
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), finite, local

    @property
    def _groups(self) -> tuple[list[Any], list[Any]]:
        """Packing groups of the trainable variables and of the layer state (see packing)."""
        if getattr(self, "_packing_groups", None) is None:
            self._packing_groups = (packing.pack_groups(self.model.trainable_variables),
                                    packing.pack_groups(self.model.non_trainable_variables))
        return self._packing_groups

    @property
    def _opt_floats(self) -> list[Any]:
        return [v for v in self.optimizer.variables if "float" in str(v.dtype)]

    # ------------------------------------------------------------ the chunk function

    def _make_fn(self, training: bool) -> Any:
        import keras
        import tensorflow as tf

        model, opt, step, metrics, strategy = self.model, self.optimizer, self.global_step, self.metrics, self.strategy
        variables, state_variables = model.trainable_variables, model.non_trainable_variables
        groups, state_groups = self._groups
        method = "train_step" if training else "test_step"
        # The model's own step (Keras' contract): run as compiled, its logs carried.
        user_step = (step_contract.compiled_step(getattr(model, method), strategy)
                     if method in self.custom_steps else None)
        replica_step = self.train_step if training else self.test_step
        if user_step is not None:
            # The model's own steps update its metrics and optimizers in place on the ps, from
            # every worker at once: Keras' read-modify-write increments would lose updates.
            # Counters of its own too (add_weight + assign_add: 52 of 60 steps were counted).
            for variable in [v for m in model.metrics for v in m.variables] + [
                    o.iterations for o in step_contract.step_optimizers(model)] + [
                    v for v in model.non_trainable_variables if isinstance(v, keras.Variable)]:
                private.make_increments_atomic(variable)
        opt_floats = self._opt_floats
        opt_groups = packing.pack_groups(opt_floats)
        view = private.stateless_optimizer(opt, variables) if training and self.local_steps else None

        def one_local_step(iterator: Any, carry: tuple[dict[str, Any], Any, tuple[Any, ...]], endless: bool) -> Any:
            # The cond's branches touch only the worker: no ps round trip per step.
            totals, exhausted, local = carry
            has_value, batch = next_input(iterator, endless)

            def run() -> tuple[Any, ...]:
                loss, n, state, finite, new_local = strategy.run(
                    self.local_train_step, args=(batch(), totals["state"], local, view))
                return step_totals(totals, loss, n, state, finite), exhausted, new_local

            return guarded(has_value, run, lambda: (totals, tf.constant(True), local))

        def one_stale_step(iterator: Any, carry: tuple[dict[str, Any], Any, list[Any]], values: list[Any],
                           endless: bool) -> Any:
            # Two conds on purpose: the first (compute, on the worker) touches no variable,
            # so the next step's compute does not wait for this step's update on the ps.
            totals, exhausted, held = carry
            has_value, batch = next_input(iterator, endless)

            def run() -> tuple[Any, ...]:
                loss, n, state, finite, grads, new_held = strategy.run(
                    self.stale_train_step, args=(batch(), totals["state"], values, held))
                return step_totals(totals, loss, n, state, finite), exhausted, grads, new_held

            def skip() -> tuple[Any, ...]:
                return totals, tf.constant(True), [tf.zeros_like(v) for v in values], held

            totals, exhausted, grads, new_held = guarded(has_value, run, skip)
            guarded(has_value, lambda: strategy.run(self.apply_stale, args=(grads, held, new_held)),
                    lambda: tf.constant(False))
            return totals, exhausted, new_held

        def one_step(iterator: Any, carry: tuple[dict[str, Any], Any, Any], endless: bool) -> tuple[Any, Any, Any]:
            totals, exhausted, logs = carry  # logs: what the model's own step returned last
            has_value, batch = next_input(iterator, endless)

            def run() -> tuple[Any, Any, Any]:
                data = batch()
                if user_step is not None:
                    out = user_step(data)
                    n = batch_size_of(unpack(data)[0])
                    return step_totals(totals, 0.0, n, totals["state"], step_contract.logs_finite(out)), exhausted, out
                loss, n, state, finite = strategy.run(replica_step, args=(data, totals["state"]))
                return step_totals(totals, loss, n, state, finite), exhausted, logs

            return guarded(has_value, run, lambda: (totals, tf.constant(True), logs))

        def next_input(iterator: Any, endless: bool) -> tuple[Any, Any]:
            """(has_value, batch getter); has_value None when the input cannot run out."""
            if endless:
                element = next(iterator)
                return None, lambda: element
            optional = iterator.get_next_as_optional()
            return optional.has_value(), optional.get_value

        def guarded(has_value: Any, run: Any, skip: Any) -> Any:
            # A cond per step costs (measured 1.3x steps/s without it, MLP, 1 worker + 1 ps),
            # so an input that cannot run out (steps_per_epoch, no empty shard) runs without.
            return run() if has_value is None else tf.cond(has_value, run, skip)

        def first_logs(iterator: Any, counted: bool) -> Any:
            # The value carried before the first step: zeros shaped like the step's logs
            # (its trace, reused by every step; nothing runs here).
            if user_step is None:
                return ()
            element = iterator.element_spec[1] if counted else iterator.element_spec
            spec = tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, s.dtype), element)
            return step_contract.output_zeros(user_step, spec)

        def finish(shard: Any, totals: dict[str, Any], exhausted: Any, logs: Any, updates: list[Any]) -> Any:
            head = tf.stack([tf.cast(shard, tf.float64), tf.cast(exhausted, tf.float64)])
            result = tf.concat([head, pack_totals(totals)], axis=0)
            if training:
                # Counted last (atomic on the ps), after the last update and the result, so a
                # closure lost with its worker before that point is not counted; its re-run is.
                with tf.control_dependencies([result, *updates]):
                    with tf.control_dependencies([step.assign_add(totals["steps"])]):
                        result = tf.identity(result)
            return result if user_step is None else {"vector": result, "logs": logs}

        def first_step_then_decide(first_step: Any, num_steps: int, unroll: bool) -> tuple[Any, bool]:
            """(carry after the first step, whether to unroll the other ``num_steps - 1``):
            unrolled only while they would trace within `UNROLL_TRACE_BUDGET_S`, judged by
            the first step's own trace time (a model of five lookup branches: 1.4 s a step)."""
            started = time.perf_counter()
            carry = first_step()
            seconds = time.perf_counter() - started
            # One step has no rest: nothing to unroll, and no loop (it would trace the step again).
            unroll_rest = isinstance(num_steps, int) and (
                num_steps <= 1 or (unroll and seconds * (num_steps - 1) <= UNROLL_TRACE_BUDGET_S))
            logger.debug("one step traced in %.3f s: the other %d of the chunk %s", seconds, num_steps - 1,
                         "unrolled" if unroll_rest else "in a graph loop")
            return carry, unroll_rest

        def counted_steps(iterator: Any, carry: tuple[Any, ...], num_steps: int, advance: Any, unroll: bool) -> Any:
            """Up to ``num_steps`` steps over a counted shard (`with_countdown`): one look at
            how many batches are left decides, for the whole closure, between the K steps
            and the shard's last ``left`` steps (a graph loop, once per shard and epoch); no
            step needs its own guard. Measured (1 worker + 1 ps, the MLP, 3 rounds): one
            cond per closure around its steps ran at 0.87x the steps/s of none (a cond per
            step: 0.7-0.8x), so the chief sends the closures it knows the shard can fill
            to `sure_steps` instead (`ParameterServerTrainer._run`)."""
            optional = iterator.get_next_as_optional()

            def some() -> tuple[Any, ...]:
                left, first = optional.get_value()

                def full() -> tuple[Any, ...]:
                    return sure_steps(iterator, carry, num_steps, advance, unroll, (left, first))

                def rest() -> tuple[Any, ...]:
                    return finished(then(iterator, advance(_Batches(iterator, first), carry), left - 1, advance), True)

                return tf.cond(left >= tf.cast(num_steps, left.dtype), full, rest)

            return tf.cond(optional.has_value(), some, lambda: finished(carry, True))

        def sure_steps(iterator: Any, carry: tuple[Any, ...], num_steps: int, advance: Any, unroll: bool,
                       element: Any = None) -> Any:
            """``num_steps`` steps over a counted shard that holds at least that many batches
            (the chief made sure, or ``element``, the first, says so): no look, no guard."""
            left, first = next(iterator) if element is None else element
            c, unroll_rest = first_step_then_decide(lambda: advance(_Batches(iterator, first), carry),
                                                    num_steps, unroll)
            if unroll_rest:  # unrolled: see the module docstring
                for _ in range(num_steps - 1):
                    c = advance(_Batches(iterator), c)
            else:
                c = then(iterator, c, tf.cast(num_steps - 1, left.dtype), advance)
            return finished(c, tf.equal(left, tf.cast(num_steps, left.dtype)))

        def finished(c: tuple[Any, ...], flag: Any) -> tuple[Any, ...]:
            return (c[0], tf.convert_to_tensor(flag), *c[2:])

        def then(iterator: Any, c: tuple[Any, ...], more: Any, advance: Any) -> tuple[Any, ...]:
            """``more`` steps of a counted shard in a graph loop (written out: the branches
            are traced as the Python they are, without AutoGraph)."""
            def body(i: Any, c: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
                return i + 1, advance(_Batches(iterator), c)

            return tf.while_loop(lambda i, _: i < more, body, (tf.zeros_like(more), c))[1]

        def steps(iterator: Any, carry: tuple[Any, ...], num_steps: int, endless: bool, counted: bool,
                  advance: Any, unroll: bool = True) -> tuple[Any, ...]:
            """``num_steps`` calls of ``advance(batches, carry, endless)``, one step of the mode;
            ``counted`` and ``endless``: a counted shard the chief knows can fill them."""
            if counted and endless:
                return sure_steps(iterator, carry, num_steps, lambda it, c: advance(it, c, True), unroll)
            if counted:
                return counted_steps(iterator, carry, num_steps, lambda it, c: advance(it, c, True), unroll)
            if isinstance(num_steps, tf.Tensor):  # a part's remainder (`steps_arg`): all in a graph loop
                return loop(iterator, carry, num_steps, 0, lambda it, c: advance(it, c, endless))
            carry, unroll_rest = first_step_then_decide(lambda: advance(iterator, carry, endless), num_steps, unroll)
            if unroll_rest:  # unrolled: see the module docstring
                for _ in range(num_steps - 1):
                    carry = advance(iterator, carry, endless)
                return carry
            return loop(iterator, carry, num_steps, 1, lambda it, c: advance(it, c, endless))

        def loop(iterator: Any, carry: tuple[Any, ...], num_steps: Any, done: int, advance: Any) -> tuple[Any, ...]:
            """Steps ``done`` .. ``num_steps`` in a graph loop."""
            if hasattr(iterator, "loop"):  # batches found by their place in the part: its own loop
                return iterator.loop(advance, carry, num_steps - done)

            def body(i: Any, c: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
                return i + 1, advance(iterator, c)

            # Until K steps ran or the shard ended (carry[1]).
            return tf.while_loop(lambda i, c: tf.logical_and(i < num_steps, tf.logical_not(c[1])), body,
                                 (tf.constant(done), carry))[1]

        @step_contract.compiled
        def run_chunk(iterator: Any, shard_ids: Any, num_steps: int, endless: bool = False,
                      counted: bool = False, batch_size: int = 0, rows: Any = None, per_run: int = 1,
                      stacked: bool = False, offset: int = 0) -> Any:
            # num_steps is a Python int (K): a constant in the graph, so the K steps can be
            # unrolled; a part's remainder is a tensor (`steps_arg`): one graph loop traced
            # once for every remainder size.
            # endless: every shard repeats and is not empty, so no step needs a guard.
            # counted: each element carries how many are left in its shard (`with_countdown`);
            # with endless, the chief knows the shard holds num_steps more (`shards_can_fill`).
            # rows: the part of the epoch the chief handed out (`DynamicInput`): the rows
            # of its num_steps batches of batch_size, gathered from the whole arrays.
            # rows, a scalar: the number of the first batch of this closure's part of a
            # numbered stream of runs of per_run batches (stacked: a batched dataset's),
            # offset its place in its run (`DynamicDatasetInput`).
            shard = next(shard_ids)
            if rows is not None and rows.shape.rank == 0:  # iterator: (streams, sources)
                iterator, endless, counted = skip_to(*iterator, rows, per_run, stacked, offset), True, False
            elif rows is not None:
                iterator, endless, counted = _Gathered(next(iterator), rows, batch_size), True, False
            zeros = zeros_totals(metrics)
            if training and self.local_steps:  # opt-in: see the module docstring
                start = (packing.read_packed(variables, groups), packing.read_packed(state_variables, state_groups),
                         packing.read_packed(opt_floats, opt_groups), tf.cast(step.read_value(), opt.iterations.dtype))
                totals, exhausted, end = steps(iterator, (zeros, tf.constant(False), start), num_steps, endless,
                                               counted, one_local_step)
                updates = (packing.add_packed(variables, groups, start[0], end[0])
                           + packing.add_changes(state_variables, start[1], end[1])
                           + packing.add_packed(opt_floats, opt_groups, start[2], end[2], 1.0 / self.num_workers))
                return finish(shard, totals, exhausted, (), updates)
            if training:
                # Schedules and Adam's bias correction see the true step (up to the chunks in
                # flight elsewhere); the chief makes iterations exact at every epoch end.
                opt.iterations.assign(tf.cast(step.read_value(), opt.iterations.dtype))
            if training and self.stale_reads:  # opt-in: one read per closure (module docstring)
                values = packing.read_packed(variables, groups)
                stale = (zeros, tf.constant(False), packing.read_packed(state_variables, state_groups))
                totals, exhausted, _ = steps(iterator, stale, num_steps, endless, counted,
                                             lambda it, c, endless: one_stale_step(it, c, values, endless))
                logs = ()  # no annotation: AutoGraph cannot convert an annotated name it makes nonlocal
            else:
                unroll = isinstance(num_steps, int) and (
                    num_steps <= MAX_UNROLLED_STEPS and num_steps * len(variables) <= MAX_UNROLLED_VARIABLE_STEPS)
                carry = (zeros, tf.constant(False), first_logs(iterator, counted))
                totals, exhausted, logs = steps(iterator, carry, num_steps, endless, counted, one_step, unroll)
            return finish(shard, totals, exhausted, logs, [tf.identity(opt.iterations.value)] if training else [])

        return run_chunk

    def _fn(self, training: bool) -> Any:
        if training not in self._fns:
            self._fns[training] = self._make_fn(training)
        return self._fns[training]

    # ------------------------------------------------------------ input and runner

    def _input(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int | None, repeat: bool,
               own_step: str | None = None, countdown: bool = True) -> PerWorkerInput | DynamicInput | DynamicDatasetInput:
        # own_step changes nothing here: a worker's shard is its own (never padded) and a
        # closure that finds it exhausted runs no step.
        if source.batched:
            batch_size = None
        elif batch_size is None:
            batch_size = step_contract.DEFAULT_BATCH_SIZE
        if self.dynamic_epochs and countdown and not repeat and DynamicInput.takes(source):
            return DynamicInput(self.coordinator, source, batch_size=batch_size, shuffle=shuffle, seed=seed)
        if self.dynamic_epochs and countdown and not repeat and DynamicDatasetInput.takes(source):
            return DynamicDatasetInput(self.coordinator, source, batch_size=batch_size, shuffle=shuffle, seed=seed)
        return PerWorkerInput(self.coordinator, source, batch_size=batch_size, shuffle=shuffle, seed=seed, repeat=repeat,
                              countdown=countdown)

    def _window(self, per_shard: list[int] | None = None, done: dict[int, int] | None = None,
                k: int | None = None) -> int:
        """Closures to keep in flight: enough to keep every worker busy while the chief
        fetches, and, where each shard's size is known (``per_shard``, ``done``: steps
        folded per shard), no more than the closures its unfinished shards still need.

        A closure that lands on a worker whose shard is finished returns empty but still
        costs the worker a closure (50-100 ms apart, timed in a 2-worker job of a small
        MLP): with the full window at every epoch's end, its epoch of 26 steps took 0.9 s
        instead of 0.45 s (bench/epoch_overhead.py). At least one per worker stays in
        flight, so a worker that still has steps always gets a closure.
        """
        window = 4 * self.num_workers
        if per_shard is None or done is None:
            return window
        k = k or self.steps_per_execution
        needed = sum(-(-max(0, size - done.get(i, 0)) // k) for i, size in enumerate(per_shard))
        return min(window, max(needed, self.num_workers))

    def _scheduler(self, fn: Any, iterator: Any) -> Callable[..., Any]:
        """``schedule(*constants)``: ``fn(iterator, shard ids, *constants)`` on a free worker.

        Each trace (one per distinct ``constants``: the closure size, ...) is looked up once
        here, not by the coordinator for every closure (`_private_apis.scheduled_concrete_function`).
        """
        import tensorflow as tf

        traces: dict[tuple[Any, ...], Any] = {}

        def trace(*constants: Any) -> Any:
            # Tensors (a part's rows) traced at any length: a part's last batch may be short,
            # and one trace per length was one more trace of the whole chunk per shard size.
            key = tuple(("tensor", c.shape.rank) if isinstance(c, tf.Tensor) else c for c in constants)
            if key not in traces:
                started = time.perf_counter()
                spec = (iterator, self._shard_ids, *(tf.TensorSpec([None] * c.shape.rank, c.dtype)
                                                     if isinstance(c, tf.Tensor) else c for c in constants))
                traces[key] = private.scheduled_concrete_function(self.coordinator, fn, spec)
                logger.debug("the trace of a closure for %s: %.2f s", key, time.perf_counter() - started)
            return traces[key]

        def schedule(*constants: Any) -> Any:
            return self.coordinator.schedule(trace(*constants), args=(iterator, self._shard_ids, *constants))

        schedule.trace = trace  # type: ignore[attr-defined]
        return schedule

    def _run(self, inp: PerWorkerInput, epoch: int, *, training: bool, steps: int | None,
             hooks: ChunkHooks) -> Totals:
        """Schedule closures of K steps until the epoch is complete (see the module docstring)."""
        import tensorflow as tf

        fn = self._fn(training)
        dynamic = isinstance(inp, (DynamicInput, DynamicDatasetInput))
        stream = isinstance(inp, DynamicDatasetInput)
        last = self._last_epoch if training and stream else None  # one stream for the fit's epochs
        if isinstance(inp, DynamicInput):
            iterator = inp.full
        else:
            iterator = inp.iterator(epoch, last) if stream else inp.iterator(epoch)
        if dynamic:
            # A resumed training epoch (steps: what is left of it) continues where its
            # checkpoint was; validation_steps takes the first steps.
            first_step = inp.steps - min(steps, inp.steps) if training and steps is not None else 0
            steps = inp.steps - first_step if steps is None else min(steps, inp.steps - first_step)
            parts = inp.parts(epoch, first_step, steps, self.steps_per_execution)
        reset = self.metrics.reset_numpy()
        totals = Totals(reset)
        k = self.steps_per_execution
        pending: deque = deque()
        exhausted: set[int] = set()
        scheduled = 0  # steps scheduled so far (an upper bound of what will run)
        by_examples = not inp.source.batched

        def complete() -> bool:
            if steps is not None:
                return scheduled >= steps
            if len(exhausted) == self.num_workers:
                return True
            counted = totals.count if by_examples else totals.steps
            return inp.expected is not None and counted >= inp.expected

        done: dict[int, int] = {}  # steps folded per shard
        # Where each shard's size is known, closures beyond what its shards still need are
        # not scheduled (see `_window`).
        per_shard = inp.per_shard if steps is None and not inp.endless else None
        # Seconds from here to each worker's last closure with steps: a worker whose shard is
        # smaller (files dealt whole) idles after it, and is not slow for that.
        busy: dict[int, float] = {}
        started = time.perf_counter()
        if training:
            self.worker_steps, self.worker_busy = done, busy
        lost = []  # closures whose results were lost with their workers
        sure_steps = inp.sure_steps if isinstance(inp, PerWorkerInput) and steps is None else None
        window = self._window()
        if sure_steps is not None and not shards_can_fill(sure_steps, {}, k * window, k):
            # Hardly a closure could be sure (shards within a window of their ends): one
            # closure kind, one trace.
            sure_steps = None
        # A closure whose worker fails is queued again behind the later ones, so a sure one
        # may run after guarded ones that read its shard to the end, and find the end. After
        # such a failure the epoch goes on with guarded closures until every shard has ended;
        # without one, counted files have changed (`files_changed`).
        run_again = private.closures_run_again(self.coordinator) if sure_steps is not None else 0
        ended_early: list[Exception] = []  # what the sure closures that found their shard's end raised

        def shard_ended(error: Exception) -> None:
            if sure_steps is None:
                raise error
            if not any(error is seen for seen in ended_early):  # the queue raises a closure's error again
                ended_early.append(error)
            logger.debug("a closure sent unguarded found its shard's end: %s", str(error).splitlines()[0])

        def fold_oldest() -> None:
            n, rv = pending.popleft()
            try:
                vector, logs = rv.fetch(), None
            except tf.errors.OutOfRangeError as e:  # its updates up to the end were applied
                shard_ended(e)
                return
            except tf.errors.CancelledError:
                if not ended_early:
                    raise
                return  # cancelled with the queue when a closure found its shard's end: never ran
            except (tf.errors.UnavailableError, tf.errors.AbortedError):
                lost.append(n)  # where its steps ran is unknown: no closure is sure any more
                # The closure ran (a failed one is re-run by the coordinator, and its
                # value is set only by a run that finished), but its worker was lost
                # before the chief copied the result off it. Its updates and steps are
                # on the ps (the step counter stays exact); only its logs are gone.
                logger.warning("the result of a closure (%d steps) was lost with its worker before "
                               "the chief read it; its updates were applied, its loss and metrics are missing "
                               "from this epoch's logs.", n)
                return
            if isinstance(vector, dict):  # the model's own step: its logs come along
                vector, logs = vector["vector"], vector["logs"]
            if vector[1]:
                exhausted.add(int(vector[0]))
            out = unpack_totals(vector[2:], reset)
            out["logs"] = logs
            # The shard index is the worker's: steps per worker (stragglers, `_window`).
            done[int(vector[0])] = done.get(int(vector[0]), 0) + int(out["steps"])
            totals.add(out)
            if out["steps"]:
                busy[int(vector[0])] = time.perf_counter() - started
                hooks.after(totals.steps - 1, totals)

        schedule = self._scheduler(fn, iterator)
        if sure_steps is not None:
            # Both kinds traced before the epoch's first closure: see `PerWorkerInput`.
            for sure in (True, False):
                schedule.trace(k, sure, inp.counted, 0, None, 1, False, 0)

        stopped = by_hook = False
        with sizes_kept(inp, self.coordinator):
            while True:
                while not stopped and not complete() and len(pending) < self._window(per_shard, done):
                    n = k if steps is None else min(k, steps - scheduled)
                    hooks.before(totals.steps + sum(m for m, _ in pending))
                    if dynamic:  # the next part of the epoch, to whichever worker is free
                        n, part = next(parts)
                        if stream:
                            offset, first = inp.offset(part), tf.constant(inp.first_batch(epoch, part), tf.int64)
                            rv = schedule(steps_arg(n, inp.full_part(k), offset), True, False, 0, first, inp.per_run,
                                          inp.stacked, offset)
                        else:
                            rv = schedule(steps_arg(n, k), True, False, inp.batch_size, tf.constant(part, tf.int64), 1,
                                          False, 0)
                        pending.append((n, rv))
                    else:  # every argument: a trace binds all
                        # Sure: every shard holds n more steps past all those in flight, wherever
                        # they run, so this closure runs unguarded (`sure_steps`; counted
                        # files: the unguarded steps of steps_per_epoch).
                        sure = sure_steps is not None and not lost and not ended_early and shards_can_fill(
                            sure_steps, done, sum(m for m, _ in pending), n)
                        try:
                            pending.append((n, schedule(steps_arg(n, k), inp.endless or sure, inp.counted, 0, None,
                                                        1, False, 0)))
                        except tf.errors.OutOfRangeError as e:  # raised once, the queue cancelled
                            shard_ended(e)
                            continue
                    scheduled += n
                if not pending:
                    break
                fold_oldest()
                by_hook = by_hook or (not stopped and hooks.stop())
                stopped = stopped or by_hook
                if steps is None and complete():
                    stopped = True  # the rest in flight find their shards empty
                if not stopped and hooks.checkpoint_due(totals.steps):
                    # A mid-epoch checkpoint (or a preemption): let the closures in flight land
                    # so the saved step counter is exact, then save (and stop if preempted).
                    while pending:  # every part before the checkpoint has run
                        fold_oldest()
                    self._after_train_epoch()
                    hooks.checkpoint_now()
        # A closure queued again (its worker failed): this epoch's shards were read anew.
        failed_over = sure_steps is not None and private.closures_run_again(self.coordinator) != run_again
        if ended_early:
            if not failed_over and not lost:
                if inp.learned:
                    raise files_changed(inp, "a closure found its shard's end early")
                raise ended_early[0]
            logger.warning("%d closure(s) sent unguarded found their shard's end after a worker failed and its "
                           "closures ran again: this epoch went on with guarded closures to every shard's end "
                           "(its logs miss the steps those closures ran; some examples were seen twice).",
                           len(ended_early))
        if (isinstance(inp, PerWorkerInput) and inp.learns and steps is None and not by_hook and not lost
                and not ended_early and len(exhausted) == self.num_workers):
            # Every shard ran to its end in this epoch. Sure closures pay off where every
            # shard fills one past a full window in flight.
            inp.learn(done, k * (window + 1))
        if (sure_steps is not None and isinstance(inp, PerWorkerInput) and inp.learned and not by_hook and not lost
                and not failed_over and all(n == 1 for n in inp.made)
                and len(exhausted) == self.num_workers
                and [done.get(i, 0) for i in range(self.num_workers)] != sure_steps):
            raise files_changed(inp, f"this epoch's held {[done.get(i, 0) for i in range(self.num_workers)]}")
        return totals

    def _make_predict_fn(self, spec: Any) -> Any:
        import tensorflow as tf

        from . import ordered

        strategy = self.strategy
        predict_one = self._predict_call()

        def one_batch(iterator: Any, carry: tuple[Any, Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
            keys, preds, batches, exhausted = carry
            optional = iterator.get_next_as_optional()

            def run() -> tuple[Any, Any, Any, Any]:
                batch_keys, x = optional.get_value()
                y = strategy.run(predict_one, args=(x,))
                joined = tf.nest.map_structure(lambda a, b: tf.concat([a, b], 0), preds, y)
                return tf.concat([keys, batch_keys], 0), joined, batches + 1, exhausted

            return tf.cond(optional.has_value(), run, lambda: (keys, preds, batches, tf.constant(True)))

        @step_contract.compiled
        def predict_chunk(iterator: Any, shard_ids: Any, num_steps: int) -> Any:
            shard = next(shard_ids)
            keys, preds = ordered.empty_rows(spec)
            carry = (keys, preds, tf.constant(0, tf.int64), tf.constant(False))
            for _ in range(num_steps):  # unrolled, as in training (module docstring)
                carry = one_batch(iterator, carry)
            keys, preds, batches, exhausted = carry
            return {"shard": shard, "exhausted": exhausted, "batches": batches, "keys": keys, "preds": preds}

        return predict_chunk

    def _predict_rows(self, source: Any, *, batch_size: int | None, progress: Any) -> list[tuple[Any, Any]]:
        """Closures of K batches over every worker's shard; the chief keeps every result."""
        from . import ordered

        inp = self._input(source, batch_size=batch_size, shuffle=False, seed=None, repeat=False, countdown=False)
        spec = ordered.output_spec(self.model, inp.sample.element_spec, self._predict_call())
        key = ("predict", repr(spec))  # traced once per output structure, not per call
        if key not in self._fns:
            self._fns[key] = self._make_predict_fn(spec)
        fn = self._fns[key]
        schedule = self._scheduler(fn, inp.iterator(0))
        k = min(self.steps_per_execution, MAX_UNROLLED_STEPS)
        parts: list[tuple[Any, Any]] = []
        pending: deque = deque()
        exhausted: set[int] = set()
        rows = batches = 0
        done: dict[int, int] = {}  # batches predicted per shard (see `_window`)

        def complete() -> bool:
            if len(exhausted) == self.num_workers:
                return True
            counted = batches if source.batched else rows
            return inp.expected is not None and counted >= inp.expected

        while True:
            while not complete() and len(pending) < self._window(inp.per_shard, done, k):
                pending.append(schedule(k))
            if not pending:
                break
            out = pending.popleft().fetch()
            if out["exhausted"]:
                exhausted.add(int(out["shard"]))
            done[int(out["shard"])] = done.get(int(out["shard"]), 0) + int(out["batches"])
            if out["batches"]:
                parts.append((out["keys"], out["preds"]))
                rows += len(out["keys"])
                batches += int(out["batches"])
                progress(batches)
        return parts  # closures still in flight at completion were folded too (empty or duplicates)

    def _after_train_epoch(self) -> None:
        self.coordinator.join()
        self.sync_iterations()

    def sync_iterations(self) -> None:
        """Make ``optimizer.iterations`` equal the exact step counter (call when idle)."""
        self.optimizer.iterations.assign(self.global_step.read_value())
