"""The counts learned in the first whole epoch, shared by both trainers (keras_distrib/data/counting.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from keras_distrib.data import FirstEpochCount, counts_in_first_epoch

pytestmark = pytest.mark.unit


@dataclass
class Files:
    same_shard_sizes_every_epoch: bool = True


@pytest.mark.parametrize("same, repeat, expected", [(True, False, True), (True, True, False), (False, False, False)])
def test_only_an_input_of_fixed_shards_that_ends_its_epochs_counts(same: bool, repeat: bool, expected: bool) -> None:
    assert counts_in_first_epoch(Files(same), repeat) is expected


def test_the_first_whole_epoch_is_taken_once_and_said_once() -> None:
    count, said = FirstEpochCount(counting=True), []
    assert not count.learned and not count.take([])  # an epoch that saw nothing teaches nothing
    assert count.take([3, 2]) and count.learned and count.counts == [3, 2] and not count.counting
    assert not count.take([9, 9]) and count.counts == [3, 2]  # later epochs do not replace it
    count.say_once(lambda: said.append("used"))
    count.say_once(lambda: said.append("used"))
    assert said == ["used"]


def test_giving_up_or_not_counting_takes_nothing() -> None:
    count = FirstEpochCount(counting=True)
    count.give_up()
    assert not count.take([1]) and not count.learned
    never, said = FirstEpochCount(counting=False), []
    never.say_once(lambda: said.append("x"))
    assert not never.take([1]) and said == []
