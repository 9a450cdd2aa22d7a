"""The `keras_distrib.data` package: one protocol every source honours, `fit` turning the
input into a source once, a user's DatasetSource seed kept, no import back up."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keras_distrib import data as kd

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "keras_distrib" / "data"
PROTOCOL = ("num_examples", "batched", "shard", "epoch_elements", "finish_batches", "on_epoch_begin", "on_epoch_end")


def _ids(ds: Any) -> list[int]:
    """Every id in ``ds``'s elements (a batch, a tuple whose first part is the id, or an id)."""
    out: list[int] = []
    for e in ds:
        first = e[0] if isinstance(e, tuple) else e
        out += np.asarray(first).reshape(-1).astype(int).tolist()
    return out


def _write_files(directory: Path, n: int, files: int) -> list[str]:
    import tensorflow as tf

    paths = [str(directory / f"f{f}.tfrecord") for f in range(files)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    for i in range(n):
        writers[i % files].write(str(i).encode())
    for w in writers:
        w.close()
    return paths


class _Minimal:
    """A user source of earlier releases: only shard(), num_examples and batched."""

    batched = False

    def __init__(self, n: int) -> None:
        self.num_examples = n

    def shard(self, index: int, num_shards: int) -> Any:
        import tensorflow as tf

        return tf.data.Dataset.range(self.num_examples).shard(num_shards, index)


def _Batches(n: int) -> Any:
    """A Keras PyDataset of ids 0..n-1 in batches of 3 (the first batch holds 0, 1, 2)."""
    import keras

    class Batches(keras.utils.PyDataset):
        def __len__(self) -> int:
            return -(-n // 3)

        def __getitem__(self, b: int) -> Any:
            return np.arange(3 * b, min(n, 3 * b + 3))

    return Batches()


def _sources(tmp_path: Path, n: int) -> dict[str, Any]:
    import tensorflow as tf

    return {
        "arrays": kd.as_source((np.arange(n), np.arange(n) * 2)),
        "dataset": kd.as_source(tf.data.Dataset.range(n)),
        "files": kd.FileSource(_write_files(tmp_path, n, 4), num_examples=n,
                               parse=lambda r: tf.strings.to_number(r, tf.int64)),
        "self_loading": kd.self_loading(lambda rank, k: np.arange(n), seed=3),
        "custom": kd.as_source(_Minimal(n)),
        "pydataset": kd.as_source(_Batches(n)),
    }


@pytest.mark.parametrize("kind", ["arrays", "dataset", "files", "self_loading", "custom", "pydataset"])
@pytest.mark.parametrize("workers", [2, 3])
def test_every_source_honours_the_protocol(tmp_path: Path, kind: str, workers: int) -> None:
    """Same calls, same policy for every kind: each element once over the shards, in every
    epoch, shuffled or not, through the one `pipeline`."""
    n = 23
    src = _sources(tmp_path, n)[kind]
    assert all(hasattr(src, name) for name in PROTOCOL)
    for shuffle in (False, True):
        orders = []
        for epoch in range(2):
            seen = []
            for w in range(workers):
                mine = _ids(kd.pipeline(src, w, workers, batch_size=4, shuffle=shuffle, seed=1, repeat=False,
                                        epoch=epoch))
                if kind == "pydataset":  # batch b (ids 3b..3b+2) to worker b % k
                    assert sorted({i // 3 for i in mine}) == list(range(w, -(-n // 3), workers))
                elif kind != "self_loading":  # its slices are random by design, not strided
                    assert sorted(mine) == list(range(w, n, workers)) or kind == "files"
                seen += mine
            assert sorted(seen) == list(range(n))
            orders.append(seen)
        if shuffle and kind not in ("dataset",):  # a dataset keeps its own order (no shuffle in it)
            assert orders[0] != orders[1]


def test_the_pipeline_calls_only_the_protocol() -> None:
    """No source kind is special-cased by the pipeline (the protocol is the whole interface)."""
    text = (DATA / "input.py").read_text()
    body = text.split("def pipeline", 1)[1]
    assert "isinstance" not in body and "hasattr" not in body


def test_data_imports_nothing_above_it() -> None:
    """keras_distrib.data imports no trainer (the old data.py -> trainers/_private_apis)."""
    for path in DATA.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ("." * node.level) + (node.module or "")
                names = [base + ("." if node.module else "") + a.name for a in node.names]
                for name in names:  # from .. import contract: the launcher's contract, below data
                    assert not name.startswith("..trainers"), f"{path.name} imports {name}"
                    assert not name.startswith("..") or name == "..contract", f"{path.name} imports {name}"


def test_a_user_dataset_source_seed_is_kept() -> None:
    """DatasetSource(seed=5) draws the same order whatever fit's seed; without a seed, fit's."""
    import tensorflow as tf

    def order(src: Any, fit_seed: int | None) -> list[int]:
        return _ids(kd.pipeline(src, 0, 1, batch_size=None, shuffle=True, seed=fit_seed, repeat=False))

    ds = tf.data.Dataset.range(50).shuffle(50).batch(5)
    mine = kd.DatasetSource(ds, seed=5)
    assert order(mine, 0) == order(mine, 7) == order(mine, None)
    free = kd.DatasetSource(ds)
    assert order(free, 0) != order(free, 7)
    assert order(free, 5) == order(mine, 0) and mine.seed == 5


class _Stop(Exception):
    pass


def _fit_until_input(monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> tuple[list[Any], int]:
    """Run Trainer.fit up to the point where it asks for the inputs; (sources, as_source calls)."""
    from keras_distrib.trainers import base

    calls = {"n": 0}
    real = kd.as_source

    def counting(data: Any, what: str = "x") -> Any:
        calls["n"] += 1
        return real(data, what)

    monkeypatch.setattr(base.kd_data, "as_source", counting)
    seen: list[Any] = []

    class Fake(base.Trainer):
        def _input(self, source: Any, **options: Any) -> Any:
            seen.append(source)
            if len(seen) == (2 if kwargs.get("validation_split") or kwargs.get("validation_data") is not None else 1):
                raise _Stop
            return type("Inp", (), {"steps": 1, "sample": None})()

        def _ensure_metrics(self, inp: Any) -> None:
            pass

    trainer = object.__new__(Fake)
    trainer.custom_steps = frozenset()  # a plain Keras model: no step of its own
    with pytest.raises(_Stop):
        trainer.fit(*args, verbose=0, **kwargs)
    return seen, calls["n"]


def test_fit_turns_the_input_into_a_source_once(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = np.arange(20.0)[:, None], np.arange(20)
    seen, calls = _fit_until_input(monkeypatch, x, y, validation_split=0.25)
    assert calls == 1  # validation_split cuts the one ArraySource, no second as_source
    assert [s.num_examples for s in seen] == [15, 5]
    assert np.array_equal(seen[1].arrays[1], np.arange(15, 20))  # Keras: the last fraction
    seen, calls = _fit_until_input(monkeypatch, x, y)
    assert calls == 1 and seen[0].num_examples == 20


def test_fit_keeps_a_user_dataset_source_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf

    src = kd.DatasetSource(tf.data.Dataset.range(10).shuffle(10), seed=9)
    seen, _ = _fit_until_input(monkeypatch, src, seed=1)
    assert seen[0] is src and src.seed == 9


def test_validation_split_refused_for_a_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf

    from keras_distrib.trainers._common import TrainerError
    from keras_distrib.trainers.base import Trainer

    trainer = object.__new__(Trainer)
    with pytest.raises(TrainerError, match="validation_split=0.2 needs in-memory arrays.*HINT"):
        trainer.fit(tf.data.Dataset.range(10), validation_split=0.2, verbose=0)


def test_validation_split_of_x_alone_and_of_dicts() -> None:
    src = kd.as_source(({"a": np.arange(10), "b": np.arange(10) * 3}, np.arange(10)))
    first, second = src.split(8)
    assert first.num_examples == 8 and second.num_examples == 2
    assert second.arrays[0]["b"].tolist() == [24, 27]
    alone, rest = kd.as_source(np.arange(10)).split(7)
    assert alone.num_examples == 7 and rest.arrays.tolist() == [7, 8, 9]
