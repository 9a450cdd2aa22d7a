"""Sharding training data by worker rank.

Policy (the same in both layouts and in the helpers below):

* Element ``i`` goes to shard ``i % num_shards``. Shards are disjoint, their union is the
  whole data, and with ``n`` elements over ``k`` shards the first ``n % k`` shards hold one
  extra element. Nothing is dropped: batches are formed with ``drop_remainder=False``.
* Files are dealt the same way (file ``i`` to shard ``i % k``); fewer files than shards is
  an error because some worker would get no data.
* Shuffling is seeded per shard (``seed + shard``) so workers draw different orders,
  reproducibly.

`Source` objects describe data without materialising it per worker; the trainers ask
``source.shard(index, count)`` once per worker (a ParameterServerStrategy worker gets its
own dataset function with its index baked in, see ``trainers/ps_async.py``).
"""

from __future__ import annotations

import functools
import math
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

__all__ = [
    "Source",
    "ArraySource",
    "DatasetSource",
    "FileSource",
    "SelfLoadedSource",
    "as_source",
    "shard_sizes",
    "shard_arrays",
    "shard_dataset",
    "shard_files",
    "self_loading",
    "shard_seed",
    "derived_op_seed",
    "steps_for",
    "worker_rank",
]


def shard_sizes(n: int, num_shards: int) -> list[int]:
    """Sizes of the ``num_shards`` shards of ``n`` elements (first ``n % k`` get one more)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    base, extra = divmod(n, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def steps_for(num_examples: int, batch_size: int) -> int:
    """Batches needed to see every one of ``num_examples`` once (last batch may be short)."""
    return max(1, math.ceil(num_examples / batch_size))


def shard_seed(seed: int | None, index: int) -> int | None:
    """Per-shard shuffle seed: distinct per worker, reproducible for a given ``seed``."""
    return None if seed is None else int(seed) + int(index)


def _check_index(index: int, num_shards: int) -> None:
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")


def shard_arrays(arrays: Any, index: int, num_shards: int) -> Any:
    """Shard ``index`` of a nest of equally long arrays (``x``, ``(x, y)``, dicts...)."""
    _check_index(index, num_shards)
    return _map(lambda a: a[index::num_shards], arrays)


def shard_dataset(dataset: "tf.data.Dataset", index: int, num_shards: int) -> "tf.data.Dataset":
    """Shard ``index`` of a dataset's elements (element ``i`` goes to ``i % num_shards``)."""
    _check_index(index, num_shards)
    return dataset.shard(num_shards, index)


def shard_files(files: Sequence[str], index: int, num_shards: int) -> list[str]:
    """The files of shard ``index`` (sorted first, so every worker deals the same list)."""
    files = sorted(files)
    if len(files) < num_shards:
        raise ValueError(
            f"{len(files)} files cannot feed {num_shards} workers: each worker needs at "
            "least one file. HINT: split the data into more files or shard by example."
        )
    _check_index(index, num_shards)
    return files[index::num_shards]


def worker_rank() -> tuple[int, int]:
    """(rank, number of workers) of this process, from what the launcher passed (contract.py)."""
    from . import contract

    if not contract.in_job(os.environ):
        return 0, 1
    job, index = contract.read_task(os.environ)
    workers = len(contract.read_tf_cluster(os.environ).get("worker", [])) or 1
    return (index if job == "worker" else 0), workers


class Source(Protocol):
    """Something the trainers can split into per-worker datasets."""

    #: Number of elements (examples, or batches when ``batched``); None if unknown.
    num_examples: int | None
    #: True if elements are already batches (the trainer then does not batch again).
    batched: bool

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        """The dataset of shard ``index`` out of ``num_shards``."""
        ...


def _map(fn: Callable[[Any], Any], nest: Any) -> Any:
    """map over a nest of tuples/lists/dicts of arrays (no TensorFlow import needed)."""
    if isinstance(nest, dict):
        return {k: _map(fn, v) for k, v in nest.items()}
    if isinstance(nest, (tuple, list)):
        return type(nest)(_map(fn, v) for v in nest)
    return fn(nest)


