"""The jax layouts: who runs where, and the KERAS_DISTRIBUTION_* / JAX_* variables of each process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _unit_helpers import FIXTURES, fixture_env, run_cli

from cluster_parsers import ClusterConfigError, JobInfo
from keras_distrib import contract
from keras_distrib.contract import jax_variables as jax_env
from keras_distrib.plan import build_plan

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit

STATIC = {"KERAS_DISTRIB_HOSTS_FILE": str(FIXTURES / "static_hosts.yaml")}


def plan_json(env: dict[str, str], *args: str, module: str = "keras_distrib") -> tuple[dict[str, Any], str]:
    result = run_cli(env, "--plan", "--format", "json", *args, module=module)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def job(gpus: tuple[str, ...], nodes: int = 2) -> JobInfo:
    names = tuple(f"n{i + 1}" for i in range(nodes))
    return JobInfo("slurm", "113", names, (1,) * nodes, node_gpus=(gpus,) * nodes)


@pytest.mark.parametrize(
    ("layout", "gpus", "expected"),
    [
        ("jax", ("2", "3"), [("n1", 0, ("2", "3")), ("n2", 1, ("2", "3"))]),
        ("jax", (), [("n1", 0, ()), ("n2", 1, ())]),
        ("jax-per-gpu", ("2", "3"), [("n1", 0, ("2",)), ("n1", 1, ("3",)), ("n2", 2, ("2",)), ("n2", 3, ("3",))]),
        ("jax-per-gpu", (), [("n1", 0, ()), ("n2", 1, ())]),  # a CPU-only node still gets one process
    ],
)
def test_jax_layouts_run_the_script_everywhere(layout: str, gpus: tuple[str, ...], expected: list[Any]) -> None:
    plan = build_plan(job(gpus), layout)
    assert [(p.node, p.index, p.gpus) for p in plan.processes] == expected
    assert {p.job for p in plan.processes} == {"worker"}  # no chief, no ps
    assert plan.script_runners == list(plan.processes)
    assert len({p.port for p in plan.processes if p.host == "n1"}) == sum(p.host == "n1" for p in plan.processes)


def test_jax_env_per_process() -> None:
    plan = build_plan(job(("2", "3"), nodes=3), "jax")
    envs = [jax_env(plan, p) for p in plan.processes]
    first = plan.processes[0].address
    assert [e["KERAS_DISTRIBUTION_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
    assert {e["KERAS_DISTRIBUTION_NUM_PROCESSES"] for e in envs} == {"3"}
    assert {e["KERAS_DISTRIBUTION_JOB_ADDRESSES"] for e in envs} == {first}  # the coordinator: process 0
    assert {e["KERAS_BACKEND"] for e in envs} == {"jax"}
    # CUDA_VISIBLE_DEVICES=2,3 renumbers the GPUs 0,1 inside the process: JAX sees both.
    assert {e["JAX_LOCAL_DEVICE_IDS"] for e in envs} == {"0,1"}
    assert not any("JAX_COORDINATOR_BIND_ADDRESS" in e for e in envs)  # a node name: JAX's default [::]
    assert jax_env(build_plan(job(("2", "3")), "allreduce"), plan.processes[0]) == {}


def test_coordinator_binds_to_the_chosen_address() -> None:
    plan = build_plan(job(()), "jax", hosts={"n1": "10.1.0.1", "n2": "10.1.0.2"})
    envs = [jax_env(plan, p) for p in plan.processes]
    assert envs[0]["JAX_COORDINATOR_BIND_ADDRESS"] == envs[0]["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == plan.processes[0].address
    assert "JAX_COORDINATOR_BIND_ADDRESS" not in envs[1]
    assert "JAX_LOCAL_DEVICE_IDS" not in envs[0]  # CPU-only: nothing to restrict


@pytest.mark.parametrize(
    ("module", "env", "nodes", "gpu_ids"),
    [
        ("keras_distrib.pbs", fixture_env("pbs_job", CUDA_VISIBLE_DEVICES="2,3"), ["cn07", "cn03", "cn05"], "0,1"),
        ("keras_distrib.pbs", fixture_env("pbs_job"), ["cn07", "cn03", "cn05"], None),
        ("keras_distrib.sge", fixture_env("sge_job", CUDA_VISIBLE_DEVICES="0"), ["n1", "n2", "n3"], "0"),
        ("keras_distrib.lsf", fixture_env("lsf_mcpu", CUDA_VISIBLE_DEVICES="1,2,3"), ["hostA", "hostB"], "0,1,2"),
        ("keras_distrib.lsf", fixture_env("lsf_mcpu"), ["hostA", "hostB"], None),
        ("keras_distrib.slurm", fixture_env("slurm_gpu_step"), ["gpu07", "gpu08"], "0,1"),
        ("keras_distrib", STATIC, ["ws-alpha", "ws-beta"], "0,1"),  # the host file gives each host 2 GPUs
    ],
)
def test_plan_json_has_each_process_env(module: str, env: dict[str, str], nodes: list[str], gpu_ids: str | None) -> None:
    plan, _ = plan_json(env, "--layout", "jax", module=module)
    assert plan["layout"] == "jax" and plan["nodes"] == nodes
    procs = plan["processes"]
    assert [p["node"] for p in procs] == nodes
    for index, proc in enumerate(procs):
        assert proc["env"]["KERAS_DISTRIBUTION_PROCESS_ID"] == str(index)
        assert proc["env"]["KERAS_DISTRIBUTION_NUM_PROCESSES"] == str(len(nodes))
        assert proc["env"]["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == procs[0]["address"]
        assert proc["env"].get("JAX_LOCAL_DEVICE_IDS") == gpu_ids


def test_keras_backend_jax_selects_the_jax_layout_with_one_line() -> None:
    plan, stderr = plan_json(dict(fixture_env("pbs_job"), KERAS_BACKEND="jax"), module="keras_distrib.pbs")
    assert plan["layout"] == "jax"
    assert stderr.strip() == "keras_distrib: KERAS_BACKEND=jax and no --layout given: using --layout jax."
    explicit, stderr = plan_json(dict(fixture_env("pbs_job"), KERAS_BACKEND="jax"), "--layout", "allreduce",
                                 module="keras_distrib.pbs")
    assert explicit["layout"] == "allreduce" and not stderr.strip()


def test_jax_per_gpu_with_one_task_per_gpu() -> None:
    """srun --ntasks-per-node=2 with 2 GPUs per node: per-role mode, one process per task."""
    env = fixture_env("slurm_gpu_step")
    plan, _ = plan_json(env, "--layout", "jax-per-gpu", module="keras_distrib.slurm")
    assert [(p["node"], p["gpus"], p["env"].get("JAX_LOCAL_DEVICE_IDS")) for p in plan["processes"]] == [
        ("gpu07", ["2"], "0"), ("gpu07", ["3"], "0"), ("gpu08", ["2"], "0"), ("gpu08", ["3"], "0")]


def job_env(layout: str, index: int, directory: Path) -> dict[str, str]:
    """What the agent passes to worker ``index`` (contract.py), the plan file in ``directory``."""
    plan = build_plan(job(()), layout)
    proc = plan.find("worker", index)
    plan_file = contract.write_plan_file(json.dumps(plan.to_json()), str(directory))
    return contract.child_env({}, plan, proc, plan_file, startup_timeout=180.0)


def test_inside_script_the_tensorflow_helpers_refuse_the_jax_layout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from keras_distrib.jax_distribution import distribution
    from keras_distrib.strategies import NotInJobError, cluster, strategy

    for key, value in job_env("jax", 1, tmp_path).items():
        monkeypatch.setenv(key, value)
    info = cluster()
    assert (info.layout, info.index, info.is_chief) == ("jax", 1, False)
    with pytest.raises(NotInJobError, match=r"HINT: call keras_distrib.distribution\(\) before building the model"):
        strategy()  # keras_distrib.fit resolves its strategy through this
    for key, value in job_env("allreduce", 0, tmp_path).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(NotInJobError, match="HINT: launch with --layout jax"):
        distribution()


def test_process_0_is_the_one_that_writes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from keras_distrib.jax_distribution import chief_path
    from keras_distrib.strategies import cluster

    for key, value in job_env("jax", 0, tmp_path).items():
        monkeypatch.setenv(key, value)
    assert cluster().is_chief and chief_path("out/model.keras") == "out/model.keras"
    for key, value in job_env("jax", 1, tmp_path).items():
        monkeypatch.setenv(key, value)
    elsewhere = chief_path("out/model.keras")
    assert elsewhere != "out/model.keras" and elsewhere.endswith("/model.keras")


def test_unequal_gpus_need_jax_per_gpu() -> None:
    from cluster_parsers import ClusterConfigError

    unequal = JobInfo("slurm", "113", ("n1", "n2"), (1, 1), node_gpus=(("0", "1"), ("0",)))
    with pytest.raises(ClusterConfigError, match="use --layout jax-per-gpu"):
        build_plan(unequal, "jax")
    assert [p.gpus for p in build_plan(unequal, "jax-per-gpu").processes] == [("0",), ("1",), ("0",)]


@pytest.mark.parametrize("env, keras_json, layout, refused", [
    ({"KERAS_BACKEND": "jax"}, None, "ps-per-node", None),  # asynchronous ps on JAX (trainers/jax_ps)
    ({"KERAS_BACKEND": "torch"}, None, "ps-per-node", "Keras will run on torch (KERAS_BACKEND=torch), but layout ps-per-node"),
    ({"KERAS_BACKEND": "torch"}, None, "allreduce", "Keras will run on torch (KERAS_BACKEND=torch), but layout allreduce"),
    ({"KERAS_BACKEND": "jax"}, None, "allreduce", "Keras will run on jax (KERAS_BACKEND=jax), but layout allreduce"),
    ({}, "jax", "allreduce", "Keras will run on jax (backend in "),
    ({}, "jax", "worker-per-gpu", None),
    ({"KERAS_BACKEND": "tensorflow"}, None, "jax", "KERAS_BACKEND=tensorflow, but layout jax runs Keras on JAX"),
    ({"KERAS_BACKEND": "tensorflow"}, "jax", "ps-per-node", None),  # the variable wins, as in Keras
    ({}, "tensorflow", "jax-per-gpu", None),  # the file Keras writes by default is no choice
    ({"KERAS_BACKEND": "jax"}, None, "jax", None),
    ({"KERAS_BACKEND": "jax"}, None, "tuner", None),
    ({"KERAS_BACKEND": "torch"}, None, "tuner", None),
    ({}, None, "ps-per-node", None),
])
def test_a_backend_that_does_not_fit_the_layout_is_refused_before_start(tmp_path: Path, env: dict, keras_json: str | None,
                                                                         layout: str, refused: str | None) -> None:
    from keras_distrib.launcher.options import check_backend

    if keras_json:
        (tmp_path / "keras.json").write_text(json.dumps({"backend": keras_json, "floatx": "float32"}))
    environ = {"KERAS_HOME": str(tmp_path), **env}
    if refused is None:
        check_backend(layout, environ)
        return
    with pytest.raises(ClusterConfigError, match=re.escape(refused)) as err:
        check_backend(layout, environ)
    assert "--layout" in err.value.hint or "KERAS_BACKEND" in err.value.hint


def test_the_launcher_refuses_it_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    run = subprocess.run([sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--layout", "allreduce",
                          str(script)], env={**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "keras_distrib: error: Keras will run on jax (KERAS_BACKEND=jax), but layout allreduce trains with "
        "TensorFlow's tf.distribute. HINT: use --layout jax (synchronous, keras.distribution) or ps-per-node "
        "(asynchronous) for Keras on JAX, or --layout tuner for a KerasTuner search; or set KERAS_BACKEND=tensorflow "
        "for layout allreduce."]
