"""bench/_faults.py: a seed is a schedule, replayed exactly; the schedule keeps its rules."""

from __future__ import annotations

import json
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


def test_the_chaos_check_finds_each_kind_of_spoiled_checkpoint(tmp_path: Path) -> None:
    import json

    from chaos import checkpoint_problems

    meta = {"step": 1, "epoch": 0, "step_in_epoch": 1, "steps_per_epoch": 10, "layout": "allreduce",
            "signature": "x", "saved_at": 0.0}
    for name, files in {"ckpt-000000000001": {"meta.json": json.dumps(meta), "ckpt.index": ""},
                        "ckpt-000000000002": {"ckpt.index": ""},
                        "ckpt-000000000003": {"meta.json": json.dumps({**meta, "step": 3})}}.items():
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
    assert checkpoint_problems(str(tmp_path)) == [
        "checkpoints without readable meta.json: ['ckpt-000000000002']",
        "ckpt-000000000003 has no TF checkpoint index"]
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "training_metadata.json").write_text("{cut")
    assert checkpoint_problems(str(tmp_path))[-1].endswith("training_metadata.json is not JSON")
    assert checkpoint_problems(str(tmp_path / "missing")) == []


def test_the_chaos_harness_notes_each_marked_line_once_as_the_output_grows(tmp_path: Path) -> None:
    """A cut that a requeue or training's end overtook may go unnoticed: the harness needs when
    those lines appeared, reading only what is new, a line split across two reads included."""
    from chaos import OutputWatch

    out = tmp_path / "job.out"
    watch = OutputWatch(out)
    watch.poll()  # no output yet
    chunks = [b"x" * 100 + b"[n1 agent] keras_distrib: requeued job 2 (scontrol", b" requeue 2)\n",
              b'[n1 chief:0] {"st', b'ep": 8000}\n[n1 agent] keras_distrib: requeued job 2 again\n', b""]
    counts = []
    for chunk in chunks:
        with out.open("ab") as f:
            f.write(chunk)
        watch.poll()
        counts.append((len(watch.seen["requeued"]), len(watch.seen["trained"])))
    assert counts == [(1, 0), (1, 0), (1, 0), (2, 1), (2, 1)]


def test_the_chaos_harness_sees_a_frozen_process_replaced_before_the_hang_timeout() -> None:
    """A process frozen, then killed by a restart for another fault before the hang timeout,
    may go unnoticed: the harness watches when it is gone (a zombie counts), or None if it stayed."""
    import signal
    import subprocess
    import threading

    from chaos import seconds_until_gone

    stayed = subprocess.Popen(["sleep", "30"])
    replaced = subprocess.Popen(["sleep", "30"])
    try:
        replaced.send_signal(signal.SIGSTOP)
        threading.Timer(0.5, replaced.kill).start()  # not reaped: a zombie
        gone = seconds_until_gone(replaced.pid, 5.0)
        assert gone is not None and 0.4 < gone < 3.0
        assert seconds_until_gone(stayed.pid, 0.5) is None
    finally:
        for proc in (stayed, replaced):
            proc.kill()
            proc.wait()


def test_the_chaos_check_wants_each_quiet_epoch_to_see_every_example_once() -> None:
    """An epoch of any run that began 30 s after every fault, or ended before the first, must
    have seen the data's size; a run's resumed first epoch and those a fault overlapped are not checked."""
    from _faults import Fault
    from chaos import EXAMPLES, RECOVERED_AFTER, Run, epoch_problems, epoch_records

    run = Run("ps-per-node", 1, [Fault(5.0, "kill-worker", "n2"), Fault(9.0, "freeze", "n3", seconds=20.0)], 40)
    run.struck = {0: 1000.0, 1: 1010.0}
    quiet = 1010.0 + 20.0 + RECOVERED_AFTER
    text = "\n".join(f"[{node} {label}] epoch-record {json.dumps(row)}" for node, label, row in [
        ("n1", "chief:0", [3, 900.0, 990.0, 4000.0, 11]),              # the first run resumed: partial
        ("n1", "chief:0", [4, 990.0, 999.0, EXAMPLES, 11]),             # ended before the first fault: whole
        ("n1", "chief:0", [5, 999.0, 1005.0, EXAMPLES + 48, 11]),       # the kill within it: a batch seen twice
        ("n1", "worker:0", [5, 999.0, 1005.0, 7.0, 12]),                # a worker's own line: not the chief's
        ("n2", "chief:0", [5, 999.0, 1005.0, 7.0, 13]),                 # not the first node
        ("n1", "chief:0", [5, quiet - 10.0, quiet + 2.0, EXAMPLES - 96, 14]),  # the next run's resumed epoch
        ("n1", "chief:0", [6, quiet + 2.0, quiet + 5.0, EXAMPLES, 14]),
        ("n1", "chief:0", [7, quiet + 5.0, quiet + 9.0, EXAMPLES - 48, 14]),
    ]) + "\n[n1 chief:0] Epoch 8/40\n"
    records = epoch_records(text)
    assert [r[4] for r in records] == [11, 11, 11, 14, 14, 14]
    assert epoch_problems(run, records) == [f"epoch 8 (pid 14) saw {EXAMPLES - 48} examples, not {EXAMPLES}"]
    assert run.result["exact_epochs"] == "3 of 6"
    run.struck = {}  # nothing injected (all skipped): every epoch but the resumed ones counts
    assert len(epoch_problems(run, records)) == 2 and run.result["exact_epochs"] == "4 of 6"

