"""All-reduce input iterators are freed without a wait (trainers/allreduce_input.py
`without_autotune_thread`, `EpochInput.close`; trainers/base.py `Trainer._release`).

An iterator left to Python's collector was freed at the process's exit, and freeing it waited
for its tf.data autotuning thread, which sleeps up to a minute between rounds: a job stayed
RUNNING up to 75 s after its result line (chaos seeds allreduce 8170922, 4493371, 7981503).
Here: each worker's dataset runs without autotuning (unless its options set it), the held
iterators are gone after `close`, and `fit` calls `_release` on its training input once the
epochs are done (not when they fail)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("tensorflow")

from keras_distrib import data as kd_data  # noqa: E402
from keras_distrib.trainers.allreduce_input import EpochInput  # noqa: E402
from keras_distrib.trainers.base import Trainer  # noqa: E402


class Iterator:
    """Stands for a distributed iterator (weakly referable, so the test sees it freed)."""

    def __next__(self) -> Any:
        raise StopIteration


class FakeStrategy:
    def __init__(self, replicas: int) -> None:
        self.num_replicas_in_sync = replicas
        self.made: list[weakref.ref[Iterator]] = []

    def distribute_datasets_from_function(self, make: Any) -> Any:
        strategy = self
        self.make = make

        class Distributed:
            def __iter__(self) -> Iterator:
                it = Iterator()
                strategy.made.append(weakref.ref(it))
                return it

        return Distributed()


@pytest.mark.parametrize("repeat", [False, True], ids=["stream", "repeated"])
@pytest.mark.parametrize("workers", [2, 3])
def test_close_lets_go_of_every_iterator_the_input_held(repeat: bool, workers: int) -> None:
    strategy = FakeStrategy(workers)
    source = kd_data.ArraySource((np.zeros((449, 2), "float32"), np.zeros(449)))
    inp = EpochInput(strategy, source, per_replica=10, shuffle=False, seed=None, repeat=repeat, pipelines=workers)
    if not repeat:
        assert inp.counts is not None  # the known-size path: one stream over every epoch
    held = inp.iterator(0, 4 if not repeat else None)
    assert inp.iterator(1, 4 if not repeat else None) is held  # kept between epochs
    del held
    gc.collect()
    assert strategy.made and strategy.made[-1]() is not None  # the input holds it
    inp.close()
    assert all(ref() is None for ref in strategy.made), "an iterator outlived close()"
    assert inp.iterator(2, 4 if not repeat else None) is not None  # a later epoch makes a fresh one


class Context:
    input_pipeline_id, num_input_pipelines = 1, 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "per-epoch"])
@pytest.mark.parametrize("user", [None, True, False], ids=["unset", "user-on", "user-off"])
def test_each_workers_dataset_runs_without_autotuning_unless_its_options_say(stream: bool, user: bool | None) -> None:
    """Freeing an autotuned iterator waits for its autotuning thread (up to a minute)."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((np.zeros((449, 2), "float32"), np.zeros(449)))
    if user is not None:
        options = tf.data.Options()
        options.autotune.enabled = user
        ds = ds.with_options(options)
    strategy = FakeStrategy(2)
    inp = EpochInput(strategy, kd_data.DatasetSource(ds), per_replica=10, shuffle=False, seed=None, repeat=False,
                     pipelines=2)
    inp.iterator(0, 3 if stream else None)
    made = strategy.make(Context())
    assert made.options().autotune.enabled is (False if user is None else user)
    next(iter(made))  # still a working pipeline


class Input:
    steps = 3


class RecordingTrainer(Trainer):
    """Trainer.fit with every step stubbed: what it calls, in order."""

    def __init__(self, fails: bool) -> None:  # no model: fit's bookkeeping only
        self.calls: list[str] = []
        self.fails = fails
        self.epoch_stats = []
        self.is_chief = True
        self.model = type("Model", (), {"stop_training": False})()

    def _prepare(self, *args: Any, **kwargs: Any) -> Any:
        return Input()

    def _epoch_loop(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("epochs")
        if self.fails:
            raise RuntimeError("a peer failed")
        return "history"

    def _release(self, inp: Any) -> None:
        self.calls.append(f"release {type(inp).__name__}")


@pytest.mark.parametrize("fails", [False, True], ids=["done", "failed"])
def test_fit_releases_its_input_once_the_epochs_are_done(fails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from keras_distrib.trainers import callbacks as cb_utils

    monkeypatch.setattr(cb_utils, "callback_list", lambda *args, **kwargs: None)
    trainer = RecordingTrainer(fails)
    x, y = np.zeros((9, 2), "float32"), np.zeros(9, "float32")
    if fails:
        # A failed fit leaves it to the exit: freeing now could wait as long for the failed peer.
        with pytest.raises(RuntimeError):
            trainer.fit(x, y, epochs=2, verbose=0)
        assert trainer.calls == ["epochs"]
    else:
        assert trainer.fit(x, y, epochs=2, verbose=0) == "history"
        assert trainer.calls == ["epochs", "release Input"]
