"""MNIST MLP with keras_distrib (any layout).

    python -m keras_distrib.local --nodes 2 examples/mnist_distrib.py [--synthetic]

Uses ``keras.datasets.mnist`` when cached locally, else needs ``--synthetic``.
"""

from __future__ import annotations

from typing import Any

from image_example import run


def body() -> list[Any]:
    import keras

    return [keras.layers.Flatten(), keras.layers.Dense(256, activation="relu")]


if __name__ == "__main__":
    run("MNIST MLP with keras_distrib", "mnist", (28, 28), body)
