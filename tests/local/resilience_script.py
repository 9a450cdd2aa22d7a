"""Training script for the resilience tests: an MLP on synthetic data, checkpointed.

argv: CHECKPOINT_DIR EPOCHS STEPS_PER_EPOCH. Every process running it prints one JSON line at the end with the exact
step counter, epochs trained in this run and a digest of the weights. The test kills
processes while it trains; the checkpoint interval comes from the launcher.
"""

import hashlib
import json
import sys

import numpy as np

import keras_distrib
import keras_distrib.trainers

strategy = keras_distrib.strategy()
import keras  # noqa: E402

directory, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
x = rng.normal(size=(2000, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")

with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = keras_distrib.fit(model, (x, y), epochs=epochs, steps_per_epoch=steps, batch_size=32, verbose=2,
                            checkpoint_dir=directory)
step = int(keras_distrib.trainers.trainer_for(model).global_step.numpy())
digest = hashlib.sha1(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()
print(json.dumps({"step": step, "epochs_run": len(history.history.get("loss", [])),
                  "accuracy": history.history.get("accuracy", [None])[-1], "weights": digest}), flush=True)
