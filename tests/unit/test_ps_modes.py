"""The parameter-server trainer's step mode: one `PsMode`, asked for with keras_distrib.fit's
two options (True turns a mode on, False off, None leaves it; one mode at a time)."""

from __future__ import annotations

import pytest

from keras_distrib.trainers._common import TrainerError
from keras_distrib.trainers.ps.modes import PsMode, requested_mode

pytestmark = pytest.mark.unit

D, S, L = PsMode.DEFAULT, PsMode.STALE_READS, PsMode.LOCAL_STEPS


@pytest.mark.parametrize("current,stale,local,expected", [
    (D, None, None, D), (D, False, False, D), (D, True, None, S), (D, None, True, L),
    (S, None, None, S), (S, False, None, D), (S, None, False, S), (S, False, True, L),
    (L, None, None, L), (L, None, False, D), (L, True, False, S), (L, None, True, L),
])
def test_each_option_turns_its_mode_on_or_off(current: PsMode, stale: bool | None, local: bool | None,
                                              expected: PsMode) -> None:
    assert requested_mode(current, stale, local) is expected


@pytest.mark.parametrize("current,stale,local", [(D, True, True), (L, True, None), (S, None, True)])
def test_two_modes_at_once_are_refused_with_a_hint(current: PsMode, stale: bool | None, local: bool | None) -> None:
    with pytest.raises(TrainerError, match="cannot both be on. HINT"):
        requested_mode(current, stale, local)
