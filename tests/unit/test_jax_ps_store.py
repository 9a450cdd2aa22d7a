"""The JAX ps trainer's store layout: variables placed on ps tasks and packed into one buffer
per task and dtype (pure; the round trips themselves run in tests/local/test_jax_ps_local.py)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_distrib.trainers.jax_ps.store import pack, slots_for, unpack
from keras_distrib.trainers.placement import plan_placement

pytestmark = pytest.mark.unit

SHAPES = [(3, 3, 1, 16), (16,), (), (800, 64), (7,), (64, 10), (1,), (10,), (5, 3)]


def _values(dtypes: list[str]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtypes[i % len(dtypes)]) for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("num_ps", [1, 2, 3])
@pytest.mark.parametrize("dtypes", [["float32"], ["float32", "float16"], ["float32", "float64", "float16"]])
def test_values_pack_into_one_buffer_per_task_and_dtype_and_come_back_whole(num_ps: int, dtypes: list[str]) -> None:
    values = _values(dtypes)
    slots, buffers = slots_for(4, values, num_ps)
    flats = pack(slots, buffers, values)
    assert [f.dtype for f in flats] == [b.dtype for b in buffers] and [f.size for f in flats] == [b.size for b in buffers]
    assert len({(b.ps, b.dtype) for b in buffers}) == len(buffers) == len({b.name for b in buffers})
    back = unpack(slots, flats)
    assert all(b.shape == v.shape and b.dtype == v.dtype and np.array_equal(b, v) for b, v in zip(back, values))


@pytest.mark.parametrize("num_ps", [2, 3])
def test_each_variable_stays_on_the_task_the_balanced_placement_gives_it(num_ps: int) -> None:
    values = _values(["float32", "float16"])
    slots, buffers = slots_for(0, values, num_ps)
    assert [buffers[s.buffer].ps for s in slots] == plan_placement([v.size for v in values], num_ps)
    # Within a buffer, the variables lie end to end in their order, none overlapping.
    for i, buffer in enumerate(buffers):
        members = [s for s in slots if s.buffer == i]
        assert [s.offset for s in members] == list(np.cumsum([0] + [s.size for s in members])[:-1])
        assert sum(s.size for s in members) == buffer.size


def test_every_process_finds_the_same_buffers_by_name() -> None:
    values = _values(["float32"])
    assert slots_for(7, values, 2) == slots_for(7, [v.copy() for v in values], 2)
    assert {b.name for b in slots_for(7, values, 2)[1]} == {"keras_distrib/m7/ps0/float32", "keras_distrib/m7/ps1/float32"}
    assert not {b.name for b in slots_for(7, values, 2)[1]} & {b.name for b in slots_for(8, values, 2)[1]}
