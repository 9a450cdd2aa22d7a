"""bench/_faults.py: a seed is a schedule, replayed exactly; the schedule keeps its rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _faults import KINDS, ONCE, describe, draw_schedule, kinds_for  # noqa: E402

pytestmark = pytest.mark.unit
NODES = ("n1", "n2", "n3")


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce", "jax"])
def test_a_seed_replays_the_same_schedule_and_seeds_differ(layout: str) -> None:
    draw = lambda seed: draw_schedule(seed, 6, layout=layout, nodes=NODES, span=120, min_gap=4)  # noqa: E731
    assert draw(7) == draw(7) and describe(7, layout, draw(7)) == describe(7, layout, draw(7))
    assert len({tuple(draw(seed)) for seed in range(20)}) == 20


@pytest.mark.parametrize("min_gap", [0.0, 3.0, 30.0])
def test_the_schedule_keeps_its_rules(min_gap: float) -> None:
    seen: set[str] = set()
    for seed in range(300):
        for layout in ("ps-per-node", "allreduce", "jax"):
            faults = draw_schedule(seed, 7, layout=layout, nodes=NODES, span=100, min_gap=min_gap)
            assert len(faults) == 7
            assert all(b.at - a.at >= min_gap - 0.11 for a, b in zip(faults, faults[1:]))  # rounded to 0.1 s
            assert all(f.kind in kinds_for(layout) for f in faults)
            assert all(sum(f.kind == k for f in faults) <= 1 for k in ONCE)
            for f in faults:
                assert (f.node == "n1") == (f.kind == "kill-chief")  # the first node's agent leads the job
                assert (f.seconds > 0) == (f.kind in ("freeze", "cut-link"))
            seen.update(f.kind for f in faults)
    assert seen == set(KINDS)


def test_a_fault_line_says_when_what_where_and_how_long() -> None:
    faults = draw_schedule(3, 4, layout="ps-per-node", nodes=NODES, span=60, min_gap=0, kinds=["freeze"])
    text = describe(3, "ps-per-node", faults)
    assert text.splitlines()[0] == "seed 3, layout ps-per-node: 4 fault(s)"
    assert all(" freeze " in line and " s  " in line and line.endswith(" s") for line in text.splitlines()[1:])
