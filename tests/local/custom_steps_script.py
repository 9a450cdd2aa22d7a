"""Keras' guide "Customizing what happens in fit()" as a Keras user writes it, run unchanged
under plain single-process ``model.fit`` (no launcher) and under keras_distrib in every
layout (tests/local/test_custom_steps.py). Prints one JSON line of results.

The models are the guide's (keras.io/guides/custom_train_step_in_tensorflow), shrunk to a
linear regression that converges in a few epochs, so runs are comparable across layouts.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import keras
import keras_distrib

EPOCHS = 8
N, D = 203, 6  # 203: no number of workers divides it (uneven shards)
rng = np.random.default_rng(0)
X = rng.normal(size=(N, D)).astype("float32")
W = rng.normal(size=(D, 1)).astype("float32")
Y = (X @ W + 0.05 * rng.normal(size=(N, 1))).astype("float32")
SW = rng.uniform(0.5, 1.5, size=(N,)).astype("float32")


def counter() -> tf.Variable:
    # Counts the steps the method really ran (once per step, whatever the replicas).
    return tf.Variable(0, dtype=tf.int64, trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def dense_io():
    inputs = keras.Input(shape=(D,))
    return inputs, keras.layers.Dense(1)(inputs)


class FirstExample(keras.Model):
    """The guide's first example: compute_loss and the compiled metrics, plus a counter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_calls = counter()
        # A Keras weight as counter: Keras' assign_add reads and writes it back.
        self.weight_calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                            aggregation="only_first_replica", name="weight_calls")

    def train_step(self, data):
        x, y = data
        self.weight_calls.assign_add(1.0)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.train_calls.assign_add(1)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LowerLevel(keras.Model):
    """The guide's "going lower-level": own trackers, no compiled loss; plus a constant
    penalty of 100 in the reported loss (not in the gradient), so it is visible."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss + 100.0)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class Weighted(keras.Model):
    """The guide's sample_weight example."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class OwnTest(keras.Model):
    """The guide's custom test_step (plus a counter and a visible offset of 1000)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.test_calls = counter()

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        self.test_calls.assign_add(1)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss + 1000.0)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnPredict(keras.Model):
    """A predict_step whose effect is visible in the rows: a second output, 2 * x[:, :1]."""

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return {"y": self(x, training=False), "twice": 2.0 * x[:, :1]}


class GAN(keras.Model):
    """The guide's GAN (two optimizers, two networks), on vectors instead of images."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def make(cls, **compile_kw):
    keras.utils.set_random_seed(1)
    inputs, outputs = dense_io()
    model = cls(inputs, outputs)
    model.compile(**{"optimizer": keras.optimizers.SGD(0.05), "loss": "mse", "metrics": ["mae"], **compile_kw})
    return model


