"""Keras' own input kinds in `keras_distrib.data`: a PyDataset sharded by batch index, and
every kind no layout takes refused in one line with a HINT (issue 29 section 3)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from keras_distrib import data as kd

pytestmark = pytest.mark.unit


def _py_dataset(n: int, batch: int, **kwargs: Any) -> Any:
    import keras

    class Ids(keras.utils.PyDataset):
        """Examples 0..n-1 as (x, y) batches; x = [id, 2 id], y = id; records each read."""

        def __init__(self) -> None:
            super().__init__(**kwargs)
            self.reads: list[int] = []
            self.epochs: list[str] = []

        def __len__(self) -> int:
            return -(-n // batch)

        def __getitem__(self, b: int) -> Any:
            self.reads.append(b)
            ids = np.arange(b * batch, min(n, (b + 1) * batch))
            return np.stack([ids, 2 * ids], 1).astype("float32"), ids.astype("float32")

        def on_epoch_begin(self) -> None:
            self.epochs.append("begin")

        def on_epoch_end(self) -> None:
            self.epochs.append("end")

    return Ids()


def _read(src: Any, worker: int, workers: int, **options: Any) -> list[list[int]]:
    ds = kd.pipeline(src, worker, workers, batch_size=None, repeat=False, **{"shuffle": False, "seed": 0, **options})
    return [y.numpy().astype(int).tolist() for _, y in ds]


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("n,batch", [(100, 7), (31, 10), (64, 32)])
@pytest.mark.parametrize("pool", ["inline", "threads"])
def test_py_dataset_sharded_by_batch_index(workers: int, n: int, batch: int, pool: str) -> None:
    """Batch b to worker b % k: every example once, whole batches, none empty, in every
    epoch, shuffled or not; each worker reads only its own batches."""
    data = _py_dataset(n, batch, **({"workers": 2} if pool == "threads" else {}))
    src = kd.as_source(data)
    assert isinstance(src, kd.PyDatasetSource) and src.batched and src.num_examples == -(-n // batch)
    assert src.element_spec[0].shape.as_list() == [None, 2]  # read once, from the first batches
    for shuffle in (False, True):
        orders = []
        for epoch in range(2):
            seen: list[int] = []
            for w in range(workers):
                data.reads.clear()
                batches = _read(src, w, workers, shuffle=shuffle, seed=4, epoch=epoch)
                assert sorted(set(data.reads)) == list(range(w, src.num_examples, workers))
                assert all(batches) and len(batches) == len(range(w, src.num_examples, workers))
                if not shuffle:
                    assert [b[0] // batch for b in batches] == list(range(w, src.num_examples, workers))
                seen += [i for b in batches for i in b]
            assert sorted(seen) == list(range(n))
            orders.append(seen)
        if shuffle and src.num_examples >= 2 * workers:
            assert orders[0] != orders[1]  # a new order each epoch


def test_py_dataset_multiprocessing_runs_as_threads_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """use_multiprocessing would fork a process running TensorFlow's distributed runtime
    (it deadlocked in all-reduce): the batches are read by threads, and a warning says so."""
    import os
    import threading

    import keras

    class Readers(keras.utils.PyDataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, b: int) -> Any:
            return np.full((2, 1), os.getpid(), "float32"), np.full((2,), threading.get_ident() % 1000, "float32")

    with caplog.at_level("WARNING", logger="keras_distrib.data.pydataset"):
        src = kd.as_source(Readers(workers=2, use_multiprocessing=True))
    assert "use_multiprocessing=True" in caplog.text and "2 threads" in caplog.text and "HINT:" in caplog.text
    got = list(kd.pipeline(src, 1, 2, batch_size=None, shuffle=False, seed=0, repeat=False))
    assert len(got) == 3 and {int(x[0, 0]) for x, _ in got} == {os.getpid()}


def test_py_dataset_repeated_and_endless() -> None:
    """Repeated (fit with steps_per_epoch): each pass a permutation of the shard; an endless
    PyDataset (num_batches None) keeps dealing batch b to worker b % k."""
    import keras

    data = _py_dataset(40, 10)
    src = kd.as_source(data)
    ds = kd.pipeline(src, 0, 2, batch_size=None, shuffle=True, seed=0, repeat=True)
    firsts = [int(y.numpy()[0]) for _, y in ds.take(6)]
    assert sorted(firsts[:2]) == sorted(firsts[2:4]) == sorted(firsts[4:]) == [0, 20]

    class Endless(keras.utils.PyDataset):
        @property
        def num_batches(self) -> None:
            return None

        def __getitem__(self, b: int) -> Any:
            return np.zeros((3, 1), "float32"), np.full((3,), b, "float32")

    endless = kd.as_source(Endless())
    assert endless.num_examples is None
    got = [int(y[0]) for _, y in kd.pipeline(endless, 1, 3, batch_size=None, shuffle=False, seed=0, repeat=False).take(4)]
    assert got == [1, 4, 7, 10]


def test_py_dataset_batch_forms_and_epoch_hooks() -> None:
    """x alone, (x,), (x, y, sample_weight) and dicts, as Keras reads them; the hooks run."""
    import keras

    class Forms(keras.utils.PyDataset):
        def __init__(self, form: str) -> None:
            super().__init__()
            self.form = form

        def __len__(self) -> int:
            return 3

        def __getitem__(self, b: int) -> Any:
            x = np.full((2, 3), b, "float32")
            return {"x": x, "(x,)": (x,), "(x,y,sw)": (x, x[:, 0], np.ones(2, "float32")),
                    "dict": {"a": x}}[self.form]

    for form, check in [("x", lambda e: e.shape == (2, 3)), ("(x,)", lambda e: e.shape == (2, 3)),
                        ("(x,y,sw)", lambda e: len(e) == 3), ("dict", lambda e: set(e) == {"a"})]:
        first = next(iter(kd.pipeline(kd.as_source(Forms(form)), 0, 1, batch_size=None, shuffle=False, seed=0,
                                      repeat=False)))
        assert check(first), form
    data = _py_dataset(10, 5)
    src = kd.as_source(data)
    src.on_epoch_begin(0)
    src.on_epoch_end(0)
    assert data.epochs == ["begin", "end"]


def _refused(data: Any, *parts: str) -> None:
    with pytest.raises(kd.InputError) as info:
        kd.as_source(data)
    message = str(info.value)
    assert "\n" not in message and "HINT:" in message, message
    for part in parts:
        assert part in message, message


def test_generators_and_iterators_are_refused_with_the_alternatives() -> None:
    _refused((b for b in range(3)), "x is a Python generator", "PyDataset", "from_generator", "arrays")
    _refused(iter([np.zeros(3)]), "x is a Python list_iterator", "PyDataset")


def test_other_kinds_refused_in_one_line() -> None:
    import tensorflow as tf

    _refused((tf.data.Dataset.range(3), np.arange(3)), "y or sample_weight were given too")
    _refused((_py_dataset(10, 5), np.arange(10)), "keras.utils.PyDataset and y")
    _refused(None, "x is None")
    _refused((np.zeros((4, 2)), 3), "single int")
    _refused((np.zeros((4, 2)), np.zeros(5)), "different lengths")
    _refused(object(), "builtins.object")
    _refused((np.zeros((4, 2)), (b for b in range(3))), "nests a generator")
    _refused(type("Empty", (__import__("keras").utils.PyDataset,), {"__len__": lambda self: 0})(), "0 batches")


def test_array_like_inputs_are_taken() -> None:
    """Lists and dicts of arrays, tensors and anything with __array__ (pandas, jax, torch)."""
    import tensorflow as tf

    class ArrayLike:
        def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
            return np.arange(6.0).reshape(3, 2)

        def __len__(self) -> int:
            return 3

    assert kd.as_source([np.zeros((5, 1)), np.ones((5, 2))]).num_examples == 5
    assert kd.as_source(({"a": tf.zeros((4, 2))}, np.arange(4))).num_examples == 4
    src = kd.as_source((ArrayLike(), np.arange(3)))
    assert isinstance(src.arrays[0], np.ndarray) and src.num_examples == 3


@pytest.mark.parametrize("case", ["generator", "generator_validation", "dataset_with_y", "pydataset_validation_split",
                                  "pydataset_class_weight"])
def test_fit_refuses_before_training_in_one_line(case: str) -> None:
    """Trainer.fit stops with a TrainerError or kd.InputError (a ValueError, as Keras raises for
    bad inputs): one line with a HINT, before it builds any input."""
    from keras_distrib.trainers._common import TrainerError
    from keras_distrib.trainers.base import Trainer

    class NoInput(Trainer):
        def _input(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("an input was built before the refusal")

    x, y = np.zeros((10, 2), "float32"), np.zeros(10, "float32")
    gen = ((x[:2], y[:2]) for _ in range(5))
    call = {
        "generator": lambda t: t.fit(gen, steps_per_epoch=5, verbose=0),
        "generator_validation": lambda t: t.fit(x, y, validation_data=gen, verbose=0),
        "dataset_with_y": lambda t: t.fit(__import__("tensorflow").data.Dataset.range(3), y, verbose=0),
        "pydataset_validation_split": lambda t: t.fit(_py_dataset(10, 5), validation_split=0.2, verbose=0),
        "pydataset_class_weight": lambda t: t.fit(_py_dataset(10, 5), class_weight={0: 1.0}, verbose=0),
    }[case]
    with pytest.raises((TrainerError, kd.InputError)) as info:
        call(object.__new__(NoInput))
    message = str(info.value)
    assert "\n" not in message and "HINT:" in message, message
    if case.startswith("generator"):  # names the argument
        assert message.startswith("validation_data is" if case == "generator_validation" else "x is"), message
