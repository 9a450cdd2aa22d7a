"""What the trainers call: `as_source` (the user's input, once, as a `Source`) and
`pipeline` (one worker's dataset of one epoch)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from .arrays import ArraySource
from .base import BaseSource, CustomSource, InputError, Source
from .policy import SHUFFLE_BUFFER, Order, map_nest
from .pydataset import PyDatasetSource, is_py_dataset
from .tfdata import DatasetSource

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

#: What a Python generator or iterator can become instead (every layout).
_ITERATOR_HINT = ("HINT: wrap it as a keras.utils.PyDataset (indexable, so keras_distrib can share its batches out), as "
                  "tf.data.Dataset.from_generator(...) (every worker rebuilds it and keeps element i % k, so it "
                  "must yield the same elements on every worker), or pass arrays.")


def as_source(data: Any, what: str = "x") -> Source:
    """What users pass to ``fit`` (arrays, ``(x, y)``, a Dataset, a PyDataset, a Source) as a
    `Source`; `InputError` (one line, with a HINT) for what no layout takes. ``what`` names
    the argument in that error."""
    if isinstance(data, BaseSource):
        return data
    if hasattr(data, "shard") and hasattr(data, "num_examples"):
        return CustomSource(data)
    if is_py_dataset(data):
        return PyDatasetSource(data)
    try:
        import tensorflow as tf

        if isinstance(data, tf.data.Dataset):
            return DatasetSource(data)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(data, tuple) and data and _is_dataset_like(data[0]) and any(v is not None for v in data[1:]):
        raise InputError(
            f"{what} is a {_kind(data[0])} and y or sample_weight were given too. HINT: put the targets (and "
            "weights) in its elements, as model.fit expects; pass y= and sample_weight= only with arrays."
        )
    if isinstance(data, tuple) and data and _is_dataset_like(data[0]):
        return as_source(data[0], what)
    if inspect.isgenerator(data) or (hasattr(data, "__next__") and hasattr(data, "__iter__")):
        raise InputError(f"{what} is a Python {type(data).__name__}, which keras_distrib cannot split over workers. "
                         + _ITERATOR_HINT)
    if data is None:
        raise InputError(f"{what} is None. HINT: pass the training data: arrays, a tf.data.Dataset, a "
                         "keras.utils.PyDataset or a keras_distrib.data source.")
    if isinstance(data, list):
        data = tuple(data)
    arrays = map_nest(lambda leaf: _array(leaf, what), data)
    try:
        return ArraySource(arrays)
    except ValueError as e:  # rows that do not line up
        raise InputError(f"{what}: the {e}. HINT: give x, y and sample_weight one row per example each.") from None


def _is_dataset_like(data: Any) -> bool:
    return is_py_dataset(data) or type(data).__name__.endswith("Dataset") and hasattr(data, "element_spec")


def _kind(data: Any) -> str:
    return "keras.utils.PyDataset" if is_py_dataset(data) else type(data).__name__


def _array(leaf: Any, what: str) -> Any:
    """One leaf of an array input as something ``from_tensor_slices`` takes (or None)."""
    import numpy as np

    if leaf is None or isinstance(leaf, np.ndarray) or type(leaf).__module__.startswith("tensorflow"):
        return leaf
    if type(leaf).__module__.startswith("pandas") and hasattr(leaf, "to_numpy"):
        return leaf.to_numpy()  # a pandas DataFrame or Series: its values, as Keras takes them
    if type(leaf).__module__.startswith("scipy.sparse"):
        raise InputError(f"{what} holds a scipy sparse matrix, which keras_distrib does not shard. HINT: pass "
                         "x.toarray() if it fits, or a tf.data.Dataset of tf.sparse.SparseTensor batches.")
    if inspect.isgenerator(leaf) or is_py_dataset(leaf) or hasattr(leaf, "element_spec"):
        raise InputError(f"{what} nests a {_kind(leaf)} inside a tuple, list or dict. HINT: pass it alone, "
                         "with its targets in its elements.")
    if hasattr(leaf, "__array__"):  # jax, torch (cpu) and other array types
        return np.asarray(leaf)
    if isinstance(leaf, (bool, int, float, str, bytes)):
        raise InputError(f"{what} holds a single {type(leaf).__name__} ({leaf!r}), not an array. HINT: pass one "
                         "row per example (a numpy array), or a list of arrays for several inputs.")
    raise InputError(
        f"{what} is a {type(leaf).__module__}.{type(leaf).__name__}, which keras_distrib.fit does not take. HINT: "
        "pass numpy arrays (dicts and lists of them), a tf.data.Dataset, a keras.utils.PyDataset or a "
        "keras_distrib.data source."
    )


def pipeline(
    source: Source,
    index: int,
    num_shards: int,
    *,
    batch_size: int | None,
    shuffle: bool,
    seed: int | None,
    repeat: bool,
    epoch: Any = 0,
    shuffle_buffer: int = SHUFFLE_BUFFER,
) -> "tf.data.Dataset":
    """Per-worker input pipeline of one epoch: shard -> order -> (repeat) -> batch -> finish.

    ``epoch`` (int or int64 tensor) varies the shuffle order from epoch to epoch; each
    epoch's dataset is finite unless ``repeat``. How the shard is ordered is the source's
    (`Source.epoch_elements`): a per-shard shuffle by default, a `DatasetSource` its own
    shuffles, seeded identically on every worker.
    """
    order = Order(shuffle=shuffle, seed=seed, epoch=epoch, buffer=shuffle_buffer)
    return _batches(source, source.epoch_elements(index, num_shards, order), batch_size=batch_size, repeat=repeat)


def epoch_batches(
    source: Source,
    elements: "tf.data.Dataset",
    index: int,
    *,
    batch_size: int | None,
    shuffle: bool,
    seed: int | None,
    epoch: Any,
    shuffle_buffer: int = SHUFFLE_BUFFER,
) -> "tf.data.Dataset":
    """`pipeline` of one epoch over ``elements``, shard ``index`` made once for several
    epochs (``source.shard(index, ...)``, for a source whose `Source.epoch_elements` is
    `BaseSource`'s): a cache in it lasts across them."""
    order = Order(shuffle=shuffle, seed=seed, epoch=epoch, buffer=shuffle_buffer)
    return _batches(source, order.apply(elements, index), batch_size=batch_size, repeat=False)


def keeps_cache(source: Source) -> bool:
    """True for a source with an in-memory cache (``cache=True``) that can serve several
    epochs: its shard made once, each epoch's `epoch_batches` over it."""
    return getattr(source, "cache", None) is True and type(source).epoch_elements is BaseSource.epoch_elements


def _batches(source: Source, ds: "tf.data.Dataset", *, batch_size: int | None, repeat: bool) -> "tf.data.Dataset":
    import tensorflow as tf

    if repeat:
        ds = ds.repeat()
    if not source.batched:
        if batch_size is None:
            raise ValueError("batch_size is required for unbatched data (arrays, files).")
        ds = ds.batch(batch_size, drop_remainder=False)
    ds = source.finish_batches(ds)
    return ds.prefetch(tf.data.AUTOTUNE)
