"""Training script for the resilience tests: an MLP on synthetic data, checkpointed.

argv: CHECKPOINT_DIR EPOCHS STEPS_PER_EPOCH. Every process running it prints one JSON line at the end with the exact
step counter, epochs trained in this run and a digest of the weights. The test kills
processes while it trains; the checkpoint interval comes from the launcher.

RESILIENCE_COUNT_AGAIN=N (ps layouts): once a closure ran again after a worker failed, the
counter counts N steps twice, as a re-run closure whose first run had counted does (the
chief must set it back: docs/faults.md, Restarts).
"""

import hashlib
import json
import os
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


class CountAgain(keras.callbacks.Callback):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.done = steps, False

    def on_train_batch_end(self, batch, logs=None):
        from keras_distrib.trainers import _private_apis as private

        trainer = keras_distrib.trainers.trainer_for(model)
        if not self.done and private.closures_run_again(trainer.coordinator):
            trainer.global_step.assign_add(self.steps)
            self.done = True
            print(f"count-again: {self.steps} steps counted twice", flush=True)


again = int(os.environ.get("RESILIENCE_COUNT_AGAIN", "0"))
history = keras_distrib.fit(model, (x, y), epochs=epochs, steps_per_epoch=steps, batch_size=32, verbose=2,
                            checkpoint_dir=directory, callbacks=[CountAgain(again)] if again else [])
step = int(keras_distrib.trainers.trainer_for(model).global_step.numpy())
digest = hashlib.sha1(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()
print(json.dumps({"step": step, "epochs_run": len(history.history.get("loss", [])),
                  "accuracy": history.history.get("accuracy", [None])[-1], "weights": digest}), flush=True)
