"""The legacy path: a tf_keras model trained with plain ``model.fit`` under keras_distrib.

    pip install -e ".[legacy]"
    TF_USE_LEGACY_KERAS=1 python -m keras_distrib.local --nodes 2 examples/legacy_tf_keras.py
    TF_USE_LEGACY_KERAS=1 python -m keras_distrib.local --nodes 2 --layout allreduce examples/legacy_tf_keras.py

tf_keras (Keras 2) still supports ParameterServerStrategy and MultiWorkerMirroredStrategy in
``model.fit``; keras_distrib only provides the processes and the strategy. Note that under
ParameterServerStrategy every worker reads the same dataset stream and batch-level
callbacks are refused (tf_keras' rules); for disjoint shards use the Keras 3 trainer.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import tensorflow as tf
import tf_keras

import keras_distrib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    args = p.parse_args()
    # First, before any TensorFlow op: MultiWorkerMirroredStrategy must configure the runtime.
    strategy = keras_distrib.strategy()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).repeat().batch(64)

    with strategy.scope():
        model = tf_keras.Sequential([
            tf_keras.layers.Dense(32, activation="relu", input_shape=(16,)),
            tf_keras.layers.Dense(2, activation="softmax"),
        ])
        model.compile(tf_keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=2)
    if keras_distrib.cluster().is_chief:
        print(json.dumps({"strategy": type(strategy).__name__,
                          "accuracy": [float(a) for a in history.history["accuracy"]]}), flush=True)


if __name__ == "__main__":
    main()
