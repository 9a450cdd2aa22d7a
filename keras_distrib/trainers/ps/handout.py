"""How an epoch's examples are handed out to the workers' closures: fixed per-worker shards
(`PerWorkerInput`), parts of whole arrays (`DynamicInput`) and parts of a numbered stream of
a dataset's batches (`DynamicDatasetInput`); the arithmetic of sure closures and parts.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from ... import data as kd_data
from .. import _private_apis as private
from .._common import FitStream, TrainerError, empty_like
from .readers import EPOCH_RUNS, PAST_THE_END, with_countdown, without_autotune

logger = logging.getLogger(__name__)


#: Arrays up to this size are handed out dynamically (`DynamicInput`: each worker holds
#: them whole, sent as a constant of a graph, which protobuf caps at 2 GiB); bigger ones
#: keep fixed shards (1/k of them per worker).
MAX_DYNAMIC_BYTES = 1 << 30

@dataclass(frozen=True, eq=False)
class Closure:
    """What one scheduled closure runs: the arguments of `compiler.ChunkCompiler.run_chunk`
    after its iterator and shard ids, named."""

    num_steps: Any
    endless: bool = False
    counted: bool = False
    batch_size: int = 0
    rows: Any = None
    per_run: int = 1
    stacked: bool = False
    offset: int = 0

    def args(self) -> tuple[Any, ...]:
        """The positional arguments, in `run_chunk`'s order (a trace binds every one)."""
        return (self.num_steps, self.endless, self.counted, self.batch_size, self.rows, self.per_run,
                self.stacked, self.offset)


class HandOut(Protocol):
    """How an epoch's examples reach the closures: one object per input kind, picked once
    per fit by `ParameterServerTrainer._input`; the chief's `chief.EpochRun` talks to it only
    through these."""

    source: Any
    sample: Any
    #: Steps of one epoch (None: unknown) and examples of one epoch (None: unknown).
    steps: int | None
    expected: int | None
    #: True once each shard's batches were counted in a whole epoch (files).
    learned: bool

    def epoch_iterator(self, epoch: int, last_epoch: int | None) -> Any:
        """What the closures of ``epoch`` read (``last_epoch``: the fit's last, in training)."""

    def start_epoch(self, epoch: int, *, training: bool, steps: int | None, k: int) -> int | None:
        """Begin ``epoch`` (or ``steps`` of it); the steps the epoch then runs (None: to the end)."""

    def window_shards(self, steps: int | None) -> list[int] | None:
        """Each shard's steps where known, to bound the closures in flight (None: no bound)."""

    def sure_steps_for(self, steps: int | None) -> list[int] | None:
        """Each shard's known steps where closures it can fill may run unguarded (else None)."""

    def next_closure(self, epoch: int, k: int, n: int, sure: bool) -> tuple[int, Closure]:
        """The next closure of up to ``n`` steps (``sure``: every shard can fill it) and its steps."""

    def sure_kinds(self, k: int) -> list[Closure]:
        """The closures to trace before the epoch's first one, where sure ones may run."""

    def learn_epoch(self, steps_per_shard: dict[int, int], least: int) -> None:
        """An epoch ran whole with these steps per shard (counted files learn their sizes)."""

    def check_held(self, held: list[int]) -> None:
        """Raise `files_changed` if counted shards held other steps this epoch."""


