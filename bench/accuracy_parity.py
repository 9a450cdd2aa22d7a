"""Accuracy parity (issue 10 §6): keras_distrib.fit vs single-process model.fit.

Run as the SCRIPT of a job, once per layout and worker count, e.g.::

    python -m keras_distrib.local --nodes 2 bench/accuracy_parity.py
    python -m keras_distrib.local --nodes 3 --layout allreduce bench/accuracy_parity.py

For every model class (MLP; CNN with BatchNorm and Dropout; a functional model with two
named inputs; an LR schedule; an embedding model) and seed it trains the same model with
plain ``model.fit`` in this process (no strategy) and with ``keras_distrib.fit``, same
epochs and batch, on the digits data, and prints one JSON line per model with the mean
test accuracies over the seeds, their difference (points) and the 1-minute load average
(the machine may be shared). Rank 0 / the chief prints.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import numpy as np


def load() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    return train_test_split(x, d.target.astype("int32"), test_size=0.2, random_state=0)


def models(keras: Any, steps_per_epoch: int) -> dict[str, Callable[[], Any]]:
    def compile_(m: Any, lr: Any = 1e-3) -> Any:
        m.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    def mlp() -> Any:
        return compile_(keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                          keras.layers.Dense(10, activation="softmax")]))

    def cnn_bn() -> Any:
        return compile_(keras.Sequential([
            keras.Input((64,)), keras.layers.Reshape((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same"),
            keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dropout(0.2), keras.layers.Dense(10, activation="softmax")]))

    def two_inputs() -> Any:
        top, bottom = keras.Input((32,), name="top"), keras.Input((32,), name="bottom")
        h = keras.layers.Concatenate()([keras.layers.Dense(64, activation="relu")(top),
                                        keras.layers.Dense(64, activation="relu")(bottom)])
        return compile_(keras.Model({"top": top, "bottom": bottom}, keras.layers.Dense(10, activation="softmax")(h)))

    def lr_schedule() -> Any:
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
        return compile_(m, keras.optimizers.schedules.ExponentialDecay(3e-3, steps_per_epoch, 0.8))

    def embedding() -> Any:
        return compile_(keras.Sequential([
            keras.Input((64,), dtype="int32"), keras.layers.Embedding(17, 8),
            keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax")]))

    return {"mlp": mlp, "cnn_bn": cnn_bn, "two_inputs": two_inputs, "lr_schedule": lr_schedule,
            "embedding": embedding}


def inputs_for(name: str, x: np.ndarray) -> Any:
    if name == "two_inputs":
        return {"top": x[:, :32], "bottom": x[:, 32:]}
    if name == "embedding":
        return np.round(x * 16).astype("int32")
    return x


def recalibrated_accuracy(keras: Any, build: Callable[[], Any], model: Any, x_train: Any, x_test: Any,
                          y_test: np.ndarray, batch: int) -> float | None:
    """Test accuracy of ``model``'s weights after BatchNorm's moving statistics are recomputed.

    A diagnostic for asynchronous training: the weights are copied into a plain model, its
    BatchNorm layers' moving mean/variance are rebuilt from one pass over the training data
    with those final weights (momentum 0.9), then it is evaluated. None without BatchNorm.
    """
    plain = build()
    plain.set_weights(model.get_weights())
    norms = [layer for layer in plain.layers if isinstance(layer, keras.layers.BatchNormalization)]
    if not norms:
        return None
    for layer in norms:
        layer.momentum = 0.9
    n = len(next(iter(x_train.values()))) if isinstance(x_train, dict) else len(x_train)
    for start in range(0, n, batch):
        part = {k: v[start:start + batch] for k, v in x_train.items()} if isinstance(x_train, dict) else x_train[start:start + batch]
        plain(part, training=True)
    return float(plain.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="mlp,cnn_bn,two_inputs,lr_schedule,embedding")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps-per-execution", type=int, default=None, help="K of the trainer (default: its own)")
    p.add_argument("--recalibrate", action="store_true",
                   help="also report the accuracy after BatchNorm statistics are recomputed (a diagnostic)")
    p.add_argument("--ps-stale-reads", action="store_true",
                   help="also train with keras_distrib.fit(..., ps_stale_reads=True) (parameter server; "
                        "reported as stale_reads and stale_diff_points)")
    p.add_argument("--ps-local-steps", action="store_true",
                   help="also train with keras_distrib.fit(..., ps_local_steps=True) (parameter server; "
                        "reported as local_steps and local_diff_points)")
    args = p.parse_args(argv)

    import keras

    import keras_distrib
    from keras_distrib.trainers import placement, trainer_for

    strategy = keras_distrib.strategy()  # first: the all-reduce strategy must precede TF ops
    x_train, x_test, y_train, y_test = load()
    builders = models(keras, int(np.ceil(len(x_train) / args.batch)))
    for name in args.models.split(","):
        single, dist, recalibrated = [], [], []
        opted_runs: dict[str, list[float]] = {"stale_reads": [], "local_steps": []}
        for seed in range(args.seeds):
            xtr, xte = inputs_for(name, x_train), inputs_for(name, x_test)
            keras.utils.set_random_seed(seed)
            plain = builders[name]()
            plain.fit(xtr, y_train, epochs=args.epochs, batch_size=args.batch, verbose=0)
            single.append(float(plain.evaluate(xte, y_test, verbose=0, return_dict=True)["accuracy"]))
            keras.utils.set_random_seed(seed)
            model = placement.build(builders[name], strategy)
            keras_distrib.fit(model, xtr, y_train, epochs=args.epochs, batch_size=args.batch, verbose=0,
                              seed=seed, strategy=strategy, steps_per_execution=args.steps_per_execution)
            dist.append(float(keras_distrib.evaluate(model, xte, y_test, strategy=strategy, return_dict=True)["accuracy"]))
            if args.recalibrate:
                recalibrated.append(recalibrated_accuracy(keras, builders[name], model, xtr, xte, y_test, args.batch))
            for mode, wanted in (("stale_reads", args.ps_stale_reads), ("local_steps", args.ps_local_steps)):
                if not wanted:
                    continue
                keras.utils.set_random_seed(seed)
                opted = placement.build(builders[name], strategy)
                keras_distrib.fit(opted, xtr, y_train, epochs=args.epochs, batch_size=args.batch, verbose=0,
                                  seed=seed, strategy=strategy, steps_per_execution=args.steps_per_execution,
                                  **{f"ps_{mode}": True})
                opted_runs[mode].append(float(keras_distrib.evaluate(opted, xte, y_test, strategy=strategy,
                                                                          return_dict=True)["accuracy"]))
        if getattr(trainer_for(model, strategy), "is_chief", True):
            print(json.dumps({"model": name, "layout": keras_distrib.cluster().layout,
                              "workers": keras_distrib.cluster().num_workers, "single": single, "distributed": dist,
                              "diff_points": round(100 * (np.mean(dist) - np.mean(single)), 2),
                              **({"recalibrated": recalibrated} if args.recalibrate else {}),
                              "steps_per_execution": trainer_for(model, strategy).steps_per_execution,
                              **{key: value for mode, runs in opted_runs.items() if runs
                                 for key, value in ((mode, runs), (f"{mode.split('_')[0]}_diff_points",
                                                                   round(100 * (np.mean(runs) - np.mean(single)), 2)))},
                              "load_1min": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
