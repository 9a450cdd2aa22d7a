"""The suite's sitecustomize (tests/fast_imports) keeps Keras' and TF's optional imports out
of the processes the tests start, and nobody else's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_IMPORTS

pytestmark = pytest.mark.local

PROBE = """
import json, sys
import tensorflow, keras
skipped = sorted(name for name in ("sklearn", "matplotlib", "jax", "scipy") if name in sys.modules)
from sklearn.datasets import load_digits  # a script's own import still works
import jax
print(json.dumps({"after_tf_and_keras": skipped, "sklearn": load_digits().data.shape[0],
                  "jax": jax.numpy.add(1, 2).item()}))
"""


def test_tf_and_keras_skip_their_optional_imports_and_a_script_still_gets_them() -> None:
    assert str(FAST_IMPORTS) in os.environ["PYTHONPATH"].split(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"after_tf_and_keras": [], "sklearn": 1797, "jax": 3}
