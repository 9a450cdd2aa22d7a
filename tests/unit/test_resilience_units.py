"""Pure parts of resilience: restart targets and lines, requeue commands, the checkpoint store.

The store is exercised with a fake writer (no TensorFlow); one test SIGKILLs a process in
the middle of a checkpoint write and checks the previous checkpoint is still the newest
complete one, and the partial write is removed at the next start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keras_distrib.checkpoint_interval import Interval, IntervalError, parse_interval
from keras_distrib.checkpoints import (
    CheckpointError,
    CheckpointStore,
    Meta,
    Schedule,
    check_compatible,
    position,
    preemption_requested,
    preemption_signals,
)
from keras_distrib.contract import PREEMPTED_EXIT_CODE
from keras_distrib.launcher.options import Options, validate
from cluster_parsers.sge import SgeParser
from keras_distrib.launcher.requeue import end_step, requeue
from keras_distrib.launcher.restarts import restart_line, restart_targets
from keras_distrib.plan import build_plan
from cluster_parsers import ClusterConfigError, JobInfo

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def plan_for(layout: str, nodes: int = 2):
    names = tuple(f"n{i + 1}" for i in range(nodes))
    job = JobInfo("slurm", "42", names, (1,) * nodes, node_gpus=tuple(("0", "1") for _ in names))
    return build_plan(job, layout, 23000, "grpc", None)


@pytest.mark.parametrize("layout", ["ps-per-node", "worker-per-gpu"])
def test_ps_layouts_restart_a_worker_alone_and_a_ps_with_the_chief(layout: str) -> None:
    plan = plan_for(layout, 3)
    assert restart_targets(plan, "worker:1") == ["worker:1"]
    assert restart_targets(plan, "chief:0") == ["chief:0"]
    assert restart_targets(plan, "ps:2") == ["ps:2", "chief:0"]


@pytest.mark.parametrize("nodes", [2, 3])
def test_allreduce_restarts_every_worker(nodes: int) -> None:
    plan = plan_for("allreduce", nodes)
    assert sorted(restart_targets(plan, "worker:1")) == sorted(p.name for p in plan.processes)
    assert len(restart_targets(plan, "worker:1")) == nodes  # one worker per node, all its GPUs


def test_restart_lines() -> None:
    assert restart_line("worker:1 on n2", "signal 9 (SIGKILL)", ["worker:1"], "worker:1", 1, 3) == (
        "worker:1 on n2 exited with signal 9 (SIGKILL); restarting it (1/3)")
    assert "restarting it and the chief's SCRIPT, which resumes from its last checkpoint (2/3)" in restart_line(
        "ps:0 on n2", "exit code 1", ["ps:0", "chief:0"], "ps:0", 2, 3)
    assert "restarting all 4 workers, which resume from the last checkpoint (1/5)" in restart_line(
        "worker:3 on n2", "signal 9 (SIGKILL)", ["worker:0", "worker:1", "worker:2", "worker:3"], "worker:3", 1, 5)


@pytest.mark.parametrize("value", [-1, "3", 1.5, True])
def test_bad_max_restarts_is_refused(value: object) -> None:
    with pytest.raises(ClusterConfigError, match="max-restarts"):
        validate(Options(max_restarts=value))  # type: ignore[arg-type]


def test_bad_checkpoint_interval_is_refused_by_the_launcher() -> None:
    with pytest.raises(ClusterConfigError, match="checkpoint-every='often'") as err:
        validate(Options(checkpoint_every="often"))
    assert "500steps" in str(err.value)
    assert validate(Options(checkpoint_every="90s")).checkpoint_every == "90s"


@pytest.mark.parametrize("text, expected", [
    ("500", Interval(steps=500)), ("20steps", Interval(steps=20)), ("1 step", Interval(steps=1)),
    ("90s", Interval(seconds=90)), ("2.5min", Interval(seconds=150)), ("1h", Interval(seconds=3600)),
    ("epoch", Interval()), ("off", Interval()),
])
def test_parse_interval(text: str, expected: Interval) -> None:
    assert parse_interval(text) == expected


@pytest.mark.parametrize("text", ["", "often", "-5", "5 parsecs", "0s"])
def test_bad_interval(text: str) -> None:
    with pytest.raises(IntervalError, match="HINT"):
        parse_interval(text)


def test_schedule_by_steps_and_by_time() -> None:
    now = [0.0]
    by_steps = Schedule(Interval(steps=100), step=50, clock=lambda: now[0])
    assert not by_steps.due(149) and by_steps.due(150)
    by_time = Schedule(Interval(seconds=10), step=0, clock=lambda: now[0])
    now[0] = 9.9
    assert not by_time.due(10_000)
    now[0] = 10.0
    assert by_time.due(1)
    by_time.mark(1)
    assert not by_time.due(2)
    assert not Schedule(Interval(), step=0, clock=lambda: now[0]).due(10**9)


def test_position_in_epoch() -> None:
    assert position(450, 100) == (4, 50)
    assert position(400, 100) == (4, 0)
    assert position(7, None) == (0, 7)


def fake_write(payload: bytes):
    def write(prefix: str) -> None:
        Path(prefix + ".index").write_bytes(payload)
    return write


def meta(step: int, layout: str = "ps-per-node", signature: str = "abc-4w") -> Meta:
    return Meta(step, step // 10, step % 10, 10, layout, signature, 0.0)


def test_store_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, writer=True, keep=2)
    for step in (10, 25, 30):
        store.save(fake_write(str(step).encode()), meta(step))
    assert [m.step for _, m in store.complete()] == [25, 30]
    path, latest = store.latest()
    assert latest.step == 30 and (path / "ckpt.index").read_bytes() == b"30"
    # A directory without a readable meta.json is not complete: skipped, never chosen.
    (tmp_path / "ckpt-000000000099").mkdir()
    assert store.latest()[1].step == 30


def test_non_writer_writes_nothing_into_the_directory(tmp_path: Path) -> None:
    written = []
    store = CheckpointStore(tmp_path / "ck", writer=False)
    assert store.save(lambda prefix: written.append(prefix), meta(10)) is None
    assert written and not (tmp_path / "ck").exists()


def test_other_layout_or_model_is_refused_with_a_hint(tmp_path: Path) -> None:
    check_compatible(tmp_path, meta(10), "ps-per-node", "abc-4w")
    with pytest.raises(CheckpointError, match="ps-per-node run .*HINT: resume with --layout ps-per-node"):
        check_compatible(tmp_path, meta(10), "allreduce", "abc-4w")
    with pytest.raises(CheckpointError, match="another model .*HINT"):
        check_compatible(tmp_path, meta(10), "ps-per-node", "def-6w")


def test_preemption_signal_only_sets_a_flag_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with preemption_signals():
        assert preemption_requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert preemption_requested() == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from keras_distrib.checkpoints import CheckpointStore, Meta

    store = CheckpointStore(sys.argv[1], writer=True)
    def good(prefix):
        Path(prefix + ".index").write_text("complete")
    store.save(good, Meta(100, 1, 0, 100, "ps-per-node", "abc-4w", 0.0))
    def slow(prefix):
        with open(prefix + ".data", "w") as fh:
            fh.write("partial")
            fh.flush()
            print("writing", flush=True)
            time.sleep(60)
    store.save(slow, Meta(200, 2, 0, 100, "ps-per-node", "abc-4w", 0.0))
    """
)


