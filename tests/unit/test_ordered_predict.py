"""Re-assembly of distributed predictions in input order (keras_distrib/trainers/ordered.py)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_distrib.trainers._common import TrainerError
from keras_distrib.trainers.ordered import assemble

pytestmark = pytest.mark.unit


def keys(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.asarray(rows, np.int64).reshape(-1, 3)


def test_rows_come_back_in_key_order_whatever_the_arrival_order() -> None:
    # Two shards of 5 rows dealt i % 2, arriving shard 1 first, in chunks.
    parts = [
        (keys([(0, 0, 1), (0, 0, 3)]), {"p": np.array([[1.0], [3.0]]), "v": np.array([10, 30])}),
        (keys([(0, 0, 0), (0, 0, 2), (0, 0, 4)]), {"p": np.array([[0.0], [2.0], [4.0]]), "v": np.array([0, 20, 40])}),
    ]
    out = assemble(parts, expected=5)
    assert out["p"][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert out["v"].tolist() == [0, 10, 20, 30, 40]


def test_file_then_batch_then_position_and_duplicates_dropped() -> None:
    # Files 1 and 0 (sorted order 0, 1), batched readers; a chunk delivered twice (a re-run).
    part_a = (keys([(1, 0, 0), (1, 0, 1), (1, 1, 0)]), np.array([4.0, 5.0, 6.0]))
    part_b = (keys([(0, 1, 0), (0, 0, 0), (0, 0, 1)]), np.array([3.0, 1.0, 2.0]))
    out = assemble([part_a, part_b, part_b], expected=6)
    assert out.tolist() == [1, 2, 3, 4, 5, 6]


def test_list_outputs_and_a_missing_row_is_an_error() -> None:
    parts = [(keys([(0, 0, 1), (0, 0, 0)]), [np.array([1, 0]), np.array([[1, 1], [0, 0]])])]
    first, second = assemble(parts, expected=2)
    assert first.tolist() == [0, 1] and second.tolist() == [[0, 0], [1, 1]]
    with pytest.raises(TrainerError, match="gathered 2 rows for 3 inputs"):
        assemble(parts, expected=3)
