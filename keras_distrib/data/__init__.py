"""Sharding training data by worker rank: one module per input kind, one protocol.

* `policy`: which elements, files and batches each worker gets (element ``i`` to worker
  ``i % k``), and the per-shard shuffle; written once for every source.
* `base`: the `Source` protocol every source honours, and `BaseSource`'s defaults.
* One module per input kind: `arrays` (`ArraySource`), `tfdata` (`DatasetSource`),
  `files` (`FileSource`), `self_loading` (`SelfLoadedSource`), `pydataset`
  (`PyDatasetSource`, a Keras ``PyDataset``).
* `keyed`: `keyed_source`, the ``(keys, x)`` elements order-preserving predict shards.
* `counting`: `FirstEpochCount`, shard sizes counted in the first whole epoch and relied
  on after (files dealt whole), for both trainers.
* `input`: `as_source` (the user's input, turned into a source once per fit; what no
  layout takes is refused there with `InputError`) and `pipeline` (one worker's dataset
  of one epoch). docs/input-kinds.md has the table of input kinds per layout.
* `_private_apis`: the private TensorFlow APIs and seed rules the tf.data source needs,
  fenced, with their upstream reasons and the versions checked.

`Source` objects describe data without materialising it per worker; the trainers ask
``pipeline(source, index, count, ...)`` once per worker (a ParameterServerStrategy worker
gets its own dataset function with its index baked in, see ``trainers/ps/handout.py``).
Nothing here imports TensorFlow at import time.
"""

from __future__ import annotations

from ._private_apis import DERIVED_SEEDS_SCANNED, EPOCH_INPUT, dataset_runs_python, derived_op_seed, seeded_graph
from .arrays import ArraySource
from .base import BaseSource, CustomSource, InputError, Source
from .counting import FirstEpochCount, counts_in_first_epoch
from .files import READ_CHUNK, FileSource
from .keyed import keyed_source
from .input import as_source, epoch_batches, keeps_cache, pipeline
from .policy import (Order, epoch_parts, tail_part_limit, flatten_nest, map_nest, shard_arrays, shard_dataset, shard_files,
                     shard_indices, shard_rows, shard_seed, shard_sizes, steps_for, steps_for_shards, worker_rank)
from .pydataset import PyDatasetSource, is_py_dataset
from .self_loading import SelfLoadedSource, self_loading
from .tfdata import DatasetSource

__all__ = [
    "Source",
    "BaseSource",
    "CustomSource",
    "ArraySource",
    "epoch_parts",
    "tail_part_limit",
    "shard_rows",
    "DatasetSource",
    "FileSource",
    "SelfLoadedSource",
    "PyDatasetSource",
    "InputError",
    "is_py_dataset",
    "Order",
    "as_source",
    "FirstEpochCount",
    "counts_in_first_epoch",
    "keyed_source",
    "pipeline",
    "epoch_batches",
    "keeps_cache",
    "shard_sizes",
    "shard_indices",
    "shard_arrays",
    "shard_dataset",
    "shard_files",
    "self_loading",
    "shard_seed",
    "derived_op_seed",
    "seeded_graph",
    "dataset_runs_python",
    "steps_for",
    "steps_for_shards",
    "worker_rank",
    "map_nest",
    "flatten_nest",
    "READ_CHUNK",
    "EPOCH_INPUT",
    "DERIVED_SEEDS_SCANNED",
]