def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any(p.name.startswith(".partial-") for p in (tmp_path / "ck").iterdir())
    reader = CheckpointStore(tmp_path / "ck", writer=False)
    path, latest = reader.latest()
    assert latest.step == 100 and (path / "ckpt.index").read_text() == "complete"
    CheckpointStore(tmp_path / "ck", writer=True)  # the next run's writer cleans up
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-000000000100"]


def test_requeue_off_or_impossible_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lines: list[str] = []
    assert requeue("slurm", {"SLURM_JOB_ID": "7"}, False, lines.append) == PREEMPTED_EXIT_CODE
    assert "requeue is off" in lines[-1]
    assert requeue("static", {}, True, lines.append) == PREEMPTED_EXIT_CODE
    assert "not a batch job" in lines[-1]
    assert requeue("slurm", {}, True, lines.append) == PREEMPTED_EXIT_CODE
    assert "SLURM_JOB_ID or SLURM_JOBID is not set" in lines[-1]
    monkeypatch.setenv("PATH", str(tmp_path))
    assert requeue("slurm", {"SLURM_JOB_ID": "7"}, True, lines.append) == PREEMPTED_EXIT_CODE
    assert "'scontrol' is not on PATH" in lines[-1]
    assert requeue("sge", {"JOB_ID": "7"}, True, lines.append) == SgeParser.reschedule_exit_code == 99


