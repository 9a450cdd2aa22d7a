"""Every private TensorFlow API and internal rule `keras_distrib.data` relies on, fenced.

Checked against the TensorFlow and Keras releases in `TESTED_VERSIONS` (pyproject.toml
bounds their minors): an upgrade re-checks this module and ``tests/unit/test_data.py`` (the
seed and graph tests fail if a rule below changed). Each entry says which upstream limitation it works around.

* `dataset_graph_def` / `function_from_graph_def`: a ``tf.data.Dataset`` built in the
  chief's (or each worker's) Python is rebuilt on every worker from its serialised graph.
* `seeded_graph` rewrites the shuffles in that graph so every worker draws the same order
  (`derived_op_seed` copies TensorFlow's internal per-op seed rule to recognise seeds that
  differ between processes).
* `ends_with_batch` reads from the graph whether the pipeline's elements are batches.
* `enqueued_batches`: Keras' own pool for a PyDataset's `workers`.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Sequence

#: The releases these private uses were checked against (the same name in every
#: fenced module: tests/unit/test_import_boundaries.py reads it).
TESTED_VERSIONS = {"tensorflow": "2.21.0", "keras": "3.15.1"}

#: TensorFlow's bound for op seeds (tensorflow/python/framework/random_seed.py).
_MAXINT32 = 2**31 - 1
#: Name of the epoch input added to a dataset graph by `seeded_graph`.
EPOCH_INPUT = "keras_distrib_epoch"
#: The shuffle ops of tensorflow/core/ops/dataset_ops.cc (2.21), old and new versions.
_SHUFFLES = {"ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
             "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2"}
#: Ops that keep their input's element structure (batch dimension included).
_PASS_THROUGH = ("Prefetch", "Options", "Model", "MaxIntraOpParallelism", "PrivateThreadPool",
                 "Map", "ParallelMap", "Cache", "AssertCardinality", "Take", "Skip", "Repeat",
                 "Shuffle", "Filter", "Ignore", "Finalize", "Identity", "AssertNext")
_BATCHES = ("Batch", "PaddedBatch", "ParallelBatch", "MapAndBatch", "ExperimentalMapAndBatch")


# ---------------------------------------------------------------- tf.data graphs

def dataset_graph_def(dataset: Any) -> Any:
    """The GraphDef that creates ``dataset``.

    Upstream: an eager dataset made on the chief cannot be sent to a remote worker (its
    variant lives on the chief) and a shuffle without a seed draws a different order on
    every worker; tf.distribute itself rebuilds datasets from this serialised graph
    (``Dataset._as_serialized_graph``, private).
    """
    from tensorflow.core.framework import graph_pb2

    return graph_pb2.GraphDef().FromString(dataset._as_serialized_graph().numpy())


def function_from_graph_def(graph_def: Any, inputs: Sequence[str], output: str) -> Any:
    """A concrete function running ``graph_def`` (upstream: no public importer;
    ``tensorflow.python.eager.wrap_function.function_from_graph_def``)."""
    from tensorflow.python.eager import wrap_function

    return wrap_function.function_from_graph_def(graph_def, list(inputs), output)


def _node_map(graph_def: Any) -> dict[str, Any]:
    return {n.name: n for n in graph_def.node}


def _output_node(graph_def: Any) -> str:
    ret = next(n for n in graph_def.node if n.op == "_Retval")
    return ret.input[0].split(":")[0]


#: Ops that call back into the Python of the process that built the dataset.
_PYTHON_OPS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


def runs_python(graph_def: Any) -> bool:
    """True if the pipeline calls Python (``from_generator``, ``tf.py_function``): its
    elements come from the process that built it (the chief).

    Upstream: a dataset does not say so; the op names of its serialised graph and of the
    functions in its library (2.21) do.
    """
    ops = [n.op for n in graph_def.node]
    ops += [n.op for f in graph_def.library.function for n in f.node_def]
    return any(op in _PYTHON_OPS for op in ops)


def dataset_runs_python(dataset: Any) -> bool:
    """`runs_python` of a dataset's own graph."""
    return runs_python(dataset_graph_def(dataset))


def ends_with_batch(graph_def: Any) -> bool:
    """True if the pipeline's last element-shaping op is a batch (not unbatch/slices).

    Upstream: a dataset does not say whether its elements are batches; the op names of
    the serialised graph (2.21) do.
    """
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


# ---------------------------------------------------------------- TensorFlow's seed rules

#: How many of TensorFlow's derived op seeds `derived_op_seed` recognises (one is drawn per
#: unseeded random op made under the global seed; scanning them all once takes ~0.2 s).
DERIVED_SEEDS_SCANNED = 1 << 18


@functools.lru_cache(maxsize=8)
def _derived_op_seeds(global_seed: int) -> frozenset[int]:
    # TensorFlow's eager context draws them from random.Random(global seed), one per op
    # (tensorflow/python/eager/context.py: Context._internal_operation_seed, 2.21).
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

    Upstream: tf.data has no public way to re-seed a built pipeline, and the inputs of
    the shuffle ops (input, buffer_size, seed, seed2[, count][, seed_generator]) are the
    2.21 op definitions.
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


# ---------------------------------------------------------------- Keras' PyDataset workers

def enqueued_batches(py_dataset: Any, count: int | None) -> Any:
    """``py_dataset[0], py_dataset[1], ...`` (``count`` of them; None: endless), fetched
    ahead by the PyDataset's own ``workers`` threads (processes if its
    ``use_multiprocessing``), at most ``max_queue_size`` ahead, as Keras' ``model.fit`` does.

    Upstream: Keras 3 (3.15) keeps the pool that honours those settings private
    (``keras.src.trainers.data_adapters.py_dataset_adapter.OrderedEnqueuer``); its
    ``get()`` stream must be stopped after the last batch, and never started for none.
    """
    from keras.src.trainers.data_adapters.py_dataset_adapter import OrderedEnqueuer

    if count == 0:
        return
    enqueuer = OrderedEnqueuer(py_dataset, workers=py_dataset.workers,
                               use_multiprocessing=py_dataset.use_multiprocessing,
                               max_queue_size=py_dataset.max_queue_size, shuffle=False)
    enqueuer.start()
    try:
        for i, batch in enumerate(enqueuer.get()):
            yield batch
            if count is not None and i >= count - 1:
                return
    finally:
        enqueuer.stop()
