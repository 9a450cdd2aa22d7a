"""CIFAR-10 small CNN with keras_distrib (any layout).

    python -m keras_distrib.local --nodes 2 examples/mnist_distrib.py [--synthetic]

Uses ``keras.datasets.cifar10`` when it is cached locally (~/.keras/datasets); without
network access the download fails and the script asks for ``--synthetic`` (random data
of the same shapes, for smoke tests and throughput numbers).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def load(synthetic: bool, n_synthetic: int = 6000) -> tuple[Any, Any, Any, Any]:
    import numpy as np

    if synthetic:
        rng = np.random.default_rng(0)
        x = rng.random((n_synthetic, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, n_synthetic).astype("int32")
        cut = n_synthetic * 5 // 6
        return x[:cut], y[:cut], x[cut:], y[cut:]
    import keras

    try:
        (x_train, y_train), (x_test, y_test) = keras.datasets.cifar10.load_data()
    except Exception as exc:  # no network: keras raises various errors from urllib
        raise SystemExit(f"CIFAR-10 is not available locally ({exc}). HINT: pass --synthetic.") from None
    return (x_train / np.float32(255), y_train.reshape(-1).astype("int32"),
            x_test / np.float32(255), y_test.reshape(-1).astype("int32"))


def make_model() -> Any:
    import keras

    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="CIFAR-10 small CNN with keras_distrib")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps-per-epoch", type=int, default=None)
    p.add_argument("--steps-per-execution", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save", default=None, help="write the model (.keras) from the chief")
    p.add_argument("--verbose", type=int, default=1)
    args = p.parse_args(argv)

    import keras_distrib
    from keras_distrib.trainers import placement, trainer_for

    x_train, y_train, x_test, y_test = load(args.synthetic)
    strategy = keras_distrib.strategy()
    model = placement.build(make_model, strategy)
    history = keras_distrib.fit(
        model, (x_train, y_train), epochs=args.epochs, batch_size=args.batch_size,
        steps_per_epoch=args.steps_per_epoch, validation_data=(x_test, y_test),
        steps_per_execution=args.steps_per_execution, verbose=args.verbose,
        checkpoint_dir=args.checkpoint_dir, strategy=strategy,
    )
    trainer = trainer_for(model, strategy)
    if args.save and getattr(trainer, "is_chief", True):
        model.save(args.save)
    result = {k: v[-1] for k, v in history.history.items()}
    result["steps_per_sec"] = getattr(model, "_keras_distrib_steps_per_sec", 0.0)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