class OwnLoss(FirstExample):
    """A step that reports its own loss beside the compiled metrics: Keras' History shows
    the step's loss + 100, and the compiled mae as read at the epoch's end."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.train_calls.assign_add(1)
        return {"compile_metrics": self.compute_metrics(x, y, y_pred), "loss": loss + 100.0}


def make_gan():
    keras.utils.set_random_seed(1)
    latent = 4
    disc = keras.Sequential([keras.Input((D,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    gen = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(D)])
    gan = GAN(disc, gen, latent)
    gan.compile(d_optimizer=keras.optimizers.Adam(0.003), g_optimizer=keras.optimizers.Adam(0.003),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def history(h):
    return {k: [float(v) for v in vs] for k, vs in h.history.items()}


def run() -> dict:
    strategy = keras_distrib.strategy()
    if os.environ.get("CUSTOM_STEPS_LOCAL_REPLICAS"):
        # One process, one input pipeline, several replicas (a node's GPUs, emulated):
        # MultiWorkerMirroredStrategy over logical CPUs (tests/local/test_padded_step.py).
        k = int(os.environ["CUSTOM_STEPS_LOCAL_REPLICAS"])
        strategy = tf.distribute.MultiWorkerMirroredStrategy._from_local_devices([f"/cpu:{i}" for i in range(k)])
    out = {}
    fit = dict(epochs=EPOCHS, batch_size=16, verbose=0)
    with strategy.scope():
        model = make(FirstExample)
    h = keras_distrib.fit(model, X, Y, **fit)
    out["first"] = {"history": history(h), "calls": int(model.train_calls.numpy()),
                    "weight_calls": int(model.weight_calls.numpy()),
                    "iterations": int(model.optimizer.iterations.numpy())}

    with strategy.scope():  # steps_per_epoch: repeated shards, exactly that many of the user's steps
        model = make(OwnLoss)
    h = keras_distrib.fit(model, X, Y, epochs=2, steps_per_epoch=5, batch_size=16, verbose=0)
    out["first_steps_per_epoch"] = {"calls": int(model.train_calls.numpy()), "epochs": len(h.history["loss"])}
    out["own_loss"] = {"history": history(h)}

    with strategy.scope():
        model = make(LowerLevel, loss=None, metrics=None)
    out["lower"] = {"history": history(keras_distrib.fit(model, X, Y, **fit))}

    with strategy.scope():
        model = make(Weighted, metrics=[keras.metrics.MeanAbsoluteError(name="mae")])
    out["weighted"] = {"history": history(keras_distrib.fit(model, X, Y, sample_weight=SW, **fit))}

    with strategy.scope():
        model = make(OwnTest)
    h = keras_distrib.fit(model, X, Y, validation_data=(X[:61], Y[:61]), **fit)
    ev = keras_distrib.evaluate(model, X, Y, batch_size=16)
    ev_dict = keras_distrib.evaluate(model, X, Y, batch_size=16, return_dict=True)
    out["own_test"] = {"history": history(h), "evaluate": [float(v) for v in ev],
                       "evaluate_dict": {k: float(v) for k, v in ev_dict.items()},
                       "test_calls": int(model.test_calls.numpy())}
    # Sizes whose shards need different numbers of batches (all-reduce then splits the
    # shorter shards' last batches): every example still evaluated once, by the user's step.
    exact = {}
    for n in (17, 32, 33):
        before = int(model.test_calls.numpy())
        _, mae = keras_distrib.evaluate(model, X[:n], Y[:n], batch_size=16)
        local = float(np.mean(np.abs(np.asarray(model(X[:n], training=False)) - Y[:n])))
        exact[str(n)] = {"steps": int(model.test_calls.numpy()) - before, "mae": float(mae), "local_mae": local}
    out["own_test"]["exact"] = exact

    with strategy.scope():
        model = make(OwnPredict)
    keras_distrib.fit(model, X, Y, **fit)
    pred = keras_distrib.predict(model, X[:37], batch_size=8)
    out["own_predict"] = {"y": np.asarray(pred["y"]).ravel().tolist(), "twice": np.asarray(pred["twice"]).ravel().tolist(),
                          "x0": X[:37, 0].tolist()}

    with strategy.scope():
        gan = make_gan()
    h = keras_distrib.fit(gan, X, epochs=3, batch_size=16, verbose=0)
    out["gan"] = {"history": history(h), "d_iterations": int(gan.d_optimizer.iterations.numpy()),
                  "g_iterations": int(gan.g_optimizer.iterations.numpy())}
    if os.environ.get("TF_CONFIG") or os.environ.get("CUSTOM_STEPS_LOCAL_REPLICAS"):
        out["refusals"] = refusals(strategy)
    return out


def refusals(strategy) -> dict:
    """What keras_distrib says to the modes and compile knobs it cannot honour (one line each)."""
    from keras_distrib.trainers import TrainerError, trainer_for

    out = {}
    tries = [("ps_local_steps", FirstExample, {}, {"ps_local_steps": True}),
             ("ps_stale_reads", FirstExample, {}, {"ps_stale_reads": True}),
             ("jit_compile", FirstExample, {"jit_compile": True}, {}),
             ("run_eagerly", FirstExample, {"run_eagerly": True}, {})]
    for name, cls, compile_kw, fit_kw in tries:
        with strategy.scope():
            model = make(cls, **compile_kw)
        try:
            keras_distrib.fit(model, X, Y, epochs=1, batch_size=16, verbose=0, **fit_kw)
            out[name] = "ran"
        except TrainerError as exc:
            out[name] = str(exc)
    with strategy.scope():
        model = make(FirstExample, steps_per_execution=4)
    keras_distrib.fit(model, X, Y, epochs=1, batch_size=16, verbose=0)
    out["compiled_steps_per_execution"] = trainer_for(model).steps_per_execution
    return out


if __name__ == "__main__":
    if os.environ.get("CUSTOM_STEPS_LOCAL_REPLICAS"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * int(os.environ["CUSTOM_STEPS_LOCAL_REPLICAS"]))
    print(json.dumps(run()), flush=True)
