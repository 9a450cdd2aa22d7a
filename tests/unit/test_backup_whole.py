"""keras_distrib.backup_and_restore's chief replaces its backup files whole
(`_private_apis.save_backups_whole`): a process stopped while it saves leaves the last backup
readable, where Keras' in-place write left an h5 file no process could open."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.unit


def model():
    import keras

    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    m.compile("adam", "mse")
    m.optimizer.build(m.trainable_variables)
    return m


def test_a_save_stopped_midway_leaves_the_last_backup_whole(tmp_path: Path) -> None:
    import keras

    from keras_distrib import _private_apis

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    trained = model()
    backup.set_model(trained)
    _private_apis.save_backups_whole(backup)
    backup.on_epoch_end(0)  # a whole save: epoch 1 done
    saved = [np.array(v) for v in trained.get_weights()]

    def stopped_midway(filepath: str, **_: object) -> None:
        Path(filepath).write_bytes(b"\x89HDF\r\n\x1a\n torn")  # the start of an h5 file, then the process is gone
        raise KeyboardInterrupt

    trained.set_weights([w + 1 for w in saved])
    trained.save_weights = stopped_midway
    with pytest.raises(KeyboardInterrupt):
        backup.on_epoch_end(1)
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["epoch"] == 1
    fresh = model()
    again = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    again.set_model(fresh)
    again.on_train_begin()  # Keras' own restore reads the backup as left
    assert all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), saved))
    assert backup._weights_path == str(tmp_path / "backup" / "latest.weights.h5")  # its paths are back
