"""`python -m keras_distrib[.slurm|.pbs|.sge|.lsf] --plan` as users and scripts run it: a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _unit_helpers import FIXTURES, clean_env, fixture_env, run_cli

from keras_distrib.launcher.options import Options

PROCESS_KEYS = {"node", "job", "index", "address", "gpus"}
PLAN_KEYS = {"scheduler", "job_id", "nodes", "layout", "cluster", "processes"}

# A real 3-node step started with one task per node (the recorded one had two).
ONE_TASK_PER_NODE = {"SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3",
                     "SLURM_TASKS_PER_NODE": "1(x3)"}
SLURM_STEP = fixture_env("slurm_step_task0", **ONE_TASK_PER_NODE)
STATIC = {"KERAS_DISTRIB_HOSTS_FILE": str(FIXTURES / "static_hosts.yaml")}


def plan_json(env: dict[str, str], *args: str, module: str = "keras_distrib") -> dict[str, Any]:
    result = run_cli(env, "--plan", "--format", "json", *args, module=module)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    plan = json.loads(result.stdout)  # fails on anything but exactly one JSON document
    assert isinstance(plan, dict)
    return plan


def check_plan_shape(plan: dict[str, Any]) -> None:
    assert PLAN_KEYS <= set(plan)
    assert all(isinstance(plan[k], str) for k in ("scheduler", "job_id", "layout"))
    addresses = []
    for proc in plan["processes"]:
        assert set(proc) == PROCESS_KEYS
        assert proc["node"] in plan["nodes"]
        assert isinstance(proc["index"], int) and all(isinstance(g, str) for g in proc["gpus"])
        assert plan["cluster"][proc["job"]][proc["index"]] == proc["address"]
        addresses.append(proc["address"])
    assert sorted(addresses) == sorted(a for job in plan["cluster"].values() for a in job)


@pytest.mark.parametrize(
    ("module", "env", "scheduler", "job_id", "nodes", "gpus"),
    [
        ("keras_distrib.slurm", SLURM_STEP, "slurm", "113", ["n1", "n2", "n3"], []),
        ("keras_distrib", SLURM_STEP, "slurm", "113", ["n1", "n2", "n3"], []),
        ("keras_distrib.slurm", fixture_env("slurm_sbatch"), "slurm", "114", ["n1", "n2"], []),
        ("keras_distrib.slurm", fixture_env("slurm_gpu_step"), "slurm", "4711", ["gpu07", "gpu08"], ["2", "3"]),
        ("keras_distrib.pbs", fixture_env("pbs_job"), "pbs", "1234.server", ["cn07", "cn03", "cn05"], []),
        ("keras_distrib", fixture_env("pbs_job"), "pbs", "1234.server", ["cn07", "cn03", "cn05"], []),
        ("keras_distrib.sge", fixture_env("sge_job"), "sge", "77", ["n1", "n2", "n3"], []),
        ("keras_distrib.lsf", fixture_env("lsf_mcpu"), "lsf", "5150", ["hostA", "hostB"], []),
        ("keras_distrib", STATIC, "static", "demo", ["ws-alpha", "ws-beta"], None),
    ],
)
def test_plan_json(module: str, env: dict[str, str], scheduler: str, job_id: str, nodes: list[str],
                   gpus: list[str] | None) -> None:
    plan = plan_json(env, module=module)
    check_plan_shape(plan)
    assert (plan["scheduler"], plan["job_id"], plan["nodes"], plan["layout"]) == (scheduler, job_id, nodes, "ps-per-node")
    assert [p["node"] for p in plan["processes"] if p["job"] == "worker"] == nodes
    if gpus is not None:
        assert all(p["gpus"] == gpus for p in plan["processes"] if p["job"] == "worker")


def test_every_rank_prints_the_same_plan() -> None:
    last = fixture_env("slurm_step_task5", **ONE_TASK_PER_NODE, SLURM_PROCID="2", SLURM_LOCALID="0")
    outputs = {run_cli(env, "--plan", "--format", "json", module="keras_distrib.slurm").stdout for env in (SLURM_STEP, last)}
    assert len(outputs) == 1


def test_plan_table() -> None:
    env = fixture_env("slurm_gpu_step")
    result = run_cli(env, "--plan", module="keras_distrib.slurm")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["NODE", "JOB", "INDEX", "ADDRESS", "GPUS"]
    expected = [[p["node"], p["job"], str(p["index"]), p["address"], ",".join(p["gpus"]) or "-"]
                for p in plan_json(env, module="keras_distrib.slurm")["processes"]]
    assert [line.split() for line in lines[2:-1]] == expected
    assert "4711" in lines[0] and "ps-per-node" in lines[0]
    assert lines[-1] == "ports: the block derived from job id 4711 (24220-24239; taken on a node, the job moves to a fallback block)"


@pytest.mark.parametrize("layout", ["ps-per-node", "worker-per-gpu", "allreduce"])
def test_layout_flag(layout: str) -> None:
    plan = plan_json(fixture_env("slurm_gpu_step"), "--layout", layout)
    check_plan_shape(plan)
    assert plan["layout"] == layout


def test_option_precedence(tmp_path: Path) -> None:
    config = tmp_path / "kd.yaml"
    config.write_text("layout: worker-per-gpu\nport-base: 21000\n")
    from_file = plan_json(SLURM_STEP, "--config", str(config))
    assert from_file["layout"] == "worker-per-gpu" and from_file["cluster"]["chief"] == ["n1:21000"]
    env_port = plan_json({**SLURM_STEP, "KERAS_DISTRIB_PORT_BASE": "22000"}, "--config", str(config))
    assert env_port["cluster"]["chief"] == ["n1:22000"]  # the environment beats the file
    flags = plan_json({**SLURM_STEP, "KERAS_DISTRIB_PORT_BASE": "22000"}, "--config", str(config),
                      "--port-base", "23000", "--layout", "allreduce")
    assert flags["layout"] == "allreduce" and flags["cluster"]["worker"][0] == "n1:23000"  # flags beat both


# --- bad input: one line, the variable and its value, a HINT, exit code 2 -------------

STEP = {"SLURM_JOB_ID": "113", "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "1(x3)"}
UNEQUAL_GPUS = "hosts:\n  - {name: ga, gpus: [0, 1]}\n  - {name: gb, gpus: [0]}\n"

BAD_INPUT = [
    # (id, module, env, extra args, texts the error line must contain); {tmp} is a scratch folder
    ("no-slurm-job", "keras_distrib.slurm", {}, [], ["SLURM_JOB_ID", "srun"]),
    ("no-scheduler", "keras_distrib", {}, [], ["no scheduler detected", "KERAS_DISTRIB_SCHEDULER"]),
    ("unknown-scheduler", "keras_distrib", {"KERAS_DISTRIB_SCHEDULER": "flux"}, [],
     ["KERAS_DISTRIB_SCHEDULER='flux'", "slurm, lsf, sge, pbs, static"]),
    ("hostlist-unbalanced", "keras_distrib.slurm", {**STEP, "SLURM_STEP_NODELIST": "n[1-"}, [], ["SLURM_STEP_NODELIST='n[1-'"]),
    ("hostlist-descending", "keras_distrib.slurm", {**STEP, "SLURM_STEP_NODELIST": "n[3-1]"}, [],
     ["SLURM_STEP_NODELIST='n[3-1]'"]),
    ("tasks-length", "keras_distrib.slurm", {**STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, [],
     ["SLURM_STEP_TASKS_PER_NODE='1(x2)'", "SLURM_STEP_NODELIST has 3"]),
    ("tasks-malformed", "keras_distrib.slurm", {**STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x"}, [],
     ["SLURM_STEP_TASKS_PER_NODE='2(x'"]),
    ("too-many-tasks", "keras_distrib.slurm", {**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, [],
     ["SLURM_STEP_TASKS_PER_NODE='4(x3)'", "--ntasks-per-node=1"]),
    ("real-step-allreduce", "keras_distrib.slurm", fixture_env("slurm_step_task0"), ["--layout", "allreduce"],
     ["SLURM_STEP_TASKS_PER_NODE='2(x3)'", "--ntasks-per-node=1"]),
    ("unequal-gpus", "keras_distrib", {"KERAS_DISTRIB_HOSTS_FILE": "{tmp}/gpus.yaml"}, [],
     ["ga=2, gb=1", "ps-per-node", "worker-per-gpu"]),
    ("port-exhausted", "keras_distrib.slurm", STEP, ["--port-base", "65535"], ["KERAS_DISTRIB_PORT_BASE=65535", "--port-base"]),
    ("port-too-low", "keras_distrib.slurm", STEP, ["--port-base", "80"], ["KERAS_DISTRIB_PORT_BASE=80", "1024-65535", "--port-base"]),
    ("port-env-too-high", "keras_distrib.slurm", {**STEP, "KERAS_DISTRIB_PORT_BASE": "70000"}, [],
     ["70000", "1024-65535", "KERAS_DISTRIB_PORT_BASE"]),
    ("port-env-not-int", "keras_distrib.slurm", {**STEP, "KERAS_DISTRIB_PORT_BASE": "abc"}, [],
     ["KERAS_DISTRIB_PORT_BASE='abc'"]),
    ("pbs-no-nodefile", "keras_distrib.pbs", {"PBS_JOBID": "12.srv"}, [], ["PBS_NODEFILE is not set"]),
    ("pbs-missing-nodefile", "keras_distrib.pbs", {"PBS_JOBID": "12.srv", "PBS_NODEFILE": "{tmp}/nodes"}, [],
     ["PBS_NODEFILE='{tmp}/nodes' cannot be read"]),
    ("pbs-nodefile-is-dir", "keras_distrib.pbs", {"PBS_JOBID": "12.srv", "PBS_NODEFILE": "{tmp}"}, [],
     ["PBS_NODEFILE='{tmp}' cannot be read"]),
    ("sge-no-hostfile", "keras_distrib.sge", {"JOB_ID": "7", "SGE_ROOT": "/x"}, [], ["PE_HOSTFILE is not set", "qsub -pe"]),
    ("sge-missing-hostfile", "keras_distrib.sge", {"JOB_ID": "7", "PE_HOSTFILE": "{tmp}/pe"}, [],
     ["PE_HOSTFILE='{tmp}/pe' cannot be read"]),
    ("lsf-bad-hosts", "keras_distrib.lsf", {"LSB_JOBID": "9", "LSB_MCPU_HOSTS": "hostA four"}, [],
     ["LSB_MCPU_HOSTS='hostA four'"]),
    ("config-unknown-key", "keras_distrib.slurm", STEP, ["--config", "{tmp}/kd.yaml"],
     ["'layuot'", *Options.keys()]),
    ("config-missing", "keras_distrib.slurm", STEP, ["--config", "{tmp}/none.yaml"], ["--config '{tmp}/none.yaml'"]),
    # The refused config values docs/reference/cli.md names.
    ("config-layout-int", "keras_distrib.slurm", STEP, ["--config", "{tmp}/layout.yaml"], ["layout=5", "layout: ps-per-node"]),
    ("config-port-float", "keras_distrib.slurm", STEP, ["--config", "{tmp}/port.yaml"], ["port-base=25000.0", "an integer"]),
    ("config-timeout-inf", "keras_distrib.slurm", STEP, ["--config", "{tmp}/inf.yaml"], ["startup-timeout=inf", "finite"]),
    ("config-no-value", "keras_distrib.slurm", STEP, ["--config", "{tmp}/novalue.yaml"], ["'interface' no value"]),
    ("config-binary", "keras_distrib.slurm", STEP, ["--config", "{tmp}/binary.yaml"], ["is not valid YAML"]),
    ("config-unknown-scheduler", "keras_distrib", STEP, ["--config", "{tmp}/flux.yaml"], ["scheduler='flux'", "slurm, lsf"]),
    ("config-scheduler-contradicts-entry", "keras_distrib.slurm", STEP, ["--config", "{tmp}/pbs.yaml"],
     ["'pbs'", "keras_distrib.slurm", "--scheduler pbs"]),
    ("flag-scheduler-contradicts-entry", "keras_distrib.slurm", STEP, ["--scheduler", "sge"], ["--scheduler is 'sge'"]),
    ("env-scheduler-contradicts-entry", "keras_distrib.slurm", {**STEP, "KERAS_DISTRIB_SCHEDULER": "pbs"}, [],
     ["KERAS_DISTRIB_SCHEDULER='pbs'", "keras_distrib.slurm", "unset KERAS_DISTRIB_SCHEDULER"]),
    ("config-scheduler-in-local", "keras_distrib.local", {}, ["--config", "{tmp}/pbs.yaml"], ["does nothing", "keras_distrib.local"]),
    ("min-nodes-above-nodes", "keras_distrib.slurm", STEP, ["--min-nodes", "9"], ["min-nodes=9", "--min-nodes"]),
    ("config-min-nodes-zero", "keras_distrib.slurm", STEP, ["--config", "{tmp}/min0.yaml"], ["min-nodes=0", ">= 1"]),
    ("join-under-pbs", "keras_distrib.pbs", {"PBS_JOBID": "12.srv"}, ["--join"], ["--join", "not supported under pbs"]),
    ("join-node-not-in-job", "keras_distrib.slurm", {**STEP, "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n9"},
     ["--join"], ["SLURMD_NODENAME='n9' is not in SLURM_JOB_NODELIST='n[1-3]'", "-w NODE"]),
    ("join-outside-a-job-step", "keras_distrib.slurm", {"SLURM_JOB_ID": "113", "SLURM_JOB_NODELIST": "n[1-3]"},
     ["--join"], ["SLURMD_NODENAME", "srun --jobid="]),
    ("static-tasks-not-int", "keras_distrib", {"KERAS_DISTRIB_HOSTS_FILE": "{tmp}/two.yaml"}, [],
     ["tasks_per_node 'two'", "tasks_per_node: 1"]),
]
CONFIG_FILES = {
    "kd.yaml": "layout: allreduce\nlayuot: allreduce\n", "layout.yaml": "layout: 5\n", "port.yaml": "port-base: 25000.0\n",
    "inf.yaml": "startup-timeout: .inf\n", "novalue.yaml": "interface:\n", "flux.yaml": "scheduler: flux\n",
    "pbs.yaml": "scheduler: pbs\n", "min0.yaml": "min-nodes: 0\n", "two.yaml": "hosts: [a, b]\ntasks_per_node: two\n",
}


@pytest.mark.parametrize(("module", "env", "args", "expected"), [case[1:] for case in BAD_INPUT],
                         ids=[case[0] for case in BAD_INPUT])
def test_bad_input(tmp_path: Path, module: str, env: dict[str, str], args: list[str], expected: list[str]) -> None:
    (tmp_path / "gpus.yaml").write_text(UNEQUAL_GPUS)
    for name, text in CONFIG_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    fill = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    result = run_cli(fill, "--plan", "--format", "json", *(a.replace("{tmp}", str(tmp_path)) for a in args), module=module)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("keras_distrib: error: ") and " HINT: " in line
    for text in expected:
        assert text.replace("{tmp}", str(tmp_path)) in line


def test_scheduler_key_forces_the_parser(tmp_path: Path) -> None:
    """`scheduler: pbs` in --config is used (it was silently ignored): config < env < flag."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1\ncn1\ncn2\n")
    both = {**STEP, "PBS_JOBID": "3.srv", "PBS_NODEFILE": str(nodefile)}  # Slurm would be detected first
    (tmp_path / "pbs.yaml").write_text("scheduler: pbs\n")
    config = ["--config", str(tmp_path / "pbs.yaml")]
    assert plan_json(both)["scheduler"] == "slurm"
    assert plan_json(both, *config)["scheduler"] == "pbs"
    assert plan_json({**both, "KERAS_DISTRIB_SCHEDULER": "slurm"}, *config)["scheduler"] == "slurm"
    assert plan_json({**both, "KERAS_DISTRIB_SCHEDULER": "slurm"}, *config, "--scheduler", "pbs")["scheduler"] == "pbs"
    assert plan_json(both, *config, module="keras_distrib.pbs")["nodes"] == ["cn1", "cn2"]