def _flatten(nest: Any) -> list[Any]:
    out: list[Any] = []
    _map(out.append, nest)
    return out


def _leading_len(arrays: Any) -> int:
    lengths = {len(a) for a in _flatten(arrays) if a is not None}
    if len(lengths) != 1:
        raise ValueError(f"arrays have different lengths: {sorted(lengths)}")
    return lengths.pop()


@dataclass
class ArraySource:
    """In-memory arrays, e.g. ``(x, y)`` or ``(x, y, sample_weight)``."""

    arrays: Any
    batched: bool = False

    def __post_init__(self) -> None:
        self.num_examples: int | None = _leading_len(self.arrays)

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(shard_arrays(self.arrays, index, num_shards))


@dataclass
class DatasetSource:
    """A ``tf.data.Dataset``, sharded by element (whole batches when it is batched).

    ``batched``: None = read it from the pipeline (a final ``batch``/``padded_batch``...).
    Every worker rebuilds the dataset from its graph with each shuffle's seeds replaced by
    ``(seed or the fit seed, seed2 + epoch)``: all workers then draw the SAME order, so the
    shards (element ``i`` to worker ``i % k``) are disjoint and complete in every epoch,
    and ``reshuffle_each_iteration`` gives a new order each epoch.
    """

    dataset: Any
    batched: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        import tensorflow as tf

        card = int(self.dataset.cardinality())
        self.num_examples: int | None = card if card >= 0 else None
        if card == tf.data.INFINITE_CARDINALITY:
            self.num_examples = None
        self._graph = None
        if self.batched is None:
            self.batched = _ends_with_batch(self._graph_def())

    def _graph_def(self) -> Any:
        if self._graph is None:
            from .trainers import _private_apis

            self._graph = _private_apis.dataset_graph_def(self.dataset)
        return self._graph

    def shard(self, index: int, num_shards: int, epoch: Any = 0) -> "tf.data.Dataset":
        import tensorflow as tf

        variant = self._variant_fn()(tf.cast(epoch, tf.int64))
        dataset = tf.data.experimental.from_variant(variant, self.dataset.element_spec)
        return shard_dataset(dataset, index, num_shards)

    def _variant_fn(self) -> Any:
        if getattr(self, "_fn", None) is None:
            from .trainers import _private_apis

            graph, output = seeded_graph(self._graph_def(), self.seed)
            self._fn = _private_apis.function_from_graph_def(graph, [EPOCH_INPUT + ":0"], output)
        return self._fn


#: TensorFlow's bound for op seeds (tensorflow/python/framework/random_seed.py).
_MAXINT32 = 2**31 - 1
#: Name of the epoch input added to a dataset graph by `seeded_graph`.
EPOCH_INPUT = "keras_distrib_epoch"
_SHUFFLES = {"ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
             "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2"}
_PASS_THROUGH = ("Prefetch", "Options", "Model", "MaxIntraOpParallelism", "PrivateThreadPool",
                 "Map", "ParallelMap", "Cache", "AssertCardinality", "Take", "Skip", "Repeat",
                 "Shuffle", "Filter", "Ignore", "Finalize", "Identity", "AssertNext")
_BATCHES = ("Batch", "PaddedBatch", "ParallelBatch", "MapAndBatch", "ExperimentalMapAndBatch")


def _node_map(graph_def: Any) -> dict[str, Any]:
    return {n.name: n for n in graph_def.node}


def _output_node(graph_def: Any) -> str:
    ret = next(n for n in graph_def.node if n.op == "_Retval")
    return ret.input[0].split(":")[0]


def _ends_with_batch(graph_def: Any) -> bool:
    """True if the pipeline's last element-shaping op is a batch (not unbatch/slices)."""
    nodes = _node_map(graph_def)
    name = _output_node(graph_def)
    for _ in range(len(nodes)):
        node = nodes[name]
        op = node.op
        if op.startswith(_BATCHES):
            return True
        if op.startswith("Unbatch") or not op.startswith(_PASS_THROUGH) or not node.input:
            return False
        name = node.input[0].split(":")[0]
    return False