class PartsHandOut:
    """The dynamic hand-outs: parts of an epoch, each to whichever worker is free; no
    shard is bounded, none is counted, none is sure."""

    learned = False

    def start_epoch(self, epoch: int, *, training: bool, steps: int | None, k: int) -> int | None:
        # A resumed training epoch (steps: what is left of it) continues where its
        # checkpoint was; validation_steps takes the first steps.
        first_step = self.steps - min(steps, self.steps) if training and steps is not None else 0
        steps = self.steps - first_step if steps is None else min(steps, self.steps - first_step)
        self._parts = self.parts(epoch, first_step, steps, k)
        return steps

    def window_shards(self, steps: int | None) -> None:
        return None

    def sure_steps_for(self, steps: int | None) -> None:
        return None

    def sure_kinds(self, k: int) -> list[Closure]:
        return []

    def learn_epoch(self, steps_per_shard: dict[int, int], least: int) -> None:
        pass

    def check_held(self, held: list[int]) -> None:
        pass


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
        #: unguarded (see `compiler.make_chunk_fn`).
        self.counted = countdown and not repeat and int(self.sample.cardinality()) >= 0
        # A pipeline that calls the chief's Python keeps one closure kind per epoch: a
        # second traced while it ran hung the chief in TF's Context.add_c_function.
        python = kd_data.dataset_runs_python(self.sample)
        # Files are dealt whole: num_examples dealt by example is not their shards' sizes,
        # and an epoch ends where every worker's files end (as in all-reduce).
        whole_files = kd_data.counts_in_first_epoch(source, repeat)
        #: The shards' sizes are unknown to tf.data but the same every epoch (files dealt
        #: to workers): the first epoch that runs whole counts each shard's batches (`learn`).
        self.sizes = kd_data.FirstEpochCount(counting=countdown and whole_files and not self.counted and not python)
        per_shard = kd_data.steps_for_shards(source.num_examples, k, None if source.batched else batch_size)
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
        if not self.sizes.counting:
            return
        if any(n != 1 for n in self.made):
            logger.info("a worker read its shard again in the epoch that counts them (it was recovered): the shard "
                        "sizes are not taken from it, and every step keeps its guard.")
            return
        sizes = [steps_per_shard.get(i, 0) for i in range(self.num_shards)]
        self.steps = sum(sizes)  # the later epochs' progress bars show it, not the estimate
        if min(sizes) < least:
            logger.debug("shards of %s batches: each step keeps its guard", sizes)
            self.sizes.give_up()
            return
        self.sizes.take(sizes)
        self.per_shard = self.sure_steps = sizes

    @property
    def learned(self) -> bool:
        return self.sizes.learned

    def epoch_iterator(self, epoch: int, last_epoch: int | None) -> Any:
        return self.iterator(epoch)

    def start_epoch(self, epoch: int, *, training: bool, steps: int | None, k: int) -> int | None:
        return steps

    def window_shards(self, steps: int | None) -> list[int] | None:
        return self.per_shard if steps is None and not self.endless else None

    def sure_steps_for(self, steps: int | None) -> list[int] | None:
        return self.sure_steps if steps is None else None

    def next_closure(self, epoch: int, k: int, n: int, sure: bool) -> tuple[int, Closure]:
        # Sure: every shard holds n more steps past all those in flight, wherever they run,
        # so the closure runs unguarded (counted files: the unguarded steps of steps_per_epoch).
        return n, Closure(steps_arg(n, k), endless=self.endless or sure, counted=self.counted)

    def sure_kinds(self, k: int) -> list[Closure]:
        return [Closure(k, endless=sure, counted=self.counted) for sure in (True, False)]

    def learn_epoch(self, steps_per_shard: dict[int, int], least: int) -> None:
        self.learn(steps_per_shard, least)

    def check_held(self, held: list[int]) -> None:
        if self.sizes.learned and all(n == 1 for n in self.made) and held != self.sure_steps:
            raise files_changed(self, f"this epoch's held {held}")

    def iterator(self, epoch: int) -> Any:
        """Fresh finite iterators for ``epoch`` (one persistent repeated one with ``repeat``)."""
        import tensorflow as tf

        if self.repeat and self._persistent is not None:
            return self._persistent
        self.sizes.say_once(lambda: logger.info(
            "the shards of this %s hold %s batches every epoch, counted in the first: this epoch and the later "
            "ones run without a guard up to each shard's last few steps.", type(self.source).__name__, self.sure_steps))
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

