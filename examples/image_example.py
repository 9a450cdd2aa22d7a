"""Shared by mnist_distrib.py and cifar10_cnn_distrib.py: data, command line, training.

Uses ``keras.datasets.<name>`` when it is cached locally (~/.keras/datasets); without
network access the download fails and the script asks for ``--synthetic`` (random data
of the same shapes, for smoke tests and throughput numbers).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def load(name: str, input_shape: tuple[int, ...], synthetic: bool, n_synthetic: int = 6000) -> tuple[Any, Any, Any, Any]:
    """(x_train, y_train, x_test, y_test) scaled to [0, 1]; labels flattened to int32."""
    import numpy as np

    if synthetic:
        rng = np.random.default_rng(0)
        x = rng.random((n_synthetic, *input_shape), dtype=np.float32)
        y = rng.integers(0, 10, n_synthetic).astype("int32")
        cut = n_synthetic * 5 // 6
        return x[:cut], y[:cut], x[cut:], y[cut:]
    import keras

    try:
        (x_train, y_train), (x_test, y_test) = getattr(keras.datasets, name).load_data()
    except Exception as exc:  # no network and no cached copy
        raise SystemExit(f"{name} is not available locally ({exc}). HINT: pass --synthetic.") from None
    return (x_train / np.float32(255), y_train.reshape(-1).astype("int32"),
            x_test / np.float32(255), y_test.reshape(-1).astype("int32"))


def run(description: str, dataset: str, input_shape: tuple[int, ...], body: Callable[[], list[Any]],
        argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the common flags, train ``Input -> body() -> Dense(10)`` and print a JSON summary."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--synthetic", action="store_true", help="random data of the same shapes")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps-per-epoch", type=int, default=None)
    p.add_argument("--steps-per-execution", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None, help="resume from / save to, every epoch")
    p.add_argument("--save", default=None, help="write the model (.keras) from the chief")
    p.add_argument("--verbose", type=int, default=1)
    args = p.parse_args(argv)

    import keras_distrib
    from keras_distrib.trainers import placement, trainer_for

    strategy = keras_distrib.strategy()  # first: the all-reduce strategy must precede TF ops

    def make_model() -> Any:
        import keras

        model = keras.Sequential([keras.Input(input_shape), *body(), keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    x_train, y_train, x_test, y_test = load(dataset, input_shape, args.synthetic)
    model = placement.build(make_model, strategy)
    history = keras_distrib.fit(
        model, (x_train, y_train), epochs=args.epochs, batch_size=args.batch_size,
        steps_per_epoch=args.steps_per_epoch, validation_data=(x_test, y_test),
        steps_per_execution=args.steps_per_execution, verbose=args.verbose,
        checkpoint_dir=args.checkpoint_dir, strategy=strategy,
    )
    if args.save and getattr(trainer_for(model, strategy), "is_chief", True):
        model.save(args.save)
    result = {k: v[-1] for k, v in history.history.items()}
    stats = trainer_for(model, strategy).epoch_stats
    result["steps_per_sec"] = stats[-1]["steps_per_sec"] if stats else 0.0
    print(json.dumps(result), flush=True)
    return result
