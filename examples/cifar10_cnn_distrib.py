"""CIFAR-10 small CNN with keras_distrib (any layout).

    python -m keras_distrib.local --nodes 2 examples/cifar10_cnn_distrib.py [--synthetic]

Uses ``keras.datasets.cifar10`` when cached locally, else needs ``--synthetic``.
"""

from __future__ import annotations

from typing import Any

from image_example import run


def body() -> list[Any]:
    import keras

    return [
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
    ]


if __name__ == "__main__":
    run("CIFAR-10 small CNN with keras_distrib", "cifar10", (32, 32, 3), body)
