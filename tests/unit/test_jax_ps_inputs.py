"""The JAX ps trainer's readers of numbered batches (trainers/jax_ps/inputs.py): the same batches
under the same numbers in every reader, whatever order parts are read in, for every input kind."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the [jax] extra is not installed")

from keras_distrib import data as kd_data  # noqa: E402
from keras_distrib.trainers._common import TrainerError  # noqa: E402
from keras_distrib.trainers.jax_ps.inputs import batch_rows, epoch_input  # noqa: E402

pytestmark = pytest.mark.unit

ROWS = 103


def arrays():
    x = np.arange(ROWS * 2, dtype="float32").reshape(ROWS, 2)
    return x, np.arange(ROWS, dtype="float32")


def kinds():
    import keras
    import tensorflow as tf

    x, y = arrays()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-ROWS // 10)

        def __getitem__(self, i):
            return x[i * 10:(i + 1) * 10], y[i * 10:(i + 1) * 10]

    elements = tf.data.Dataset.from_tensor_slices((x, y))
    return {
        "arrays": lambda: kd_data.as_source((x, y)),
        "dataset": lambda: kd_data.as_source(elements.shuffle(50, seed=2)),
        "batched": lambda: kd_data.as_source(elements.shuffle(50).batch(10)),
        "unknown": lambda: kd_data.as_source(elements.filter(lambda a, b: True).batch(7)),
        "pydataset": lambda: kd_data.as_source(Batches()),
    }


def ids(batches) -> list[float]:
    return [float(v) for b in batches for v in np.asarray(b[1]).ravel()]


@pytest.mark.parametrize("kind", ["arrays", "dataset", "batched", "unknown", "pydataset"])
def test_parts_read_in_any_order_by_two_readers_are_every_example_once(kind: str) -> None:
    make = kinds()[kind]
    first, second = epoch_input(make(), 10, shuffle=True), epoch_input(make(), 10, shuffle=True)
    n = first.num_batches
    assert n == second.num_batches and n > 3
    parts = [(b, min(2, n - b)) for b in range(0, n, 2)]
    # Reader one takes the even parts in order, reader two the odd ones, then a part again (a
    # dead worker's, handed out once more) that lies before its place in the stream.
    seen = [ids(first.batches(1, 5, b, c)) for i, (b, c) in enumerate(parts) if i % 2 == 0]
    seen += [ids(second.batches(1, 5, b, c)) for i, (b, c) in enumerate(parts) if i % 2 == 1]
    assert sorted(sum(seen, [])) == list(map(float, range(ROWS)))
    assert ids(second.batches(1, 5, *parts[0])) == seen[0]
    assert sum(batch_rows(b) for b in first.batches(1, 5, 0, n)) == ROWS


@pytest.mark.parametrize("kind", ["arrays", "dataset", "pydataset"])
def test_an_epoch_order_depends_on_the_epoch_and_seed_and_shuffle(kind: str) -> None:
    make = kinds()[kind]
    reader = epoch_input(make(), 10, shuffle=True)
    n = reader.num_batches
    assert ids(reader.batches(0, 5, 0, n)) != ids(reader.batches(1, 5, 0, n))
    plain = epoch_input(make(), 10, shuffle=False)
    if kind == "dataset":  # its own shuffle decides, re-seeded per epoch whatever fit's shuffle
        assert ids(plain.batches(0, 5, 0, n)) != ids(plain.batches(1, 5, 0, n))
    else:
        assert ids(plain.batches(0, 5, 0, n)) == ids(plain.batches(1, 6, 0, n)) == list(map(float, range(ROWS)))


def test_an_endless_input_is_refused_with_a_hint() -> None:
    import tensorflow as tf

    x, y = arrays()
    with pytest.raises(TrainerError, match="no end.*steps_per_epoch is not given. HINT"):
        epoch_input(kd_data.as_source(tf.data.Dataset.from_tensor_slices((x, y)).repeat()), 10, shuffle=True)


@pytest.mark.parametrize("kind", ["arrays", "batched", "pydataset"])
def test_steps_per_epoch_reads_the_data_repeated_pass_after_pass(kind: str) -> None:
    """7 batches an epoch of 11 a pass: the epochs, end to end, are the passes end to end, and
    the batches under a number are the same in two readers however the parts are read."""
    make = kinds()[kind]
    first, second = epoch_input(make(), 10, True, steps_per_epoch=7), epoch_input(make(), 10, True, steps_per_epoch=7)
    plain = epoch_input(make(), 10, True)
    assert first.num_batches == 7 and first.rows is None and plain.num_batches == 11
    epochs = sum((ids(first.batches(e, 3, 0, 7)) for e in range(4)), [])  # 28 batches: 2 passes and 6 batches
    passes = sum((ids(plain.batches(p, 3, 0, 11)) for p in range(3)), [])
    assert epochs == passes[:len(epochs)]
    assert ids(second.batches(2, 3, 4, 3)) + ids(second.batches(2, 3, 0, 4)) == \
        ids(first.batches(2, 3, 4, 3)) + ids(first.batches(2, 3, 0, 4))


def test_an_endless_dataset_with_steps_per_epoch_is_read_on() -> None:
    import tensorflow as tf

    x, y = arrays()
    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).repeat()
    reader = epoch_input(kd_data.as_source(endless), None, True, steps_per_epoch=4)
    assert ids(reader.batches(0, 0, 0, 4)) + ids(reader.batches(1, 0, 0, 4)) + ids(reader.batches(2, 0, 0, 4)) == \
        (list(map(float, range(ROWS))) * 2)[:ROWS + 10]  # 11 batches (the last of 3), then 1 of the next pass
    with pytest.raises(TrainerError, match="steps_per_epoch=0.*HINT"):
        epoch_input(kd_data.as_source(endless), None, True, steps_per_epoch=0)