def test_only_rank_zero_of_a_step_prints_a_step_wide_error() -> None:
    """Every task of `srun --ntasks-per-node=2` fails the same check: one line, not six."""
    outputs = [run_cli(fixture_env(name), "--layout", "allreduce", "x.py", module="keras_distrib.slurm")
               for name in ("slurm_step_task0", "slurm_step_task5")]
    assert [o.returncode for o in outputs] == [2, 2]
    assert outputs[0].stderr.startswith("keras_distrib: error: ") and "--ntasks-per-node=1" in outputs[0].stderr
    assert outputs[1].stderr == "" and outputs[1].stdout == ""


def test_first_task_of_each_node_prints_a_machine_error() -> None:
    """Checks of this machine (here: the script path) may differ per node: local rank 0 reports."""
    env = fixture_env("slurm_step_task5", **ONE_TASK_PER_NODE, SLURM_PROCID="2", SLURM_LOCALID="0")
    result = run_cli(env, "no-such-script.py", module="keras_distrib.slurm")
    assert result.returncode == 2
    assert result.stderr.startswith("keras_distrib: error: SCRIPT 'no-such-script.py' does not exist")


# --- TensorFlow-free and fast enough for 10,000 nodes --------------------------------

HEAVY = {"tensorflow", "keras", "tf_keras"}