class DynamicInput(PartsHandOut):
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

    def __init__(self, coordinator: Any, source: Any, *, batch_size: int, shuffle: bool, seed: int | None) -> None:
        import tensorflow as tf

        self.source, self.batch_size, self.shuffle, self.seed = source, batch_size, shuffle, seed
        self.num_shards = len(private.coordinator_workers(coordinator))
        arrays = source.rows_in_memory()
        # The whole arrays once per worker and fit (a constant of the dataset's graph, sent
        # when the iterator is made); each closure reads them by reference.
        per_worker = coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.from_tensors(arrays).repeat())
        self.full = iter(per_worker)
        self.sample = tf.data.Dataset.from_tensor_slices(kd_data.map_nest(lambda a: a[:batch_size], arrays)
                                                         ).batch(batch_size)  # for the chief's metrics
        #: Examples, and steps of one epoch (each shard's last batch may be short).
        self.expected = source.num_examples
        self.shard_steps = kd_data.steps_for_shards(self.expected, self.num_shards, batch_size)
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

        arrays = source.rows_in_memory()
        if arrays is None or not plain(arrays):
            return False
        return sum(int(getattr(a, "nbytes", 0)) for a in kd_data.flatten_nest(arrays)) <= MAX_DYNAMIC_BYTES

    def epoch_iterator(self, epoch: int, last_epoch: int | None) -> Any:
        return self.full

    def next_closure(self, epoch: int, k: int, n: int, sure: bool) -> tuple[int, Closure]:
        import tensorflow as tf

        n, rows = next(self._parts)
        return n, Closure(steps_arg(n, k), endless=True, batch_size=self.batch_size, rows=tf.constant(rows, tf.int64))

    def parts(self, epoch: int, first_step: int, num_steps: int, k: int) -> Iterator[tuple[int, Any]]:
        """``(steps, rows)`` of each closure for steps ``first_step`` .. ``+ num_steps`` of
        the epoch (`keras_distrib.data.epoch_parts`)."""
        rows = kd_data.shard_rows(self.expected, self.num_shards, epoch=epoch, shuffle=self.shuffle, seed=self.seed)
        return kd_data.epoch_parts(rows, self.batch_size, k, first_step, num_steps)

class DynamicDatasetInput(PartsHandOut):
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
    per step than fixed shards (docs/performance-history.md).

    A worker takes its closures in order, so its stream only moves forward; a closure the
    coordinator re-runs on another worker (its first worker was lost) may find that
    worker's stream past its part: it runs no step and says so, and the chief runs the part
    again on fresh streams (`chief.EpochRun`).

    For datasets whose elements are plain tensors of known rank (no ragged or sparse parts),
    whose size tf.data knows or one pass counted, and that run no Python (``from_generator``,
    ``tf.py_function``: every worker would read the whole epoch through the chief's Python;
    a 3-worker job of one hung when the chief removed a function meanwhile).
    """

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
        self.steps = sum(kd_data.steps_for_shards(source.num_examples, k, None if source.batched else batch_size))

    @staticmethod
    def takes(source: Any) -> bool:
        """True for a `keras_distrib.data.DatasetSource` of known size, without Python in its
        pipeline, whose elements are plain tensors of known rank (a batch is cut by rows;
        the end is an empty batch)."""
        import tensorflow as tf

        dataset = source.dataset_of_known_size()
        if dataset is None:
            return False
        specs = tf.nest.flatten(dataset.element_spec)
        return all(type(s) is tf.TensorSpec and s.shape.rank is not None for s in specs)

    def epoch_iterator(self, epoch: int, last_epoch: int | None) -> Any:
        return self.iterator(epoch, last_epoch)

    def next_closure(self, epoch: int, k: int, n: int, sure: bool) -> tuple[int, Closure]:
        import tensorflow as tf

        n, part = next(self._parts)
        offset, first = self.offset(part), tf.constant(self.first_batch(epoch, part), tf.int64)
        return n, Closure(steps_arg(n, self.full_part(k), offset), endless=True, rows=first, per_run=self.per_run,
                          stacked=self.stacked, offset=offset)

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
