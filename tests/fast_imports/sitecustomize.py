"""Loaded by every Python process the suite starts (tests/conftest.py puts this folder first
on PYTHONPATH): the optional packages that TensorFlow and Keras import at start-up only for
features no test uses are reported absent to those importers.

``import tensorflow, keras`` loads scikit-learn (Keras' sklearn wrapper), matplotlib (Keras'
image gallery), jax (TF Lite's jax interop, Keras' orbax callback) and scipy (tf.keras v1's
sparse check) whenever they are installed, as they are in the [test] extra: about half of
the 6 CPU s that import costs on the CI machine. Each of those imports is guarded by
``except ImportError``. Anyone else's import (a test's ``from sklearn.datasets import
load_digits``, the jax backend's ``import jax``) is untouched, and a package once loaded is
loaded for every importer. The product's own servers do the same (``keras_distrib.servers``).
"""

from __future__ import annotations

import sys

# package -> the importers (module-name prefixes) that get ImportError for it
_SKIPPED_FOR = {
    "sklearn": ("keras.src.wrappers",),
    "matplotlib": ("keras.src.visualization",),
    "jax": ("tensorflow.lite", "keras.src.callbacks.orbax_checkpoint"),
    "scipy": ("tensorflow.python.keras",),
}


class _OptionalForLibraries:
    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        importers = _SKIPPED_FOR.get(name.partition(".")[0])
        if importers is None:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(importers):
            raise ModuleNotFoundError(f"{name}: not loaded for {importer} in the test suite", name=name)
        return None


sys.meta_path.insert(0, _OptionalForLibraries())
