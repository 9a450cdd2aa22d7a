"""The all-reduce trainer's input: each worker's shard batched for its replicas, padded with
zero-weight batches so no worker runs out first, the step counts of epochs of known size,
and the equal batches a model's own step gets (`EpochInput`).
"""

from __future__ import annotations

import logging
import math
from typing import Any


from .. import data as kd_data
from ._common import FitStream, TrainerError, empty_like

logger = logging.getLogger(__name__)


def _static_batch_size(ds: Any) -> int | None:
    """The batch size every element of the batched ``ds`` has, if its spec fixes one."""
    import tensorflow as tf

    dims = {spec.shape[0] for spec in tf.nest.flatten(ds.element_spec) if spec.shape.rank}
    return dims.pop() if len(dims) == 1 and None not in dims else None


def without_autotune_thread(ds: Any) -> Any:
    """``ds`` with tf.data's autotuning off, unless its own options set it.

    Contract: freeing an iterator of an autotuned dataset waits for its autotuning thread,
    which sleeps between rounds up to a minute once the iterator has run for a few minutes: a
    fit's iterator freed at the process's exit held an all-reduce job up to a minute after its
    result line. ``AUTOTUNE`` parallelism then stays at its start value (the CPU count, at most
    16); the cost is in docs/performance.md."""
    import tensorflow as tf

    if ds.options().autotune.enabled is not None:
        return ds
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def _with_padding(ds: Any, endless: bool = False) -> Any:
    """``(batch, real_mask)`` batches of ``ds``, then endless one-example zero-weight padding
    (none when ``ds`` is ``endless``: it never ends)."""
    import tensorflow as tf

    def real(*batch: Any) -> Any:
        batch = batch[0] if len(batch) == 1 else batch
        n = tf.shape(tf.nest.flatten(batch)[0])[0]
        return batch, tf.ones([n], tf.float32)

    real_ds = ds.map(real)
    return real_ds if endless else _then_padding(real_ds)


def _then_padding(real_ds: Any) -> Any:
    """``(batch, real_mask)`` batches of ``real_ds``, then endless copies of its first batch's
    first row at weight 0."""
    import tensorflow as tf

    def pad(batch: Any, mask: Any) -> Any:
        return tf.nest.map_structure(lambda t: t[:1], batch), tf.zeros([1], tf.float32)

    # Cached: each repetition of an uncached take(1) made the pipeline again (a shuffle
    # buffer filled for one row).
    return real_ds.concatenate(real_ds.take(1).map(pad).cache().repeat())


def _replica_slices(ds: Any, pipeline: int, pipelines: int, local: int, *, masked: bool, endless: bool,
                    method: str = "") -> Any:
    """This input pipeline's part of every global batch of ``ds``, one element per local replica.

    The batch the user's input states is the global batch: it is cut into ``pipelines *
    local`` slices of near-equal size (replica ``r`` gets rows ``[r*n//R, (r+1)*n//R)``).
    ``masked``: ``(slice, real_mask)`` pairs as `_with_padding` gives, an empty slice (a batch
    of fewer rows than replicas) replaced by the batch's first row at weight 0, and the
    padding tail unless ``endless``. Else (the model's own step, which gets no padding) an
    empty slice stops the epoch with an error naming ``method``.
    """
    import tensorflow as tf

    total = pipelines * local

    def cut(*batch: Any) -> Any:
        batch = batch[0] if len(batch) == 1 else batch
        n = tf.shape(tf.nest.flatten(batch)[0])[0]
        parts = {}
        for j in range(local):
            r = pipeline * local + j
            start, end = (r * n) // total, ((r + 1) * n) // total
            if masked:
                empty = tf.equal(start, end)
                part = tf.nest.map_structure(
                    lambda t, s=start, e=end, m=empty: tf.cond(m, lambda: t[:1], lambda: t[s:e]), batch)
                mask = tf.cond(empty, lambda: tf.zeros([1], tf.float32),
                               lambda s=start, e=end: tf.ones([e - s], tf.float32))
                parts[f"r{j}"] = (part, mask)
            else:
                check = tf.debugging.assert_less(
                    start, end, message=f"the model's own {method} got a batch with fewer examples than the "
                    f"{total} replicas, so a replica would get an empty batch. HINT: batch with "
                    f"drop_remainder=True, or pick a batch size that leaves at least {total} examples in the last batch.")
                with tf.control_dependencies([check]):
                    parts[f"r{j}"] = tf.nest.map_structure(lambda t, s=start, e=end: tf.identity(t[s:e]), batch)
        return parts

    sliced = ds.map(cut)  # in order: every worker must slice the same batch at the same step
    if local == 1:
        out = sliced.map(lambda parts: parts["r0"])
    else:
        def each(parts: Any) -> Any:
            streams = [tf.data.Dataset.from_tensors(parts[f"r{j}"]) for j in range(local)]
            joined = streams[0]
            for s in streams[1:]:
                joined = joined.concatenate(s)
            return joined

        out = sliced.flat_map(each)
    return out if not masked or endless else _then_padding(out)


