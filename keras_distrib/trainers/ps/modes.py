"""The parameter-server trainer's step mode: one `PsMode`, asked for with
``keras_distrib.fit(ps_stale_reads=, ps_local_steps=)`` (docs/training.md)."""

from __future__ import annotations

import enum

from .._common import TrainerError

_BOTH_MODES = ("ps_stale_reads and ps_local_steps cannot both be on. HINT: choose one of them "
               "(or neither, the default).")


class PsMode(enum.Enum):
    """How a closure's K steps use the parameter servers."""

    #: Every step reads the variables and applies its update on the ps.
    DEFAULT = "default"
    #: Opt-in (changes the training semantics): each closure reads the variables once and
    #: computes all its K gradients at those values.
    STALE_READS = "stale_reads"
    #: Opt-in (changes the training semantics): each closure runs its K steps on a local
    #: copy of the weights and optimizer state, then adds the change to the ps once.
    LOCAL_STEPS = "local_steps"


def requested_mode(current: PsMode, stale_reads: bool | None, local_steps: bool | None) -> PsMode:
    """The mode ``keras_distrib.fit(ps_stale_reads=, ps_local_steps=)`` asks for, from
    ``current``: True turns a mode on, False turns it off, None leaves it. One mode at a time:
    turning one on while the other stays on is refused (one line, HINT)."""
    want = {PsMode.STALE_READS: stale_reads, PsMode.LOCAL_STEPS: local_steps}
    on = [mode for mode, value in want.items() if value]
    if len(on) == 2 or (on and current not in (PsMode.DEFAULT, on[0]) and want[current] is not False):
        raise TrainerError(_BOTH_MODES)
    if on:
        return on[0]
    return PsMode.DEFAULT if current is not PsMode.DEFAULT and want[current] is False else current
