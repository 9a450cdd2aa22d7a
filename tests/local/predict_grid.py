"""Grid of keras_distrib.predict cases, run inside an existing cluster (ps chief or allreduce workers).

Every case must return the reference predictions ``model(x)`` computed in this process, row
for row in the input's order: input kinds (numpy dict, list of arrays with a multi-output
model, tf.data of x / of (x, y) / batched, FileSource, ``steps=``) x sizes that do not
divide by batch x workers.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

#: (rows, batch size): 449 = 14 x 32 + 1; 31 rows in batches of 10; fewer rows than a batch.
SIZES = [(449, 32), (31, 10), (5, 32)]


def make_model() -> Any:
    """Dict input, BatchNorm, two named outputs (a dict of predictions)."""
    import keras

    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    h = keras.layers.BatchNormalization()(h)
    outputs = {"p": keras.layers.Dense(3, activation="softmax", name="p")(h), "v": keras.layers.Dense(1, name="v")(h)}
    model = keras.Model({"a": a, "b": b}, outputs)
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss={"p": "sparse_categorical_crossentropy", "v": "mse"})
    return model


def arrays(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {"a": rng.normal(size=(n, 4)).astype("float32"), "b": rng.normal(size=(n, 2)).astype("float32")}


def _files(x: dict[str, np.ndarray], tmp: str) -> Any:
    """Five TFRecord files; file f holds rows f*m..; sorted names = input order."""
    import tensorflow as tf

    from keras_distrib import data as kd

    n, paths = len(x["a"]), []
    bounds = np.linspace(0, n, 6).astype(int)
    for f in range(5):
        path = os.path.join(tmp, f"predict-{n}-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for i in range(bounds[f], bounds[f + 1]):
                feats = {k: tf.train.Feature(float_list=tf.train.FloatList(value=x[k][i])) for k in x}
                w.write(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())
        paths.append(path)
    spec = {"a": tf.io.FixedLenFeature([4], tf.float32), "b": tf.io.FixedLenFeature([2], tf.float32)}

    def reader(path: Any) -> Any:
        return tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_single_example(r, spec))

    return kd.FileSource(paths[::-1], reader=reader, num_examples=n)  # unsorted on purpose


def cases(tmp: str) -> list[tuple[str, int, Any, dict[str, Any], int]]:
    """(name, n, x, predict kwargs, rows expected: the first `rows` of the n)."""
    import tensorflow as tf

    out = []
    for n, batch in SIZES:
        x = arrays(n)
        y = np.zeros(n, "float32")
        out += [
            ("numpy-dict", n, x, {"batch_size": batch}, n),
            ("dataset-x", n, tf.data.Dataset.from_tensor_slices(x), {"batch_size": batch}, n),
            ("dataset-xy-batched", n, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), {}, n),
        ]
    x = arrays(449)
    out += [
        ("files", 449, _files(x, tmp), {"batch_size": 16}, 449),
        ("numpy-steps", 449, x, {"batch_size": 32, "steps": 3}, 96),
        ("dataset-batched-steps", 449, tf.data.Dataset.from_tensor_slices(x).batch(20), {"steps": 4}, 80),
    ]
    return out


def run(model: Any, predict: Callable[..., Any], tmp: str) -> list[dict[str, Any]]:
    """Each case's worst absolute error against ``model(x)`` and its row count."""
    results = []
    for name, n, x, kwargs, rows in cases(tmp):
        want = {k: np.asarray(v) for k, v in model(arrays(n), training=False).items()}
        got = predict(model, x, **kwargs)
        error = max(float(np.max(np.abs(np.asarray(got[k]) - want[k][:rows]), initial=0.0)) for k in want)
        results.append({"case": name, "n": n, "rows": [len(got[k]) for k in sorted(got)], "want_rows": rows,
                        "error": error})
    return results


def check(results: list[dict[str, Any]]) -> None:
    bad = [r for r in results if r["rows"] != [r["want_rows"]] * 2 or not r["error"] < 1e-5]
    assert not bad, bad