def test_plan_path_never_imports_tensorflow() -> None:
    result = run_cli(SLURM_STEP, "--plan", "--format", "json", module="keras_distrib.slurm", python_flags=("-X", "importtime"))
    assert result.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert {"cluster_parsers", "keras_distrib.plan", "hostlist"} <= imported  # the probe sees imports
    assert not {name for name in imported if name.split(".")[0] in HEAVY}


def test_importing_the_packages_never_imports_tensorflow() -> None:
    code = ("import sys, cluster_parsers, keras_distrib, keras_distrib.plan, keras_distrib.launcher.cli, keras_distrib.launcher.options\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HEAVY)!r})\n"
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], env=clean_env({}), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_ten_thousand_nodes() -> None:
    env = {"SLURM_JOB_ID": "98765", "SLURM_STEP_NODELIST": "n[00001-10000]", "SLURM_STEP_TASKS_PER_NODE": "1(x10000)",
           "SLURM_STEP_NUM_TASKS": "10000", "SLURM_PROCID": "9999", "SLURM_NODEID": "9999", "SLURMD_NODENAME": "n10000"}
    plan = plan_json(env, module="keras_distrib.slurm")
    assert len(plan["nodes"]) == 10000 and plan["nodes"][0] == "n00001" and plan["nodes"][-1] == "n10000"
    assert [len(plan["cluster"][j]) for j in ("chief", "ps", "worker")] == [1, 10000, 10000]
    assert len(plan["processes"]) == 20001


