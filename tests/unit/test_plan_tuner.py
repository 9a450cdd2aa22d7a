"""Layout tuner's plan: KerasTuner's oracle on the first node, trial workers per GPU, their
variables, what a death restarts, and the options it refuses."""

from __future__ import annotations

import pytest

from cluster_parsers import ClusterConfigError, JobInfo
from keras_distrib import contract
from keras_distrib.launcher.options import Options, validate
from keras_distrib.launcher.restarts import restart_line, restart_targets
from keras_distrib.plan import Plan, build_plan, survivors_plan

pytestmark = pytest.mark.unit


def job(nodes: int, gpus: tuple[str, ...] = ()) -> JobInfo:
    names = tuple(f"n{i + 1}" for i in range(nodes))
    return JobInfo("slurm", "77", names, (1,) * nodes, node_gpus=(gpus,) * nodes)


@pytest.mark.parametrize("nodes", [1, 2, 3])
@pytest.mark.parametrize("gpus, per_node, expected", [
    ((), None, [()]),
    (("0", "1"), None, [("0",), ("1",)]),
    (("0", "1", "2"), 2, [("0", "2"), ("1",)]),
    ((), 3, [(), (), ()]),
])
def test_the_oracle_is_alone_first_and_every_node_runs_its_trial_workers(nodes, gpus, per_node, expected) -> None:
    plan = build_plan(job(nodes, gpus), "tuner", tuners_per_node=per_node)
    oracle, *trials = plan.processes
    assert (oracle.job, oracle.node, oracle.gpus) == ("chief", "n1", ())
    assert [p.job for p in trials] == ["tuner"] * (nodes * len(expected))
    assert [p.index for p in trials] == list(range(len(trials)))
    for node in range(nodes):
        assert [p.gpus for p in trials if p.node_index == node] == expected
    ports = [p.address for p in plan.processes]
    assert len(set(ports)) == len(ports)
    assert plan.every_process_runs_script and all(plan.runs_script(p) for p in plan.processes)


def test_kerastuners_variables_name_the_oracle_and_each_worker_once(tmp_path) -> None:
    plan = build_plan(job(3, ("0", "1")), "tuner", hosts={"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"})
    envs = [contract.child_env({}, plan, p, tmp_path / "plan.json", startup_timeout=9) for p in plan.processes]
    ids = [e[contract.TUNER_ID_VAR] for e in envs]
    assert ids == ["chief"] + [f"tuner{i}" for i in range(6)]
    assert {(e[contract.ORACLE_IP_VAR], e[contract.ORACLE_PORT_VAR]) for e in envs} == \
        {("10.0.0.1", str(plan.processes[0].port))}
    assert all(contract.TF_CONFIG_VAR not in e for e in envs), "trial workers are not TensorFlow tasks"
    assert [e[contract.CUDA_DEVICES_VAR] for e in envs] == ["", "0", "1", "0", "1", "0", "1"]
    # --plan --format json shows them too
    assert [p["env"][contract.TUNER_ID_VAR] for p in contract.plan_json(plan)["processes"]] == ids


def test_other_layouts_get_no_tuner_variables(tmp_path) -> None:
    plan = build_plan(job(2), "ps-per-node")
    env = contract.child_env({}, plan, plan.processes[0], tmp_path / "plan.json", startup_timeout=9)
    assert not {contract.TUNER_ID_VAR, contract.ORACLE_IP_VAR, contract.ORACLE_PORT_VAR} & set(env)


def test_a_dead_trial_worker_restarts_alone_and_a_dead_oracle_restarts_the_search() -> None:
    plan = build_plan(job(2), "tuner")
    assert restart_targets(plan, "tuner:1") == ["tuner:1"]
    assert restart_targets(plan, "chief:0") == ["chief:0", "tuner:0", "tuner:1"]
    line = restart_line("tuner:1 on n2", "signal 9 (SIGKILL)", ["tuner:1"], "tuner:1", 1, 3)
    assert line == "tuner:1 on n2 exited with signal 9 (SIGKILL); restarting it; the oracle gives it its trial again (1/3)"
    line = restart_line("chief:0 on n1", "signal 9 (SIGKILL)", restart_targets(plan, "chief:0"), "chief:0", 1, 3)
    assert "restarting it and all 2 trial workers; the search resumes from its directory" in line


def test_the_plan_keeps_its_workers_per_node_through_json_and_a_re_forming() -> None:
    plan = build_plan(job(3, ("0", "1")), "tuner", tuners_per_node=1)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    smaller = survivors_plan(plan, job(3, ("0", "1")), ["n1", "n3"])
    assert [p.gpus for p in smaller.processes] == [(), ("0", "1"), ("0", "1")]