def _const_int(nodes: dict[str, Any], name: str) -> int:
    node = nodes.get(name.split(":")[0])
    if node is None or node.op != "Const":
        return 0
    tensor = node.attr["value"].tensor
    return int(tensor.int64_val[0]) if tensor.int64_val else 0


#: How many of TensorFlow's derived op seeds `derived_op_seed` recognises (one is drawn per
#: unseeded random op made under the global seed; scanning them all once takes ~0.2 s).
DERIVED_SEEDS_SCANNED = 1 << 18


@functools.lru_cache(maxsize=8)
def _derived_op_seeds(global_seed: int) -> frozenset[int]:
    # TensorFlow's eager context draws them from random.Random(global seed), one per op
    # (tensorflow/python/eager/context.py: Context._internal_operation_seed).
    draws = random.Random(global_seed)
    return frozenset(draws.randint(0, _MAXINT32) for _ in range(DERIVED_SEEDS_SCANNED))


def derived_op_seed(seed: int, seed2: int) -> bool:
    """True if ``(seed, seed2)`` is the pair TensorFlow gives an op made eagerly WITHOUT its
    own seed under the global seed ``seed`` (`tf.random.set_seed`, `keras.utils.set_random_seed`).

    That seed2 is the n-th draw of a per-process generator, n = the random ops made since
    the global seed was set: a worker that made one more (a chief-only step, a different
    branch) gets another shuffle order. An explicit op seed equal to one of the first
    `DERIVED_SEEDS_SCANNED` draws is taken for derived too (odds ~1e-4 per seed); global
    seeds outside [0, 2**31 - 1) are not recognised (TensorFlow truncates them).
    """
    return 0 <= seed < _MAXINT32 and seed2 in _derived_op_seeds(seed)


def seeded_graph(graph_def: Any, seed: int) -> tuple[Any, str]:
    """A copy of a dataset graph whose shuffles use ``(seed, seed2 + epoch)``.

    ``epoch`` is a new int64 input named `EPOCH_INPUT`. A shuffle without its own seed
    gets ``seed``; one with ``reshuffle_each_iteration=False`` keeps its seed2. A shuffle
    whose seed2 TensorFlow derived from the global seed (see `derived_op_seed`) gets
    ``seed`` and its place among the shuffles instead, as that seed2 depends on how many
    random ops the building process had made. Shuffles are rewritten to the seed-only op
    version (no seed-generator resource, which belongs to the process that built the
    dataset). Returns (graph, output tensor name).
    """
    from tensorflow.core.framework import graph_pb2, types_pb2

    graph = graph_pb2.GraphDef()
    graph.CopyFrom(graph_def)
    nodes = _node_map(graph)
    epoch = graph.node.add(name=EPOCH_INPUT, op="Placeholder")
    epoch.attr["dtype"].type = types_pb2.DT_INT64
    epoch.attr["shape"].shape.SetInParent()

    def const(name: str, value: int) -> str:
        node = graph.node.add(name=name, op="Const")
        node.attr["dtype"].type = types_pb2.DT_INT64
        node.attr["value"].tensor.dtype = types_pb2.DT_INT64
        node.attr["value"].tensor.tensor_shape.SetInParent()
        node.attr["value"].tensor.int64_val.append(value)
        return name

    dropped: set[str] = set()
    for place, node in enumerate([n for n in graph.node if n.op in _SHUFFLES]):
        inputs = list(node.input)
        has_seeds = node.op in ("ShuffleDataset", "ShuffleDatasetV3", "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")
        s1 = _const_int(nodes, inputs[2]) if has_seeds else 0
        s2 = _const_int(nodes, inputs[3]) if has_seeds else 0
        if s1 == 0 and s2 == 0:
            s1 = int(seed) + 1  # seed 0 and seed2 0 would mean "random" to TensorFlow
        elif derived_op_seed(s1, s2):
            # Keep the global seed (it still picks the order) but not the per-process draw.
            s2 = int(seed) * 1_000_003 + place + 1
        reshuffle = node.attr["reshuffle_each_iteration"].b if "reshuffle_each_iteration" in node.attr else True
        seed1 = const(node.name + "/kd_seed", s1)
        seed2 = const(node.name + "/kd_seed2", s2)
        if reshuffle:
            add = graph.node.add(name=node.name + "/kd_seed2_epoch", op="AddV2", input=[seed2, EPOCH_INPUT])
            add.attr["T"].type = types_pb2.DT_INT64
            seed2 = add.name
        repeat = node.op.startswith("ShuffleAndRepeat")
        count = inputs[4] if repeat else None
        dropped.update(i.split(":")[0] for i in inputs[2:] if i != count)
        node.op = "ShuffleAndRepeatDataset" if repeat else "ShuffleDataset"
        del node.input[:]
        node.input.extend([inputs[0], inputs[1], seed1, seed2] + ([count] if repeat else []))
        node.attr["reshuffle_each_iteration"].b = reshuffle
    used = {i.split(":")[0].lstrip("^") for n in graph.node for i in n.input}
    keep = [n for n in graph.node if not (n.name in dropped and n.name not in used)]
    del graph.node[:]
    graph.node.extend(keep)
    return graph, _output_node(graph) + ":0"


