"""The checkpoint interval ("500steps", "90s", "epoch"): parsed by the launcher's option
check and by the trainers' checkpoints, so it lives apart from both (pure, TensorFlow-free)."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Default interval between mid-epoch checkpoints: bounds the work a ps or chief death or a
#: preemption without warning loses; its cost in steps/s is measured by bench/recovery.py.
DEFAULT_EVERY = "120s"
INTERVAL_HINT = "use a step count (500 or 500steps), a time (90s, 5min, 1h) or 'epoch' (epoch ends only)."


class IntervalError(ValueError):
    """Not an interval; the message ends with a HINT."""


@dataclass(frozen=True)
class Interval:
    """Save every ``steps`` optimizer steps and/or every ``seconds``; neither: epoch ends only."""

    steps: int | None = None
    seconds: float | None = None

    def __str__(self) -> str:
        if self.steps:
            return f"every {self.steps} steps"
        if self.seconds:
            return f"every {self.seconds:g} s"
        return "at epoch ends only"


def parse_interval(text: str) -> Interval:
    """``"500"``/``"500steps"`` -> steps; ``"90s"``/``"5min"`` -> seconds; ``"epoch"``/``"off"``."""
    value = text.strip().lower().replace(" ", "")
    if value in ("epoch", "off", "0", "none"):
        return Interval()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(steps?|s|sec|seconds?|m|min|minutes?|h)?", value)
    if not match or float(match.group(1)) <= 0:
        raise IntervalError(f"{text!r} is not an interval. HINT: {INTERVAL_HINT}")
    number, unit = float(match.group(1)), match.group(2) or "steps"
    if unit.startswith("step"):
        return Interval(steps=max(1, int(number)))
    scale = 3600 if unit == "h" else 60 if unit.startswith("m") else 1
    return Interval(seconds=number * scale)