@pytest.mark.parametrize("scheduler, variable, command, ok", [
    ("slurm", "SLURM_JOB_ID", "scontrol", True),
    ("slurm", "SLURM_JOB_ID", "scontrol", False),
    ("pbs", "PBS_JOBID", "qrerun", True),
    ("lsf", "LSB_JOBID", "brequeue", True),
])
def test_requeue_runs_the_scheduler_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scheduler: str,
                                            variable: str, command: str, ok: bool) -> None:
    record = tmp_path / "argv"
    stub = tmp_path / command
    stub.write_text(f"#!/bin/sh\necho \"$0 $@\" > {record}\n" + ("exit 0\n" if ok else "echo 'Requeue of job 7 failed: Only batch jobs are accepted' >&2; exit 1\n"))
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    lines: list[str] = []
    code = requeue(scheduler, {variable: "7"}, True, lines.append)
    expected = ["requeue", "7"] if command == "scontrol" else ["7"]
    assert record.read_text().split()[1:] == expected
    if ok:
        assert code == 0 and lines[-1].startswith("requeued job 7")
    else:
        assert code == PREEMPTED_EXIT_CODE and "Only batch jobs are accepted" in lines[-1]


def test_a_requeue_command_the_scheduler_ends_as_it_requeues_counts_as_requeued(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Slurm ends the step's processes, scontrol among them, as it requeues the job (seen in
    CI: the job came back and resumed); any other failure still says it could not."""
    stub = tmp_path / "scontrol"
    stub.write_text("#!/bin/sh\nkill -TERM $$\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    lines: list[str] = []
    assert requeue("slurm", {"SLURM_JOB_ID": "7"}, True, lines.append) == 0
    assert lines[-1].startswith("requeued job 7") and "SIGTERM" in lines[-1]
    stub.write_text("#!/bin/sh\nkill -KILL $$\n")
    assert requeue("slurm", {"SLURM_JOB_ID": "7"}, True, lines.append) == PREEMPTED_EXIT_CODE
    assert lines[-1].startswith("cannot requeue")


@pytest.mark.parametrize("scheduler, environ, command, target", [
    ("slurm", {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, "scancel", "7.0"),
    ("sge", {"JOB_ID": "7"}, "qdel", "7"),
    ("pbs", {"PBS_JOBID": "7.server"}, "qdel", "7.server"),
    ("lsf", {"LSB_JOBID": "7"}, "bkill", "7"),
])
def test_a_lost_node_ends_the_step_through_the_scheduler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       scheduler: str, environ: dict[str, str], command: str,
                                                       target: str) -> None:
    record = tmp_path / "argv"
    stub = tmp_path / command
    stub.write_text(f"#!/bin/sh\necho \"$@\" > {record}\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    lines: list[str] = []
    end_step(scheduler, environ, lines.append)
    assert record.read_text().split() == [target]
    assert lines == [f"ending the step ({command} {target}) so the launcher does not wait for the lost node."]


def test_ending_the_step_says_why_it_cannot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lines: list[str] = []
    end_step("local", {}, lines.append)
    assert lines == []  # every agent is on this machine: nothing to wait for
    end_step("slurm", {"SLURM_JOB_ID": "7"}, lines.append)
    assert lines[-1].startswith("cannot end the step: SLURM_STEP_ID not set")
    monkeypatch.setenv("PATH", str(tmp_path))
    end_step("slurm", {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, lines.append)
    assert "'scancel' is not on PATH" in lines[-1]


# -- elastic: a resume with another number of workers (docs/faults.md, Node loss) ----------------


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_bad_min_nodes_is_refused(value: object) -> None:
    with pytest.raises(ClusterConfigError, match="min-nodes") as raised:
        validate(Options(min_nodes=value))  # type: ignore[arg-type]
    assert "HINT: " in str(raised.value)


def _meta(step: int, epoch: int, in_epoch: int, spe: int | None, workers: int | None = 3) -> Meta:
    return Meta(step, epoch, in_epoch, spe, "ps-per-node", "sig", 0.0, workers=workers)


def test_resume_position_keeps_the_place_or_maps_the_fraction_of_the_epoch() -> None:
    from keras_distrib.checkpoints import resume_position

    assert resume_position(_meta(812, 4, 12, 200), 200) == (4, 12)  # the same count: the meta's place
    assert resume_position(_meta(812, 4, 12, None), 200) == (4, 12)  # no count saved: from step 0
    assert resume_position(_meta(900, 4, 100, 200), 300) == (4, 150)  # half of epoch 5 done, on 300 steps now
    assert resume_position(_meta(800, 4, 0, 200), 300) == (4, 0)  # an epoch's end stays one
    assert resume_position(_meta(999, 4, 199, 200), 100) == (4, 99)  # a begun epoch keeps its last step


def test_position_counts_epochs_from_the_resumed_one() -> None:
    # Resumed at step 900 as epoch 4 with 150 of 300 steps done: epoch 4 began at (virtual) step 750.
    origin = (750, 4)
    assert position(900, 300, origin) == (4, 150)
    assert position(1050, 300, origin) == (5, 0)  # the resumed epoch ends after its 150 remaining steps
    assert position(1400, 300, origin) == (6, 50)
    assert position(1400, 300) == (4, 200)  # without the origin: counted from step 0


def test_progress_file_carries_the_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from keras_distrib import contract, progress

    path = tmp_path / "progress-chief-0"
    monkeypatch.setenv(contract.PROGRESS_FILE_VAR, str(path))
    progress.reset()
    try:
        progress.tick(5)
        assert progress.last_checkpoint(path) is None  # none yet
        progress.checkpointed(0, 1)  # a checkpoint at step 0 is one
        assert progress.last_checkpoint(path) == (0, 1)
        progress.checkpointed(812, 5)
        assert progress.last_checkpoint(path) == (812, 5)
        assert progress.read(path) == (5, False)  # the watchdog's words are untouched
        assert not progress.training_done(path)
        progress.training_ended(True)  # the fit's last epoch, before its checkpoint is noted
        assert progress.training_done(path) and progress.last_checkpoint(path) == (812, 5)
        progress.training_ended(False)  # another fit starts
        assert not progress.training_done(path)
    finally:
        progress.reset()
    assert progress.last_checkpoint(tmp_path / "missing") is None and not progress.training_done(tmp_path / "missing")


def test_worker_count_reads_the_current_plan(tmp_path: Path) -> None:
    from keras_distrib import contract

    plan_file = tmp_path / "plan.json"
    plan = build_plan(JobInfo("slurm", "5", ("n1", "n2", "n3"), (1, 1, 1)))
    plan_file.write_text(json.dumps(plan.to_json()))
    env = {contract.PLAN_FILE_VAR: str(plan_file)}
    assert contract.worker_count(env) == 3
    contract.rewrite_plan_file(plan_file, json.dumps(build_plan(JobInfo("slurm", "5", ("n1", "n3"), (1, 1))).to_json()))
    assert contract.worker_count(env) == 2  # a re-forming rewrote it in place
    assert contract.worker_count({}) is None


def test_a_resume_on_other_workers_calls_on_workers_changed(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from keras_distrib.trainers.base import Trainer

    seen: list[tuple[int, int]] = []
    hook = SimpleNamespace(on_workers_changed=lambda old, new: seen.append((old, new)))
    trainer = SimpleNamespace(is_chief=True)
    with caplog.at_level("INFO", logger="keras_distrib"):
        Trainer._workers_changed(trainer, [object(), hook], 3, 3)  # type: ignore[arg-type]
        Trainer._workers_changed(trainer, [hook], None, 2)  # type: ignore[arg-type]  # an older checkpoint
        assert seen == [] and not caplog.messages
        Trainer._workers_changed(trainer, [object(), hook], 3, 2)  # type: ignore[arg-type]
    assert seen == [(3, 2)]
    assert caplog.messages == ["resuming on 2 workers (the checkpoint was saved on 3): the global batch and the "
                               "learning rate are kept; calling on_workers_changed(3, 2)."]


def test_local_processes_reform_kills_every_child_and_starts_the_new_plan(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from keras_distrib import contract
    from keras_distrib.launcher.workers import ChildSettings, Launch, LocalProcesses
    from keras_distrib.plan import survivors_plan

    events: list[str] = []

    def spawn(proc: object, argv: list[str], env: dict[str, str], runs_script: bool, on_exit: object,
              **_: object) -> SimpleNamespace:
        name = env[contract.TASK_VAR]
        events.append(f"start {name} {len(json.loads(Path(env[contract.PLAN_FILE_VAR]).read_text())['nodes'])}")
        return SimpleNamespace(proc=proc, runs_script=runs_script, env=env,
                               signal=lambda s: events.append(f"signal {name} {s}"),
                               popen=SimpleNamespace(wait=lambda: events.append(f"wait {name}")))

    job = JobInfo("local", "7", ("local0", "local1", "local2"), (1, 1, 1))
    plan = build_plan(job, "allreduce", 25000, hosts={n: "127.0.0.1" for n in job.nodes})
    processes = LocalProcesses(lambda child, code: None, ChildSettings(60.0), spawner=spawn,
                               plan_file=contract.write_plan_file(json.dumps(plan.to_json()), str(tmp_path)))
    processes.start(plan, [Launch(p, ("python", "train.py"), True) for p in plan.processes])
    old = list(processes.children)
    plan_file = processes.plan_file
    events.clear()
    left = survivors_plan(plan, job, ("local0", "local1"))
    processes.reform(left, [Launch(p, ("python", "train.py"), True) for p in left.processes])
    assert events == ["signal worker:0 9", "signal worker:1 9", "signal worker:2 9",  # all killed first,
                      "wait worker:0", "wait worker:1", "wait worker:2",  # and waited for,
                      "start worker:0 2", "start worker:1 2"]  # then the new plan's, which they read
    assert processes.plan_file == plan_file  # the same path: the progress files stay beside it
    assert not any(processes.current(child) for child in old)  # the old exits are no news
    assert json.loads(processes.children[1].env[contract.TF_CONFIG_VAR])["cluster"] == {
        "worker": ["127.0.0.1:25000", "127.0.0.1:25001"]}


def test_nothing_left_counts_epochs_from_the_resumed_one(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from keras_distrib.checkpoints import Checkpointer

    checkpointer = Checkpointer(str(tmp_path), None, SimpleNamespace(weights=[]), writer=False, layout="allreduce")
    checkpointer.steps_per_epoch = 300
    checkpointer.origin = (750, 4)  # epoch 5 (0-based 4) began at step 750: 300 steps per epoch from there
    assert not checkpointer.nothing_left(1049, 5)
    assert checkpointer.nothing_left(1050, 5)  # from step 0 (1050 < 5 * 300) it would train on
    assert not checkpointer.nothing_left(1050, 6)  # one more epoch asked for
