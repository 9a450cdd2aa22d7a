"""The batch readers a closure runs over: counted shards, parts gathered from whole arrays, and
numbered streams of runs of batches (`handout` picks which).

Nothing here imports TensorFlow at import time.
"""

from __future__ import annotations

import logging
from typing import Any


logger = logging.getLogger(__name__)


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
    epoch of 4 (docs/performance-history.md); without it, AUTOTUNE settings keep tf.data's defaults."""
    import tensorflow as tf

    dataset = getattr(source, "dataset", None)
    if dataset is not None and dataset.options().autotune.enabled is not None:
        return ds
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)

class Batches:
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

class RunBatches:
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
            batches = RunBatches(self._iterator, None, self._per_run, self._stacked)
            for _ in range(self._per_run):
                c = advance(batches, c)
            return i + 1, c

        if runs:
            carry = tf.while_loop(lambda i, _: i < runs, body, (tf.constant(0), carry))[1]
        batches = RunBatches(self._iterator, None, self._per_run, self._stacked)
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
            c = advance(RunBatches(iterator, run, per_run, self._stacked, 0), c)
            for j in range(1, per_run):
                c = tf.cond(r * per_run + j < num_steps,
                            lambda j=j, c=c: advance(RunBatches(iterator, run, per_run, self._stacked, j), c),
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

class Gathered:
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
            return i + 1, advance(Gathered(self._full, self._indices, self._batch_size, first + i), c)

        return tf.while_loop(lambda i, _: i < num_steps, body, (tf.constant(0), carry))[1]

def skip_to(iterator: Any, sources: Any, first: Any, per_run: int, stacked: bool, offset: int) -> "RunBatches":
    """The batches of one closure: a numbered stream of runs (``(number, run)``) moved past
    the runs before the one of batch ``first``. A stream already past that run (the closure
    was re-run on this worker after its own was lost) is replaced by a fresh one of the
    epoch from ``sources`` (`DynamicDatasetInput.iterator`). Only the choice of the stream
    is conditional: a ``tf.cond`` around the steps, waiting for the stream, cost 6-10 % of
    the MLP's steps/s (docs/performance-history.md)."""
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
    return RunBatches(stream, run, per_run, stacked, offset)
