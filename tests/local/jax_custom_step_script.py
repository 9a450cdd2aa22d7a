"""A JAX-only job SCRIPT: a model with its own stateless ``train_step`` (Keras' JAX guide,
"Customizing what happens in fit() with JAX") trained by the JAX parameter-server trainer.

argv: WORKDIR EPOCHS ROWS. The step computes the loss and its gradients itself, clips their
global norm at 1, applies them with the optimizer's ``stateless_apply`` and tracks three
metrics of its own: the loss, the accuracy, and the gradients' norm before clipping. The
model has BatchNorm (layer state the ps hold). The chief prints one JSON line with the history.
"""

import json
import sys
from pathlib import Path

import jax
import keras
import numpy as np

import keras_distrib
import keras_distrib.strategies
from keras_distrib.trainers import build

strategy = keras_distrib.strategy()
workdir, epochs, rows = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


class ClippedModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.grad_norm = keras.metrics.Mean(name="grad_norm")

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy, self.grad_norm]

    def loss_and_updates(self, trainable, non_trainable, x, y):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
        return self.compute_loss(x, y, y_pred), (y_pred, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metric_variables = state
        x, y = data[0], data[1]
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        norm = jax.numpy.sqrt(sum(jax.numpy.sum(g * g) for g in grads))
        grads = [g * jax.numpy.minimum(1.0, 1.0 / (norm + 1e-6)) for g in grads]
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        logs, values = self.updated(metric_variables, {"loss": (loss,), "accuracy": (y, y_pred), "grad_norm": (norm,)})
        return logs, (trainable, non_trainable, optimizer_variables, values)

    def test_step(self, state, data):
        trainable, non_trainable, metric_variables = state
        x, y = data[0], data[1]
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=False)
        loss = self.compute_loss(x, y, y_pred)
        logs, values = self.updated(metric_variables, {"loss": (loss,), "accuracy": (y, y_pred)})
        return logs, (trainable, non_trainable, values)

    def updated(self, metric_variables, updates):
        """Each metric's variables updated with its ``updates`` entry (kept without one), and the logs."""
        values, logs, at = [], {}, 0
        for metric in self.metrics:
            mine = metric_variables[at:at + len(metric.variables)]
            at += len(metric.variables)
            if metric.name in updates:
                mine = metric.stateless_update_state(mine, *updates[metric.name])
            logs[metric.name] = metric.stateless_result(mine)
            values += list(mine)
        return logs, values


def make_model():
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(2, activation="softmax")(h)
    model = ClippedModel(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


rng = np.random.default_rng(0)
x = rng.normal(size=(rows + 400, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")
model = build(make_model, strategy)
history = keras_distrib.fit(model, x[:rows], y[:rows], epochs=epochs, batch_size=32, verbose=2,
                            checkpoint_dir=str(workdir / "ckpt"), validation_data=(x[rows:], y[rows:]))
try:
    chief = keras_distrib.cluster().is_chief
except keras_distrib.strategies.NotInJobError:  # one process, outside a job: plain Keras
    chief = True
if chief:
    print(json.dumps({"history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}), flush=True)