def test_more_workers_than_gpus_is_refused_with_a_hint() -> None:
    with pytest.raises(ClusterConfigError, match=r"--tuners-per-node 3, but the node has 2 GPU\(s\)") as err:
        build_plan(job(2, ("0", "1")), "tuner", tuners_per_node=3)
    assert "--tuners-per-node 2 or less" in err.value.hint


@pytest.mark.parametrize("options, message", [
    (Options(layout="allreduce", tuners_per_node=2), "--tuners-per-node 2 is for layout tuner"),
    (Options(layout="tuner", tuners_per_node=0), "tuners-per-node=0 must be a whole number >= 1"),
    (Options(layout="tuner", min_nodes=1), "--min-nodes 1 with layout tuner"),
])
def test_options_that_do_not_fit_the_tuner_are_refused_before_start(options: Options, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        validate(options)


def test_the_documented_plan_is_what_the_launcher_prints() -> None:
    """docs/tuner.md's --plan command and its table (the header's job id is the launcher's PID)."""
    import subprocess
    import sys

    from docs_blocks import REPO, command_lines, docs_block

    [command] = command_lines("tuner-plan")
    assert command[:3] == ["python", "-m", "keras_distrib.local"]
    result = subprocess.run([sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    header, *table = result.stdout.strip().splitlines()
    assert header.startswith("local job ") and header.endswith(": layout tuner, 2 node(s), 5 process(es), protocol grpc")
    assert table == docs_block("tuner-plan-output").splitlines()


@pytest.mark.parametrize("signum, code", [(2, 130), (10, 75), (15, 75)])
def test_a_stop_signal_ends_a_search_process_with_its_code_even_if_the_exception_is_lost(
        monkeypatch: pytest.MonkeyPatch, signum: int, code: int) -> None:
    """SIGINT: 130; SIGUSR1/SIGTERM: 75 (a requeue). A timer ends the process with the same code
    if the SystemExit is dropped (raised inside a gc callback, as seen with Ctrl-C)."""
    from keras_distrib import tuning

    timers = []

    class FakeTimer:
        def __init__(self, seconds, fn, args):
            timers.append((seconds, fn, args))
            self.daemon = False

        def start(self) -> None:
            assert self.daemon, "the timer must not keep a finished process alive"

    monkeypatch.setattr(tuning.threading, "Timer", FakeTimer)
    with pytest.raises(SystemExit) as stopped:
        tuning._stop(signum, None)
    assert stopped.value.code == code
    assert timers == [(tuning.STOP_GRACE, tuning.os._exit, (code,))]


@pytest.mark.parametrize("fixture, module", [("slurm_gpu_step", "keras_distrib.slurm"), ("pbs_job", "keras_distrib.pbs"),
                                             ("sge_job", "keras_distrib.sge"), ("lsf_jsrun_r1_a1", "keras_distrib.lsf")])
def test_every_scheduler_plans_the_oracle_and_its_trial_workers(fixture: str, module: str) -> None:
    """Environments recorded from (or copied from the documentation of) each scheduler."""
    import json

    from _unit_helpers import fixture_env, run_cli

    result = run_cli(fixture_env(fixture), "--layout", "tuner", "--plan", "--format", "json", module=module)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    ids = [p["env"][contract.TUNER_ID_VAR] for p in plan["processes"]]
    assert ids[0] == "chief" and ids[1:] == [f"tuner{i}" for i in range(len(ids) - 1)] and len(ids) >= 3
    first = plan["processes"][0]
    assert {p["env"][contract.ORACLE_IP_VAR] + ":" + p["env"][contract.ORACLE_PORT_VAR] for p in plan["processes"]} \
        == {first["address"]}
    assert {p["node"] for p in plan["processes"][1:]} == set(plan["nodes"]), "a trial worker on every node"


def test_the_oracle_names_each_ended_trial_its_worker_and_where_a_failure_is(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from keras_distrib import tuning

    done = SimpleNamespace(score=0.91, status="COMPLETED")
    failed = SimpleNamespace(score=None, status="FAILED")
    oracle = SimpleNamespace(trials={"03": done, "04": failed}, max_trials=6, end_order=["00", "01", "02", "03"],
                             objective=SimpleNamespace(name="val_accuracy"),
                             get_best_trials=lambda n: [SimpleNamespace(score=0.95)])
    with caplog.at_level("INFO", logger="keras_distrib.tuning"):
        tuning._report({"tuner1": "n2"}, oracle, "tuner1", "03")
        tuning._report({"tuner1": "n2"}, oracle, "tuner2", "04")
    assert [r.getMessage() for r in caplog.records] == [
        "trial 03 completed on tuner1 (n2): val_accuracy 0.91 (best 0.95); trials ended: 4 of 6",
        "trial 04 failed on tuner2 (its error is in tuner-2.log): val_accuracy no score (best 0.95); trials ended: 4 of 6",
    ]
