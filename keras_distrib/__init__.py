"""keras-distrib: distributed Keras/TensorFlow training on HPC clusters.

Importing this package is cheap and TensorFlow-free; the TensorFlow-backed helpers
(``strategy``, ``fit``, ``predict``, ``data``) import it on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "cluster": ("keras_distrib.strategies", "cluster"),
    "strategy": ("keras_distrib.strategies", "strategy"),
    "distribution": ("keras_distrib.jax_distribution", "distribution"),
    "chief_path": ("keras_distrib.jax_distribution", "chief_path"),
    "backup_and_restore": ("keras_distrib.jax_distribution", "backup_and_restore"),
    "fit": ("keras_distrib.trainers", "fit"),
    "evaluate": ("keras_distrib.trainers", "evaluate"),
    "predict": ("keras_distrib.trainers", "predict"),
    "once": ("keras_distrib.coordination", "once"),
    "OnceError": ("keras_distrib.coordination", "OnceError"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name == "data":
        import importlib

        return importlib.import_module("keras_distrib.data")
    raise AttributeError(f"module 'keras_distrib' has no attribute {name!r}")


__all__ = ["__version__", "cluster", "strategy", "distribution", "chief_path", "backup_and_restore", "fit", "evaluate", "predict", "data", "once", "OnceError"]
