"""Shard sizes learned by running: counted in the first whole epoch, relied on after.

A source whose shards hold the same number of elements every epoch, though that number
is unknown before the first (files dealt whole to workers:
``Source.same_shard_sizes_every_epoch``), can be counted once: the first epoch that runs
whole counts each shard (or each step's examples), and the later epochs run on those
counts without counting again. Both trainers keep one `FirstEpochCount` per fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def counts_in_first_epoch(source: Any, repeat: bool) -> bool:
    """Whether ``source``'s shard sizes can be learned from one whole epoch (a repeated
    input never ends an epoch by itself, so it never counts one)."""
    return bool(source.same_shard_sizes_every_epoch) and not repeat


@dataclass
class FirstEpochCount:
    """The counts of the first epoch that ran whole, and the one line that says they are used.

    ``counting``: still waiting for such an epoch. ``counts``: what it counted (None: not yet);
    the trainer decides the unit (batches per shard, examples per step).
    """

    counting: bool
    counts: list[int] | None = None
    _unsaid: bool = field(default=False, repr=False)

    @property
    def learned(self) -> bool:
        return self.counts is not None

    def take(self, counts: Sequence[int]) -> bool:
        """The counts of an epoch that ran whole; True if they are taken (the first time only)."""
        if not self.counting or not counts:
            return False
        self.counting, self.counts, self._unsaid = False, list(counts), True
        return True

    def give_up(self) -> None:
        """Counting is of no use for this fit (shards too small to gain from it)."""
        self.counting = False

    def say_once(self, say: Callable[[], None]) -> None:
        """Say that the counts are used, once, when first used (Keras' progress bar has then
        ended its line)."""
        if self._unsaid:
            self._unsaid = False
            say()
