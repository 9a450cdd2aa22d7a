"""Training script for the JAX parameter-server tests: run unchanged under any backend.

argv: WORKDIR EPOCHS ROWS. An MLP with BatchNorm on ROWS synthetic examples (batch 32: the
last batch is short); a second, untrained output carries each example's id, so the metrics
``id_count`` and ``id_idsum`` read how many examples an epoch trained on, and which (ids
mod 1000, so the sums stay exact in float32). The chief
writes ``started-<epoch>`` as each epoch begins, saves WORKDIR/model.keras and prints one JSON
line with the history and the step counter.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np

from id_metrics import Count, IdSum

import keras_distrib
import keras_distrib.strategies
from keras_distrib.trainers import build, trainer_for

strategy = keras_distrib.strategy()
workdir, epochs, rows = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


class Marks(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        (workdir / f"started-{epoch}").touch()


def make_model():
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    label = keras.layers.Dense(2, activation="softmax", name="label")(h)
    ids = keras.layers.Dense(1, name="id")(h)
    model = keras.Model(inputs, {"label": label, "id": ids})
    model.compile(keras.optimizers.Adam(1e-2), loss={"label": "sparse_categorical_crossentropy", "id": "mse"},
                  loss_weights={"label": 1.0, "id": 0.0},
                  metrics={"label": ["accuracy"], "id": [Count(), IdSum(name="idsum")]})
    return model


keras.utils.set_random_seed(0)  # the same initial weights in every run, alone or distributed
rng = np.random.default_rng(0)
x = rng.normal(size=(rows + 400, 16)).astype("float32")
labels = (x[:, :4].sum(axis=1) > 0).astype("int32")
ids = (np.arange(rows + 400) % 1000).astype("float32")  # sums stay exact in float32
model = build(make_model, strategy)
history = keras_distrib.fit(model, (x[:rows], {"label": labels[:rows], "id": ids[:rows]}), epochs=epochs,
                            batch_size=32, verbose=2, callbacks=[Marks()], checkpoint_dir=str(workdir / "ckpt"),
                            validation_data=(x[rows:], {"label": labels[rows:], "id": ids[rows:]}))
try:
    chief = keras_distrib.cluster().is_chief
    step = int(trainer_for(model).global_step.numpy())  # the batches trained, a resumed run's included
except keras_distrib.strategies.NotInJobError:  # one process, outside a job: plain Keras
    chief, step = True, int(model.optimizer.iterations.numpy())
if chief:
    model.save(workdir / "model.keras")
    probe = model.predict(x[rows:rows + 8], verbose=0)["label"]
    print(json.dumps({"history": history.history, "probe": probe.tolist(), "step": step}), flush=True)