@pytest.mark.parametrize(("mode", "check", "expected"), [
    ("agent", True, "--min-nodes does nothing with the cluster check"),
    ("per-role", False, "--min-nodes needs one agent per node"),
    ("agent", False, None),
])
def test_min_nodes_needs_an_agent_per_node_and_a_script(mode: str, check: bool, expected: str | None) -> None:
    from cluster_parsers import ClusterConfigError, JobInfo
    from keras_distrib.launcher.cli import check_min_nodes

    job = JobInfo("slurm", "5", ("n1", "n2", "n3"), (1, 1, 1))
    if expected is None:
        check_min_nodes(Options(min_nodes=3), job, mode, check)  # accepted
        return
    with pytest.raises(ClusterConfigError, match=expected) as raised:
        check_min_nodes(Options(min_nodes=2), job, mode, check)
    assert " HINT: " in str(raised.value)


@pytest.mark.parametrize(("options", "node_index", "expected"), [
    (Options(), 2, "--join takes a node into a running elastic job, and this one has no --min-nodes"),
    (Options(min_nodes=2), 0, "--join on n1, the job's first node"),
    (Options(min_nodes=2), 2, None),
])
def test_join_needs_min_nodes_and_another_node_than_the_first(options: Options, node_index: int,
                                                              expected: str | None) -> None:
    from cluster_parsers import ClusterConfigError, JobInfo
    from keras_distrib.launcher.cli import check_join

    job = JobInfo("slurm", "5", ("n1", "n2", "n3"), (1, 1, 1), node_index=node_index)
    if expected is None:
        check_join(options, job)
        return
    with pytest.raises(ClusterConfigError, match=expected) as raised:
        check_join(options, job)
    assert " HINT: " in str(raised.value)


def test_every_default_the_help_states_is_the_options_default() -> None:
    """The CLI reference is generated from these help strings: a stated default must be the code's."""
    import re

    from keras_distrib.checkpoint_interval import DEFAULT_EVERY
    from keras_distrib.launcher.cli import arg_parser
    from keras_distrib.launcher.options import Options

    defaults = {**{f.replace("-", "_"): getattr(Options(), f.replace("-", "_")) for f in Options.keys()},
                "checkpoint_every": DEFAULT_EVERY}
    stated = 0
    for action in arg_parser("x", local=True)._actions:
        match = re.search(r"\(default ([\w.-]+)", action.help or "")
        if match is None or action.dest not in defaults or defaults[action.dest] is None:
            continue  # None: a default the help describes in words (the port block from the job id)
        stated += 1
        want = defaults[action.dest]
        assert match.group(1) == (f"{want:g}" if isinstance(want, float) else str(want)), (action.dest, action.help)
    assert stated >= 6  # startup-timeout, shutdown-grace, heartbeat-timeout, max-restarts, hang-timeout, checkpoint-every
