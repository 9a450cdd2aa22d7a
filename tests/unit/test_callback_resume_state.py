"""Callbacks' best values survive a resume: recorded in meta.json, put back after on_train_begin."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from keras_distrib.checkpoints import CheckpointStore, Meta

pytestmark = pytest.mark.unit


def test_best_values_round_trip_through_meta_json(tmp_path: Path) -> None:
    import keras
    import numpy as np

    from keras_distrib.trainers.callbacks import callback_state, restore_callback_state

    def callbacks() -> list:
        return [keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), save_best_only=True),
                keras.callbacks.EarlyStopping(patience=5),
                keras.callbacks.ReduceLROnPlateau(patience=3)]

    first = callbacks()
    first[1].best = np.float32(0.25)
    first[2].best, first[2].wait, first[2].best_epoch = 0.5, 2, 3
    first[3].best, first[3].wait, first[3].cooldown_counter = 0.75, 1, 0
    store = CheckpointStore(tmp_path / "ckpt", writer=True)
    store.save(lambda prefix: Path(prefix + ".index").write_bytes(b""),
               Meta(40, 4, 0, 10, "allreduce", "abc-4w", 0.0, callbacks=callback_state(first)))
    saved = store.latest()[1].callbacks

    second = callbacks()
    for cb in second[2:]:
        cb.on_train_begin()  # what Keras resets at the start of every fit
    restore_callback_state(second, saved)
    assert second[1].best == pytest.approx(0.25)
    assert (second[2].best, second[2].wait, second[2].best_epoch) == (0.5, 2, 3)
    assert (second[3].best, second[3].wait, second[3].cooldown_counter) == (0.75, 1, 0)
    # A list changed since the save: only callbacks still in the same place and class are restored.
    moved = [keras.callbacks.EarlyStopping(patience=5)] + callbacks()[1:2]
    restore_callback_state(moved, saved)
    assert moved[0].wait == 0 and moved[1].best == pytest.approx(0.25)
    # Values not set yet (None) and infinities are recorded as they are.
    fresh = callbacks()
    fresh[2].best, fresh[3].best = None, float("inf")
    state = callback_state(fresh)
    assert state[1]["best"] is None and math.isinf(state[2]["best"])


def test_epoch_and_summary_lines() -> None:
    from keras_distrib.trainers.base import epoch_line, summary_line

    stats = [{"epoch": 1, "seconds": 2.0, "steps": 40, "steps_per_sec": 20.0, "worker_steps_per_sec": {0: 12.5, 1: 7.5}},
             {"epoch": 2, "seconds": 2.0, "steps": 40, "steps_per_sec": 20.0, "worker_steps_per_sec": {}}]
    assert epoch_line(stats[0], 5) == "epoch 2/5: 2.0 s, 20.0 steps/s (worker 0: 12.5, worker 1: 7.5 steps/s)"
    assert epoch_line(stats[1], 5) == "epoch 3/5: 2.0 s, 20.0 steps/s"  # lockstep all-reduce: one rate
    assert summary_line(stats, 4.25, "finished", "ckpt") == \
        "fit finished: trained epochs 2-3 (80 steps) in 4.2 s; checkpoints in ckpt."
    assert summary_line([], 0.5, "stopped early by a callback", None) == \
        "fit stopped early by a callback: trained no epoch in 0.5 s; no checkpoint_dir."


def test_an_unfinished_fit_says_where_a_rerun_resumes() -> None:
    """Interrupted after epoch 3's steps but before its checkpoint: "trained" counts them,
    the newest checkpoint (epoch 2's end) is where the rerun starts."""
    from keras_distrib.checkpoints import Meta
    from keras_distrib.trainers.base import summary_line

    stats = [{"epoch": e, "steps": 50} for e in range(3)]
    newest = Meta(step=100, epoch=2, step_in_epoch=0, steps_per_epoch=50, layout="ps-per-node", signature="s", saved_at=0.0)
    assert summary_line(stats, 7.06, "interrupted", "ckpt", newest) == (
        "fit interrupted: trained epochs 1-3 (150 steps) in 7.1 s; checkpoints in ckpt, the newest at "
        "step 100 (the end of epoch 2): a rerun resumes there.")
    mid = Meta(step=120, epoch=2, step_in_epoch=20, steps_per_epoch=50, layout="ps-per-node", signature="s", saved_at=0.0)
    assert "the newest at step 120 (epoch 3, 20 steps into it)" in summary_line(stats, 1, "stopped by an error", "ckpt", mid)
    assert summary_line(stats, 1, "interrupted", "ckpt", None).endswith("checkpoints in ckpt, none written yet: a rerun starts over.")
    # A finished fit needs no such note.
    assert summary_line(stats, 1, "finished", "ckpt", newest).endswith("checkpoints in ckpt.")


def test_csv_logger_continues_its_file_on_a_resume(tmp_path: Path) -> None:
    """Rows before the resumed epoch are kept (rows of epochs that run again are dropped),
    the logger appends for that fit only, and a file that is not a CSVLogger's is left alone."""
    import keras

    from keras_distrib.trainers.callbacks import continue_csv_logs

    log = tmp_path / "log.csv"
    log.write_bytes(b'epoch,loss,val_loss\r\n0,1.5,"1,6"\r\n1,1.25,1.3\r\n2,1.0,1.1\r\n')  # epoch 2 ran after the checkpoint
    cb = keras.callbacks.CSVLogger(str(log))
    assert continue_csv_logs([keras.callbacks.History(), cb], first_epoch=2) == [str(log)]
    assert log.read_bytes() == b'epoch,loss,val_loss\r\n0,1.5,"1,6"\r\n1,1.25,1.3\r\n'
    cb.on_train_begin()
    cb.on_epoch_end(2, {"loss": 0.75, "val_loss": 0.8})
    cb.on_train_end()
    assert log.read_text().splitlines() == ["epoch,loss,val_loss", '0,1.5,"1,6"', "1,1.25,1.3", "2,0.75,0.8"]
    assert cb.append is False  # the user's choice again for a later fit
    cb.on_train_begin()  # a later fit without a resume starts the file over, as in Keras
    cb.on_train_end()
    assert log.read_text() == ""

    other = tmp_path / "other.csv"
    other.write_text("a;b\n1;2\n")
    continue_csv_logs([keras.callbacks.CSVLogger(str(other), separator=";")], first_epoch=0)
    assert other.read_text() == "a;b\n1;2\n"
    continue_csv_logs([keras.callbacks.CSVLogger(str(tmp_path / "missing.csv"))], first_epoch=3)
    assert not (tmp_path / "missing.csv").exists()
