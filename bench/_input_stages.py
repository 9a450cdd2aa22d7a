"""Per-stage cost of the file input pipeline, measured alone (no training), for input_stall.py.

    python bench/_input_stages.py --model mlp --batch 64 --batches 300 --workdir D --result R.json

Each stage is a prefix of one worker's pipeline (shard 0 of 2 of `--examples` synthetic
examples in 4 TFRecord files, as bench/_train_jobs.py writes them), repeated, and timed
in steady state (after one pass over the shard: shuffle buffer and cache filled) over
``--batches`` batches with ``Dataset.reduce`` (the loop runs in
C++, no Python per batch; every stage ends in batches, so the loop's own per-element cost
is paid once per batch). Every figure is microseconds per batch of
``--batch`` examples. The caller pins this process to N cores (os.sched_setaffinity)
before TensorFlow starts, so tf.data's thread pools see N cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train_jobs import load_model_fn, parse_record, parse_records, synthetic, write_tfrecords  # noqa: E402

#: (stage name, what it adds), in pipeline order; see `stages`.
STAGES = (
    ("read", "read the shard's TFRecord files (parallel interleave) and batch the records"),
    ("read+parse", "read, parse each record (parallel map), batch: the per-record recipe"),
    ("read+parse_batch", "read, batch, parse each batch in one op: the batch-then-parse recipe"),
    ("pipeline parse_batch", "keras_distrib.data.pipeline of the batch-then-parse FileSource: + shuffle, prefetch"),
    ("pipeline per-record", "the same pipeline with the per-record parse"),
    ("pipeline cached", "the per-record pipeline reading its in-memory cache (after the first pass)"),
    ("pipeline arrays", "ArraySource of the same examples in memory (reference)"),
)


def _timed(ds: Any, batches: int) -> float:
    """Seconds to produce ``batches`` batches of ``ds`` (a fresh iterator, C++ loop)."""
    import numpy as np

    t0 = time.perf_counter()
    ds.take(batches).reduce(np.int64(0), lambda count, _: count + 1).numpy()
    return time.perf_counter() - t0


def _steady(build: Callable[[], Any], warm: int, batches: int, repeats: int = 3) -> float:
    """Microseconds per batch after the first ``warm`` batches (start-up, shuffle buffer,
    cache filling): the time for warm + batches minus the time for warm, fresh iterators,
    each the minimum of ``repeats`` runs (other load on the machine only adds time)."""
    full = min(_timed(build(), warm + batches) for _ in range(repeats))
    start = min(_timed(build(), warm) for _ in range(repeats))
    return max(full - start, 0.0) / batches * 1e6


def stages(x: Any, y: Any, paths: list[str], batch: int, batches: int) -> dict[str, float]:
    """{stage: microseconds per batch of ``batch`` examples}, steady state."""
    import tensorflow as tf

    from keras_distrib import data as kd

    shape = x.shape[1:]
    n = len(x)
    files = kd.FileSource(paths, num_examples=n)
    per_record = kd.FileSource(paths, parse=parse_record(shape), num_examples=n)
    by_batch = kd.FileSource(paths, parse_batch=parse_records(shape), num_examples=n)
    cached = kd.FileSource(paths, parse=parse_record(shape), cache=True, num_examples=n)
    parse_batch = parse_records(shape)

    def pipe(source: Any) -> Any:
        return kd.pipeline(source, 0, 2, batch_size=batch, shuffle=True, seed=0, repeat=True)

    builders: dict[str, Callable[[], Any]] = {
        "read": lambda: files.shard(0, 2).repeat().batch(batch),
        "read+parse": lambda: per_record.shard(0, 2).repeat().batch(batch),
        "read+parse_batch": lambda: files.shard(0, 2).repeat().batch(batch).map(
            parse_batch, num_parallel_calls=tf.data.AUTOTUNE),
        "pipeline parse_batch": lambda: pipe(by_batch),
        "pipeline per-record": lambda: pipe(per_record),
        "pipeline cached": lambda: pipe(cached),
        "pipeline arrays": lambda: pipe(kd.ArraySource((x, y))),
    }
    one_pass = -(-kd.shard_sizes(n, 2)[0] // batch)  # the shuffle buffer and the cache fill in it
    return {name: _steady(build, one_pass, batches) for name, build in builders.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--examples", type=int, default=4096)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args()
    x, y = synthetic(load_model_fn(args.model), args.examples)
    paths = write_tfrecords(x, y, args.workdir / "stage-records", files=4)
    stages(x, y, paths, args.batch, 2)  # warm-up: traces, page cache
    result = stages(x, y, paths, args.batch, args.batches)
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