#: Records a FileSource reader hands over at once in the parallel interleave.
READ_CHUNK = 64


@dataclass
class FileSource:
    """Files dealt to workers (file ``i`` to worker ``i % k``), read and parsed in parallel.

    ``reader(path) -> Dataset`` of records (default ``tf.data.TFRecordDataset``). Each
    worker reads ``cycle_length`` of its files at once (default: all of them, up to 4),
    interleaved deterministically in chunks of `READ_CHUNK` records, so a given seed still
    gives a given order.

    Parsing, one of (both optional; without either, the reader's elements are the examples):

    * ``parse_batch(records) -> batch``: vectorised, applied after batching to a whole
      batch of records (e.g. ``tf.io.parse_example``). Usually much cheaper than parsing
      each record: one op per batch instead of one per example.
    * ``parse(record) -> example``: per record, in a parallel deterministic map.

    ``cache``: keep what the shard yields (parsed examples with ``parse``, records with
    ``parse_batch``) after the first pass. ``True`` caches in memory, which lasts as long
    as one iterator (a repeated dataset: fit with ``steps_per_epoch``); a directory path
    caches to one file per shard there (worker-local disk), which also lasts across
    epochs and fits. Only cache data that fits.
    """

    files: Sequence[str]
    reader: Callable[[Any], Any] | None = None
    num_examples: int | None = None
    batched: bool = False
    parse: Callable[[Any], Any] | None = None
    parse_batch: Callable[[Any], Any] | None = None
    cache: bool | str = False
    cycle_length: int | None = None

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        mine = shard_files(self.files, index, num_shards)
        reader = self.reader or tf.data.TFRecordDataset
        # Handing single records between threads costs more CPU than reading them (measured
        # on 1 core: +40 % for the read stage), so readers with fixed-shape elements (records)
        # hand over chunks of READ_CHUNK, unbatched after the interleave.
        specs = tf.nest.flatten(reader(tf.constant(mine[0])).element_spec)
        chunked = all(isinstance(s, tf.TensorSpec) and s.shape.is_fully_defined() for s in specs)
        read = (lambda path: reader(path).batch(READ_CHUNK)) if chunked else reader
        ds = tf.data.Dataset.from_tensor_slices(mine).interleave(
            read, cycle_length=self.cycle_length or min(len(mine), 4),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if chunked:
            ds = ds.unbatch()
        if self.parse is not None:
            ds = ds.map(self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.cache:
            where = "" if self.cache is True else os.path.join(str(self.cache), f"shard-{index}-of-{num_shards}")
            ds = ds.cache(where)
        return ds

    def finish_batches(self, batches: "tf.data.Dataset") -> "tf.data.Dataset":
        """Apply ``parse_batch`` to the batches of records (identity without it)."""
        import tensorflow as tf

        if self.parse_batch is None:
            return batches
        return batches.map(self.parse_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


@dataclass
class SelfLoadedSource:
    """Each worker loads its own data with ``load_fn(rank, num_workers) -> arrays``.

    With ``random_slice=True`` the loaded arrays are treated as a pool shared by all
    workers and worker ``rank`` keeps a random slice of it: a permutation drawn with
    ``seed`` (identical on every worker) dealt by rank, so slices are disjoint and cover
    the pool. With ``random_slice=False`` ``load_fn`` must already return only the
    worker's own part.

    In the parameter-server layouts the worker processes run no Python, so the chief calls
    ``load_fn(rank, num_workers)`` for each worker rank and ships each result to its worker.
    """

    load_fn: Callable[[int, int], Any]
    seed: int = 0
    random_slice: bool = True
    num_examples: int | None = None
    batched: bool = False

    def arrays_for(self, index: int, num_shards: int) -> Any:
        import numpy as np

        _check_index(index, num_shards)
        arrays = self.load_fn(index, num_shards)
        if not self.random_slice:
            return arrays
        perm = np.random.default_rng(self.seed).permutation(_leading_len(arrays))
        mine = np.sort(perm[index::num_shards])
        return _map(lambda a: np.asarray(a)[mine], arrays)

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(self.arrays_for(index, num_shards))


def self_loading(
    load_fn: Callable[[int, int], Any], *, seed: int = 0, random_slice: bool = True,
    num_examples: int | None = None,
) -> SelfLoadedSource:
    """Data that each worker loads itself; see `SelfLoadedSource`."""
    return SelfLoadedSource(load_fn, seed=seed, random_slice=random_slice, num_examples=num_examples)


def as_source(data: Any) -> Source:
    """Wrap what users pass to ``fit`` (arrays, ``(x, y)``, Dataset, Source) as a Source."""
    if hasattr(data, "shard") and hasattr(data, "num_examples"):
        return data
    try:
        import tensorflow as tf

        if isinstance(data, tf.data.Dataset):
            return DatasetSource(data)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(data, list):
        data = tuple(data)
    return ArraySource(data)


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
    shuffle_buffer: int = 10_000,
) -> "tf.data.Dataset":
    """Per-worker input pipeline of one epoch: shard -> shuffle -> (repeat) -> batch.

    ``epoch`` (int or int64 tensor) varies the shuffle order from epoch to epoch; each
    epoch's dataset is finite unless ``repeat``. A `DatasetSource` keeps its own order
    (its shuffles are seeded identically on every worker, see `DatasetSource`).
    """
    import tensorflow as tf

    if isinstance(source, DatasetSource):
        ds = source.shard(index, num_shards, epoch)
    else:
        ds = source.shard(index, num_shards)
        if shuffle:
            if tf.inside_function():
                # A tensor seed under a global seed of 0 (keras.utils.set_random_seed(0)) makes
                # tf.data compare the tensor as a Python bool; this trace's graph needs no seed.
                tf.compat.v1.get_default_graph().seed = None
            base = tf.constant(shard_seed(seed or 0, index) * 1_000_003, tf.int64)
            ds = ds.shuffle(shuffle_buffer, seed=base + tf.cast(epoch, tf.int64), reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    if not source.batched:
        if batch_size is None:
            raise ValueError("batch_size is required for unbatched data (arrays, files).")
        ds = ds.batch(batch_size, drop_remainder=False)
    if hasattr(source, "finish_batches"):  # FileSource's vectorised parse_batch
        ds = source.finish_batches(ds)
    return ds.prefetch(tf.data.AUTOTUNE)
