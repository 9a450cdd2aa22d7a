"""Stragglers: a worker alive and progressing, but clearly slower than its peers, named in the epoch line.

"Clearly": its steps/s is under ``SLOW`` (half) the median of the other workers' in two
consecutive epochs of the same fit, neither of which had a worker fail (its closures ran
again, elsewhere or after its restart: those rates measure the recovery). One epoch is not
enough: the first epoch of a fit mixes start-up and compilation (measured in local mode:
4.5 vs 1.9 steps/s in epoch 1, even in epoch 2), and a shared machine has slow moments. Parameter-server layouts only,
where the coordinator counts each worker's closures and each closure reports how long it ran
on its worker's own clock (so neither a smaller shard nor a chief slow to read results, as on
a loaded machine, makes a worker look slow); all-reduce workers run in lockstep,
so they all run at the slowest one's pace (TensorFlow does not expose the time each
waited in the collectives).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

#: A worker under this fraction of the others' median steps/s is slow in that epoch.
SLOW = 0.5


def slow_workers(rates: Mapping[Any, float]) -> dict[Any, float]:
    """{worker: its rate / the median of the others'} for the workers under ``SLOW``."""
    slow = {}
    for worker, rate in rates.items():
        others = [r for w, r in rates.items() if w != worker]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and rate < SLOW * median:
            slow[worker] = rate / median
    return slow


def straggler_note(stats: Mapping[str, Any], previous: Mapping[str, Any] | None) -> str:
    """``; worker 1 is a straggler: 0.31x the others' steps/s for 2 epochs`` or ``""``."""
    if previous is None or previous.get("workers_recovered") or stats.get("workers_recovered"):
        return ""  # a worker failed in one of the two epochs: the rates measure its recovery
    now = slow_workers(stats.get("worker_steps_per_sec") or {})
    before = slow_workers(previous.get("worker_steps_per_sec") or {})
    named = [w for w in now if w in before]
    return "".join(f"; worker {w} is a straggler: {now[w]:.2f}x the others' steps/s for 2 epochs" for w in named)
