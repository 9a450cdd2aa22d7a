"""Grouping of variables for packed transfers (keras_distrib/trainers/packing.py); no TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass

from keras_distrib.trainers.packing import pack_groups

PS0, PS1 = "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"


@dataclass
class FakeVariable:
    shape: tuple[int, ...]
    device: str
    dtype: str = "float32"


def test_one_group_per_device_and_dtype_in_order() -> None:
    vs = [FakeVariable((64, 256), PS0), FakeVariable((256,), PS1), FakeVariable((10,), PS0),
          FakeVariable((3,), PS0, "int64"), FakeVariable((256, 10), PS1)]
    groups = pack_groups(vs)
    assert [(g.device, g.indices) for g in groups] == [(PS0, (0, 2)), (PS1, (1, 4)), (PS0, (3,))]
    assert groups[0].shapes == ((64, 256), (10,)) and groups[0].sizes == (16384, 10)


def test_large_variables_travel_alone() -> None:
    vs = [FakeVariable((512, 512), PS0), FakeVariable((512,), PS0), FakeVariable((100, 512), PS0),
          FakeVariable((512, 512), PS0)]
    groups = pack_groups(vs)
    assert [g.indices for g in groups] == [(0,), (1, 2), (3,)]
    assert [g.indices for g in pack_groups(vs, max_elements=10**9)] == [(0, 1, 2, 3)]