def step_counts(shard_sizes: list[int], per_replica: int) -> list[int]:
    """Real examples over every pipeline at each step of an epoch whose pipelines (one
    replica each) hold ``shard_sizes`` examples in batches of ``per_replica``: the epoch
    ends with the longest shard; shorter ones are padded meanwhile (they count 0)."""
    steps = max(math.ceil(s / per_replica) for s in shard_sizes) if shard_sizes else 0
    return [sum(max(0, min(per_replica, s - t * per_replica)) for s in shard_sizes) for t in range(steps)]


def equal_batches(n: int, batches: int, batch: int) -> list[int]:
    """Sizes of ``batches`` non-empty batches of at most ``batch`` of ``n`` examples: full
    batches first, the last ones shorter (needs ``batches <= n <= batches * batch``)."""
    sizes, left = [], n
    for j in range(batches):
        sizes.append(min(batch, left - (batches - j - 1)))
        left -= sizes[-1]
    return sizes


def own_step_batches(source: Any, *, pipelines: int, replicas: int, per_replica: int | None,
                     repeat: bool, method: str) -> tuple[int | None, list[list[int]] | None]:
    """``(steps, batch sizes per pipeline)`` of an epoch fed to the model's own step.

    The rule (no padding, no empty batch, the user's batch structure): every replica gets a
    real, non-empty batch at every step, so each input pipeline yields the same number of
    batches, a multiple of its replicas; a pipeline whose shard is shorter splits its last
    batches (``equal_batches``). Where that cannot hold, one error before training.
    ``steps`` None: the size is unknown (the epoch ends when every pipeline ends together).
    """
    local = max(1, replicas // max(1, pipelines))
    hint = ("HINT: pass steps_per_epoch= (shards then repeat and every batch is real), or use arrays / an "
            "unbatched dataset with at least one example per replica and step.")
    if repeat:
        return None, None
    n = source.num_examples
    if n is None:
        raise TrainerError(
            f"the model's own {method} needs every worker to run the same number of steps over real "
            f"batches, and the size of this input is unknown. {hint}")
    if source.batched:  # every replica gets a slice of every batch (_replica_slices)
        return n, None
    shards = kd_data.shard_sizes(n, pipelines)
    steps = max(math.ceil(math.ceil(s / per_replica) / local) for s in shards)
    if min(shards) < steps * local:
        raise TrainerError(
            f"the model's own {method} needs every worker to run the same number of steps over real "
            f"batches: {n} examples in per-replica batches of {per_replica} over {pipelines} worker(s) x "
            f"{local} replica(s) need {steps} steps, and the smallest shard ({min(shards)} examples) cannot "
            f"fill {steps * local} non-empty batches. {hint}")
    return steps, [equal_batches(s, steps * local, per_replica) for s in shards]


class EpochInput:
    """One distributed dataset per epoch (or one repeated one) over per-worker shards.

    ``own_step`` (a ``(pipelines, method)`` pair): the batches go to the model's own step, so
    they keep the user's structure (no mask, no padding) and are shaped by `own_step_batches`.
    """

    def __init__(self, strategy: Any, source: Any, *, per_replica: int | None, shuffle: bool,
                 seed: int | None, repeat: bool, own_step: tuple[int, str] | None = None,
                 pipelines: int = 1) -> None:
        self.strategy, self.source, self.repeat = strategy, source, repeat
        self._options = dict(batch_size=per_replica, shuffle=shuffle, seed=seed, repeat=repeat)
        self.sample = kd_data.pipeline(source, 0, 1, **self._options, epoch=0)
        replicas = self.replicas = max(1, strategy.num_replicas_in_sync)
        #: Every step's examples over all replicas when no batch can be short or missing
        #: (repeated shards, none empty, of unbatched data or of batches whose size is
        #: static, as after ``drop_remainder=True``), else None: each step counts them.
        if source.batched:
            # The input's batch is the global batch: every worker reads every batch and takes
            # its replicas' slices of it (_replica_slices), one step per batch.
            self.steps = source.num_examples
            batch = _static_batch_size(self.sample)
            self.full_batch = (batch if repeat and batch and batch >= replicas and source.num_examples else None)
        else:
            per_shard = kd_data.steps_for_shards(source.num_examples, replicas, per_replica)
            # Lockstep: the longest shard decides how many steps an epoch has.
            self.steps = None if per_shard is None else max(per_shard)
            self.full_batch = (per_replica * replicas if repeat and per_shard is not None and min(per_shard) > 0
                               else None)
        if not source.batched and source.num_examples is not None and source.num_examples < replicas:
            raise TrainerError(
                f"{source.num_examples} elements cannot feed {replicas} replicas (each needs at "
                "least one). HINT: use more data, or fewer workers or GPUs per worker."
            )
        self.own_step = own_step is not None
        #: Real examples over every replica at each step of an epoch, where every shard's
        #: size is known before it (one replica per worker): no step then all-reduces its
        #: count, and the epoch has exactly ``len(counts)`` steps. Else None.
        self.counts: list[int] | None = None
        sizes = None if repeat or own_step is not None or source.batched or not per_replica else (
            source.shard_sizes(pipelines) if pipelines == replicas else None)
        if sizes is not None:
            self.counts = step_counts(sizes, per_replica)
        #: The shards' sizes are unknown before the first epoch but the same every epoch
        #: (files dealt to workers): the steps' counts of the first epoch that runs whole
        #: become ``counts`` (`learn`).
        self.sizes = kd_data.FirstEpochCount(counting=(
            self.counts is None and own_step is None and not source.batched and bool(per_replica)
            and pipelines == replicas and kd_data.counts_in_first_epoch(source, repeat)))
        self._method = own_step[1] if own_step is not None else ""
        self._sizes: list[list[int]] | None = None
        if own_step is not None:
            pipelines, method = own_step
            steps, self._sizes = own_step_batches(source, pipelines=pipelines, replicas=replicas,
                                                  per_replica=per_replica, repeat=repeat, method=method)
            self.steps = steps if not repeat else self.steps
        self._persistent = None
        self._stream = FitStream(self._make)

    def iterator(self, epoch: int, last: int | None = None) -> Any:
        """The distributed iterator of ``epoch``. Where every step's count is known
        (``counts``) and ``last`` is given, one iterator runs through epochs ``epoch`` ..
        ``last``, each exactly ``len(counts)`` batches per pipeline: a fresh iterator per
        epoch cost about 0.1 s per epoch to make, and destroying the last one stalled an
        epoch in about four by about 0.5 s (docs/performance-history.md)."""
        if self.repeat and self._persistent is not None:
            return self._persistent
        if self.counts is not None and last is not None:
            self.sizes.say_once(lambda: logger.info(
                "every epoch of this %s has %d steps, counted in the first: this one and the later ones run "
                "without counting each step's examples.", type(self.source).__name__, len(self.counts or ())))
            return self._stream.get(epoch, last)
        it = self._make(epoch)
        if self.repeat:
            self._persistent = it
        return it

    def learn(self, counts: list[int]) -> None:
        """Take the examples of each step of an epoch that ran whole as every later epoch's:
        those run without a count per step, in one iterator (`iterator`)."""
        if self.sizes.take(counts):
            self.counts = counts

    def close(self) -> None:
        """Let go of the iterators this input holds between epochs (the fit's stream, a repeated
        input's iterator), at the fit's end: left to Python's collector (they sit in a reference
        cycle), they are freed at a random later moment, at the latest at the process's exit."""
        self._stream.drop()
        self._persistent = None

    def end_stream(self) -> None:
        """The epoch did not take all its batches: the next one starts a fresh iterator."""
        self._stream.drop()

    def _make(self, epoch: int, last: int | None = None) -> Any:
        def fit_long(ctx: Any) -> Any:
            import tensorflow as tf

            steps = len(self.counts)
            # An in-memory cache lasts as long as its shard: made once here, every epoch
            # reads it (a shard per epoch parsed each epoch again: 0.83x / 0.95x).
            shard = (self.source.shard(ctx.input_pipeline_id, ctx.num_input_pipelines)
                     if kd_data.keeps_cache(self.source) and not self.source.batched and not self.own_step else None)
            ds = tf.data.Dataset.range(epoch, last + 1).flat_map(lambda e: one_epoch(ctx, e, shard).take(steps))
            # flat_map drops the epochs' options (the user's dataset's): carried over.
            ds = ds.with_options(one_epoch(ctx, tf.constant(epoch, tf.int64), shard).options())
            # Endless (never read: the fit ends first), so the distributed iterator knows its
            # input cannot end and no step all-reduces whether every worker has a batch (a
            # dataset of unknown size cost one collective per step, 15 % of an MLP's steps/s).
            never = tf.nest.map_structure(empty_like, ds.element_spec)
            return ds.concatenate(tf.data.Dataset.from_tensors(never).repeat()).prefetch(tf.data.AUTOTUNE)

        def one_epoch(ctx: Any, epoch: Any, shard: Any = None) -> Any:
            if shard is not None:
                options = {key: value for key, value in self._options.items() if key != "repeat"}
                ds = kd_data.epoch_batches(self.source, shard, ctx.input_pipeline_id, **options, epoch=epoch)
                return _with_padding(ds, endless=self.full_batch is not None)
            if self.source.batched:
                ds = kd_data.pipeline(self.source, 0, 1, **self._options, epoch=epoch)
                local = max(1, self.replicas // ctx.num_input_pipelines)
                return _replica_slices(ds, ctx.input_pipeline_id, ctx.num_input_pipelines, local,
                                       masked=not self.own_step, endless=self.full_batch is not None,
                                       method=self._method)
            ds = kd_data.pipeline(self.source, ctx.input_pipeline_id, ctx.num_input_pipelines,
                                  **self._options, epoch=epoch)
            if self.own_step:  # the user's batches as they are (see own_step_batches)
                sizes = self._sizes[ctx.input_pipeline_id] if self._sizes else None
                if sizes and len(set(sizes)) > 1:
                    import tensorflow as tf

                    ds = ds.rebatch(tf.constant(sizes, tf.int64))
                return ds
            return _with_padding(ds, endless=self.full_batch is not None)

        make = fit_long if last is not None else lambda ctx: one_epoch(ctx, epoch)
        return iter(self.strategy.distribute_datasets_from_function(lambda ctx: without_autotune_thread(make(ctx))))
