"""Training script for the JAX parameter-server input tests: one model trained by a fit per input
kind (argv: WORKDIR ROWS KIND...; kinds: dataset, batched, unknown, pydataset, split, steps).

Each fit runs 2 epochs on ROWS synthetic examples. As in jax_ps_script.py, an untrained output
carries each example's id, so the metrics ``id_count`` and ``id_idsum`` read how many examples an
epoch trained on, and which. Every process prints one JSON line per kind with the history its
fit returned (a worker's is the chief's).
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

from id_metrics import Count, IdSum

import keras_distrib
from keras_distrib.trainers import build

strategy = keras_distrib.strategy()
workdir, rows, kinds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]


def make_model():
    inputs = keras.Input((16,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(32, activation="relu")(inputs))
    model = keras.Model(inputs, {"label": keras.layers.Dense(2, activation="softmax", name="label")(h),
                                 "id": keras.layers.Dense(1, name="id")(h)})
    model.compile(keras.optimizers.Adam(1e-2), loss={"label": "sparse_categorical_crossentropy", "id": "mse"},
                  loss_weights={"label": 1.0, "id": 0.0},
                  metrics={"label": ["accuracy"], "id": [Count(), IdSum(name="idsum")]})
    return model


class Batches(keras.utils.PyDataset):
    """Batches of 50 (the last one short), by index."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // 50)

    def __getitem__(self, i):
        rows = slice(i * 50, (i + 1) * 50)
        return self.x[rows], {k: v[rows] for k, v in self.y.items()}


rng = np.random.default_rng(0)
x = rng.normal(size=(rows + 200, 16)).astype("float32")
y = {"label": (x[:, :4].sum(axis=1) > 0).astype("int32"), "id": (np.arange(rows + 200) % 1000).astype("float32")}
train_x, train_y = x[:rows], {k: v[:rows] for k, v in y.items()}
val = (x[rows:], {k: v[rows:] for k, v in y.items()})
elements = tf.data.Dataset.from_tensor_slices((train_x, train_y))
inputs = {
    "dataset": dict(x=elements.shuffle(300, seed=3), batch_size=32, validation_data=tf.data.Dataset.from_tensor_slices(val).batch(64)),
    "batched": dict(x=elements.shuffle(300, seed=3).batch(32), validation_data=val),
    "unknown": dict(x=elements.filter(lambda a, b: True).batch(40)),
    "pydataset": dict(x=Batches(train_x, train_y), validation_data=Batches(*val)),
    "split": dict(x=x, y=y, batch_size=32, validation_split=200 / (rows + 200)),
    "steps": dict(x=elements.shuffle(300, seed=3).batch(32).repeat(), steps_per_epoch=20,
                  validation_data=tf.data.Dataset.from_tensor_slices(val).batch(50).repeat(), validation_steps=2),
}
model = build(make_model, strategy)
for kind in kinds:
    history = keras_distrib.fit(model, epochs=2, verbose=2, **inputs[kind])
    # Unguarded, as a TensorFlow ps script may be (there only the chief runs it): every process prints.
    print(json.dumps({"kind": kind, "history": history.history}), flush=True)
