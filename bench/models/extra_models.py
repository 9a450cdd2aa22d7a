"""Two more models for the training benchmarks, beyond the built-in mlp and cnn.

    python bench/ps_throughput.py --models bench/models/extra_models.py:bn_cnn,bench/models/extra_models.py:wide_mlp

Any file works the same way: ``fn(keras)`` builds an uncompiled model ending in logits with
the Keras module it is given (Keras 3 or tf_keras), so every side trains the same model.
"""

from __future__ import annotations

from typing import Any


def bn_cnn(keras: Any) -> Any:
    """32x32x3 conv net with BatchNorm and dropout (compute-bound on a CPU)."""
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(10),
    ])


def wide_mlp(keras: Any) -> Any:
    """100 features -> 512 -> 512 -> 512 -> 20 logits (about 580k parameters), functional API."""
    inputs = keras.Input((100,))
    h = keras.layers.Dense(512, activation="relu")(inputs)
    h = keras.layers.Dense(512, activation="relu")(h)
    h = keras.layers.Dense(512, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(20)(h))


def text_bag(keras: Any) -> Any:
    """32 token ids -> Embedding(5000, 32) -> mean -> 64 -> 10 logits (sparse gradients)."""
    return keras.Sequential([
        keras.Input((32,), dtype="int32"),
        keras.layers.Embedding(5000, 32),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
