"""Environments copied from the schedulers' documentation and other projects' tests (issue 12).

Each fixture's ``source`` names where its variables come from. Every launch command that a
HINT recommends is run here with the environment that command produces, so no HINT can
recommend something the parser refuses.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from _unit_helpers import FIXTURES, REPO, fixture_env, run_cli

from cluster_parsers import (
    ClusterConfigError,
    ClusterParser,
    JobInfo,
    LsfParser,
    PbsParser,
    SgeParser,
    SlurmParser,
    StaticParser,
    parse_job,
)
from keras_distrib.plan import build_plan, tasks_mode

LAYOUTS = ("ps-per-node", "worker-per-gpu", "allreduce")


def fixture_source(name: str) -> str:
    return json.loads((FIXTURES / f"{name}.json").read_text())["source"]


def mode_of(parser: ClusterParser, job: JobInfo, layout: str) -> str:
    return tasks_mode(job, build_plan(job, layout), parser.agent_launch_hint)


# --- the six defects of issue 12, one fixture each ---------------------------------------


def test_gpu_ids_under_device_cgroups() -> None:
    # sbatch(1): SLURM_JOB_GPUS is "not relative to any device cgroup"; under
    # ConstrainDevices=yes CUDA_VISIBLE_DEVICES holds the ids the process can open.
    assert "ConstrainDevices" in fixture_source("slurm_cgroup_gpus")
    job = parse_job(environ=fixture_env("slurm_cgroup_gpus"))
    assert (job.nodes, job.gpus) == (("gpu1",), ("0",))


def test_gpu_ids_without_cgroups_agree() -> None:
    env = fixture_env("slurm_cgroup_gpus", SLURM_JOB_GPUS="0")
    assert parse_job(environ=env).gpus == ("0",)


def test_lsf_launch_and_login_hosts_are_not_compute_nodes() -> None:
    # RADICAL-Pilot's LSF resource manager (Lassen) and Lightning's LSFEnvironment drop them.
    job = parse_job(environ=fixture_env("lsf_summit_job_script"))
    assert (job.nodes, job.tasks_per_node) == (("nodes1", "nodes2"), (20, 20))
    assert not job.tasks_launched  # the job script on the batch host
    plan = build_plan(job, "ps-per-node")
    assert {p.node for p in plan.processes} == {"nodes1", "nodes2"}


@pytest.mark.parametrize("rank", range(4))
def test_lsf_jsrun_with_a_launch_host_in_the_rank_file(rank: int) -> None:
    # Lightning's LSFEnvironment tests: a rank file of the launch host plus four hosts.
    env = fixture_env("lsf_jsrun_batch_plus_four", JSM_NAMESPACE_RANK=str(rank))
    job = parse_job(environ=env)
    assert job.nodes == ("h1", "h2", "h3", "h4")
    assert (job.tasks_per_node, job.node_index, job.local_rank) == ((1, 1, 1, 1), rank, 0)


@pytest.mark.parametrize("rank", range(2))
def test_lsf_jsrun_one_task_per_host_of_four_slots(rank: int) -> None:
    # IBM jsrun docs: -r1 -a1 is one task per host; our own HINT recommends it.
    assert "jsrun -r1 -a1" in fixture_source("lsf_jsrun_r1_a1")
    parser = LsfParser(fixture_env("lsf_jsrun_r1_a1", JSM_NAMESPACE_RANK=str(rank)))
    job = parser.parse()
    assert (job.nodes, job.node_index, job.local_rank) == (("hostA", "hostB"), rank, 0)
    assert job.tasks_launched and job.tasks_per_node == (1, 1)
    assert all(mode_of(parser, job, layout) == "agent" for layout in LAYOUTS)


def test_sge_host_in_two_queues_is_one_node() -> None:
    # sge_pe(5): one PE_HOSTFILE line per host and queue (a real file from an Open MPI bug report).
    job = parse_job(environ=fixture_env("sge_host_in_two_queues"))
    assert (job.nodes, job.tasks_per_node) == (("node01-53",), (16,))


@pytest.mark.parametrize("fixture", ["sge_mpirun_ppr1", "pbs_mpirun_ppr1"])
@pytest.mark.parametrize("rank", range(2))
def test_mpirun_one_rank_per_node_on_multi_slot_hosts(fixture: str, rank: int) -> None:
    # Open MPI mpirun(1): --map-by ppr:1:node sets OMPI_COMM_WORLD_SIZE=2, _LOCAL_SIZE=1.
    env = fixture_env(fixture, OMPI_COMM_WORLD_RANK=str(rank), PMIX_RANK=str(rank))
    job = parse_job(environ=env)
    assert job.nodes == ("node01", "node02")
    assert (job.rank, job.node_index, job.local_rank, job.tasks_per_node) == (rank, rank, 0, (1, 1))
    assert "OMPI_COMM_WORLD_SIZE=2" in job.tasks_source


def test_blanks_in_a_hostlist_separate_hosts() -> None:
    job = parse_job(environ=fixture_env("slurm_blank_hostlist"))
    assert job.nodes == ("alpha", "host5", "host6", "host7", "host8", "host9", "gamma")
    assert all(" " not in p.address for p in build_plan(job, "allreduce").processes)


def test_tasks_count_error_never_prints_none() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "3"}
    with pytest.raises(ClusterConfigError) as err:
        parse_job(environ=env)
    assert "None" not in str(err.value) and "SLURM_NTASKS=3" in str(err.value)


def test_heterogeneous_salloc_shell_is_the_whole_job() -> None:
    # Slurm heterogeneous_jobs.html: per-component variables end in _HET_GROUP_<n>; a salloc
    # shell on a login node has no SLURMD_NODENAME.
    job = parse_job(environ=fixture_env("slurm_het_salloc"))
    assert (job.nodes, job.node_components, job.tasks_launched) == (("n1", "n2", "n3"), (0, 1, 1), False)


def test_component_variables_without_the_component_count_say_what_is_missing() -> None:
    env = {k: v for k, v in fixture_env("slurm_het_salloc").items() if k != "SLURM_HET_SIZE"}
    with pytest.raises(ClusterConfigError) as err:
        parse_job(environ=env)
    message = str(err.value)
    assert "heterogeneous" in message and "SLURM_HET_SIZE" in message and "SLURM_JOB_NODELIST" in message
    assert "HINT: run inside the job's own shell, or start the agents with srun --het-group=0,1" in message


# --- the rule, for every scheduler ------------------------------------------------------

MULTI_SLOT = {  # a two-host allocation of 4 slots per host, as each scheduler writes it
    "pbs": {"PBS_JOBID": "5.s", "PBS_NODEFILE": str(FIXTURES / "pbs_nodefile_two_hosts_four_slots")},
    "sge": {"JOB_ID": "5", "PE_HOSTFILE": str(FIXTURES / "sge_two_hosts_four_slots"), "NSLOTS": "8"},
    "lsf": {"LSB_JOBID": "5", "LSB_MCPU_HOSTS": "node01 4 node02 4"},
    "slurm": {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"},
}


def open_mpi(rank: int, size: int, local_size: int) -> dict[str, str]:
    """What Open MPI's mpirun sets in rank ``rank`` (mapped by slot)."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "PMIX_RANK": str(rank),
    }


def hydra(rank: int, size: int, local_size: int) -> dict[str, str]:
    """What MPICH / Intel MPI's Hydra mpiexec sets (PMI)."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(rank % local_size),
            "MPI_LOCALNRANKS": str(local_size)}


@pytest.mark.parametrize("scheduler", sorted(MULTI_SLOT))
@pytest.mark.parametrize("launcher", [open_mpi, hydra])
@pytest.mark.parametrize(
    ("per_node", "expected_tasks"),
    [(None, (4, 4)), (1, (1, 1)), (2, (2, 2)), (4, (4, 4))],  # None: the job script, nothing launched
)
def test_one_rule_for_every_scheduler(scheduler: str, launcher, per_node: int | None, expected_tasks: tuple[int, ...]) -> None:
    if per_node is None:
        job = parse_job(scheduler, MULTI_SLOT[scheduler])
        assert (job.tasks_per_node, job.tasks_launched, job.node_index) == (expected_tasks, False, 0)
        return
    size = 2 * per_node
    for rank in range(size):
        job = parse_job(scheduler, {**MULTI_SLOT[scheduler], **launcher(rank, size, per_node)})
        assert job.tasks_launched and job.tasks_per_node == expected_tasks
        assert (job.rank, job.node_index, job.local_rank) == (rank, rank // per_node, rank % per_node)


@pytest.mark.parametrize("scheduler", sorted(MULTI_SLOT))
def test_a_launch_that_fits_neither_slots_nor_nodes_is_refused_with_the_agent_hint(scheduler: str) -> None:
    env = {**MULTI_SLOT[scheduler], **open_mpi(0, 3, 3)}
    with pytest.raises(ClusterConfigError) as err:
        parse_job(scheduler, env)
    assert "OMPI_COMM_WORLD_SIZE=3" in err.value.message
    assert err.value.hint.startswith("start one agent per")


def test_srun_step_wins_over_nothing_but_mpirun_daemons_do_not() -> None:
    # Open MPI's mpirun starts its daemons with srun --ntasks-per-node=1: the ranks inherit
    # the daemons' step variables (1 task per node) while mpirun started 4 per node.
    step = {**MULTI_SLOT["slurm"], "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_PROCID": "1", "SLURM_NODEID": "1"}
    job = parse_job("slurm", {**step, **open_mpi(5, 8, 4)})
    assert (job.tasks_per_node, job.rank, job.node_index, job.local_rank) == ((4, 4), 5, 1, 1)
    job = parse_job("slurm", step)
    assert (job.tasks_per_node, job.rank, job.node_index) == ((1, 1), 1, 1)


# --- every HINT's launch command, with the environment it produces ----------------------

PBS_NODEFILE = str(FIXTURES / "pbs_nodefile")  # cn07 x4, cn03 x4, cn05 x2
# Torque pbsdsh(1) -u: one task on each unique host; tm_spawn sets PBS_NODENUM, the host's
# index, and PBS_VNODENUM, its first slot (line) in PBS_NODEFILE; PBS_TASKNUM counts spawns.
PBSDSH_U = [
    {"PBS_JOBID": "1234.server", "PBS_NODEFILE": PBS_NODEFILE, "PBS_NODENUM": str(n), "PBS_VNODENUM": str(v),
     "PBS_TASKNUM": str(n + 2)}
    for n, v in ((0, 0), (1, 4), (2, 8))
]
STATIC_HOSTS = str(FIXTURES / "static_hosts.yaml")  # ws-alpha, ws-beta; tasks_per_node defaults to 1
SGE_HOSTS = str(FIXTURES / "sge_two_hosts_four_slots")
# qrsh -inherit HOST runs the command in the job's environment on HOST (qrsh(1)); SGE sets
# HOSTNAME to the execution host (qsub(1), ENVIRONMENTAL VARIABLES).
QRSH_INHERIT = [{"JOB_ID": "54", "PE_HOSTFILE": SGE_HOSTS, "NSLOTS": "8", "HOSTNAME": h} for h in ("node01", "node02")]


def ranks(fixture: str, rank_vars: tuple[str, ...], count: int) -> list[dict[str, str]]:
    return [fixture_env(fixture, **{v: str(r) for v in rank_vars}) for r in range(count)]


def slurm_step(rank: int) -> dict[str, str]:
    return fixture_env("slurm_gpu_step", SLURM_PROCID=str(rank), SLURM_NODEID=str(rank),
                       SLURMD_NODENAME=("gpu07", "gpu08")[rank])


#: Launch command (as HINTs spell it) -> (parser, environments it produces, nodes expected).
LAUNCH_VECTORS: dict[str, tuple[type[ClusterParser], list[dict[str, str]], tuple[str, ...]]] = {
    # real-schedulers.md: what srun -N2 --ntasks-per-node=1 sets on each task.
    "srun --ntasks-per-node=1": (SlurmParser, [slurm_step(0), slurm_step(1)], ("gpu07", "gpu08")),
    # sbatch(1) / salloc(1) OUTPUT ENVIRONMENT VARIABLES: the job variables, no step.
    "sbatch": (SlurmParser, [fixture_env("slurm_sbatch")], ()),
    "salloc": (SlurmParser, [fixture_env("slurm_sbatch")], ()),
    "pbsdsh -u": (PbsParser, PBSDSH_U, ("cn07", "cn03", "cn05")),
    "mpiexec --map-by ppr:1:node": (PbsParser, ranks("pbs_mpirun_ppr1", ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"), 2),
                                    ("node01", "node02")),
    "qsub -l select": (PbsParser, [fixture_env("pbs_job")], ()),
    "qsub,": (PbsParser, [fixture_env("pbs_job")], ()),
    "qsub -pe": (SgeParser, [fixture_env("sge_job")], ()),
    "qsub or": (SgeParser, [fixture_env("sge_job")], ()),
    "qrsh -inherit HOST": (SgeParser, QRSH_INHERIT, ("node01", "node02")),
    "mpirun --map-by ppr:1:node": (SgeParser, ranks("sge_mpirun_ppr1", ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"), 2),
                                   ("node01", "node02")),
    "jsrun -r1 -a1": (LsfParser, ranks("lsf_jsrun_r1_a1", ("JSM_NAMESPACE_RANK",), 2), ("hostA", "hostB")),
    "bsub": (LsfParser, [fixture_env("lsf_mcpu")], ()),
    # A heterogeneous job (sbatch -N2 : -N1), recorded on the test cluster; n2's task differs from n1's by its ids.
    "srun --het-group=0,1 --ntasks-per-node=1": (SlurmParser, [
        fixture_env("slurm_het_step_n1"),
        fixture_env("slurm_het_step_n1", SLURMD_NODENAME="n2", SLURM_NODEID="1", SLURM_PROCID="1", SLURM_GTIDS="1"),
        fixture_env("slurm_het_step_n3")], ("n1", "n2", "n3")),
    # --join (docs/faults.md): srun --jobid=J -N1 -w n3 --overlap from the head node, recorded on the test cluster.
    "srun --jobid=": (SlurmParser, [fixture_env("slurm_join_step")], ("n3",)),
    "tasks_per_node: 1": (StaticParser, [{"KERAS_DISTRIB_HOSTS_FILE": STATIC_HOSTS, "KERAS_DISTRIB_RANK": str(r)}
                                         for r in range(2)], ("ws-alpha", "ws-beta")),
}
#: Commands that start an agent for a running job (``--join``): read with ``join_info``.
JOIN_COMMANDS = {"srun --jobid="}
LAUNCHER_WORDS = ("srun", "sbatch", "salloc", "pbsdsh", "mpiexec", "mpirun", "qsub", "qrsh", "jsrun", "bsub", "blaunch",
                  "tasks_per_node:")

LAUNCHER_WORD = re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, LAUNCHER_WORDS)) + ")")


def hint_texts() -> list[tuple[str, str]]:
    """(file, text) of every string that can end up in a HINT of the parsers or the launcher."""
    found = []
    files = [*(REPO / "cluster_parsers").glob("*.py"), *(REPO / "keras_distrib" / "launcher").glob("*.py"),
             REPO / "keras_distrib" / "plan.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            exprs: list[ast.AST] = []
            if isinstance(node, ast.Call):
                exprs += [k.value for k in node.keywords if k.arg == "hint"]
                if getattr(node.func, "id", "") == "ClusterConfigError" and len(node.args) > 1:
                    exprs.append(node.args[1])
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and ("hint" in t.id or t.id.endswith("_agents")) for t in node.targets
            ):
                exprs.append(node.value)
            for expr in exprs:
                found += [(path.name, c.value) for c in ast.walk(expr) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return found


def test_every_launch_command_in_a_hint_has_a_vector() -> None:
    texts = hint_texts()
    assert any("jsrun -r1 -a1" in t for _, t in texts)  # the scan finds the hints
    missing = []
    for name, text in texts:
        for match in LAUNCHER_WORD.finditer(text):
            if not any(text.startswith(cmd, match.start()) for cmd in LAUNCH_VECTORS):
                missing.append(f"{name}: {text[match.start():match.start() + 40]!r}")
    assert not missing, "HINTs name launch commands no test runs: " + "; ".join(missing)


@pytest.mark.parametrize("command", sorted(LAUNCH_VECTORS))
def test_every_hint_command_is_accepted(command: str) -> None:
    parser_cls, envs, expected_nodes = LAUNCH_VECTORS[command]
    seen_nodes = []
    for env in envs:
        parser = parser_cls(env)
        job = parser.join_info() if command in JOIN_COMMANDS else parser.parse()
        for layout in LAYOUTS:
            assert mode_of(parser, job, layout) == "agent", (command, layout)
        seen_nodes.append(job.node)
    if expected_nodes:  # one task per node: each node exactly once, in the scheduler's order
        assert tuple(seen_nodes) == expected_nodes


@pytest.mark.parametrize(
    ("fixture", "nodes", "gpus"),
    [
        ("slurm_cgroup_gpus", ["gpu1"], ["0"]),
        ("lsf_summit_job_script", ["nodes1", "nodes2"], []),
        ("sge_host_in_two_queues", ["node01-53"], []),
        ("slurm_blank_hostlist", ["alpha", "host5", "host6", "host7", "host8", "host9", "gamma"], []),
    ],
)
def test_plan_json_of_the_vectors(fixture: str, nodes: list[str], gpus: list[str]) -> None:
    out = run_cli(fixture_env(fixture), "--plan", "--format", "json", "--layout", "allreduce")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["nodes"] == nodes
    assert all(p["gpus"] == gpus for p in plan["processes"])


def test_fixtures_name_their_source() -> None:
    for path in FIXTURES.glob("*.json"):
        assert len(json.loads(path.read_text())["source"]) > 20, path.name


def test_docs_gpu_paragraph_matches_the_code() -> None:
    text = (REPO / "docs" / "schedulers.md").read_text()
    paragraph = text[text.index("GPU ids are"):].split("\n\n")[0]
    order = [paragraph.index(f"`{v}`") for v in (*SlurmParser.gpu_vars, SlurmParser.gpu_count_var)]
    assert order == sorted(order)
    assert "ConstrainDevices" in paragraph


def test_mpi_ranks_fill_each_node_even_when_the_nodefile_interleaves(tmp_path: Path) -> None:
    # PBS writes one line per slot, possibly round-robin; Open MPI's mpirun(1) maps ranks by
    # slot, filling a node before the next. pbsdsh's PBS_VNODENUM numbers the lines.
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1\ncn2\ncn1\ncn2\n")
    base = {"PBS_JOBID": "7.s", "PBS_NODEFILE": str(nodefile)}
    placed = [parse_job("pbs", {**base, **open_mpi(r, 4, 2)}) for r in range(4)]
    assert [(j.node, j.local_rank) for j in placed] == [("cn1", 0), ("cn1", 1), ("cn2", 0), ("cn2", 1)]
    by_line = [parse_job("pbs", {**base, "PBS_VNODENUM": str(v)}) for v in range(4)]
    assert [j.node for j in by_line] == ["cn1", "cn2", "cn1", "cn2"]


def test_agent_mode_keeps_the_slots() -> None:
    job = parse_job(environ=fixture_env("sge_mpirun_ppr1"))
    assert (job.tasks_per_node, job.slots_per_node) == ((1, 1), (4, 4))
    job = parse_job(environ=fixture_env("lsf_jsrun_r1_a1"))
    assert (job.tasks_per_node, job.slots_per_node) == ((1, 1), (4, 4))
    assert parse_job(environ=fixture_env("sge_host_in_two_queues")).slots_per_node == (16,)


@pytest.mark.parametrize("host", ["n1", "n2", "n3"])
def test_sge_qrsh_inherit_task_sees_its_own_hosts_slots(host: str) -> None:
    # Real SGE 8.1.9 (tests/sge): NSLOTS=1 NHOSTS=1 in each `qrsh -inherit` task of a 3-slot job.
    job = parse_job(environ=fixture_env("sge_qrsh_inherit", HOSTNAME=host))
    assert job.nodes == ("n1", "n2", "n3")
    assert job.node_index == ["n1", "n2", "n3"].index(host)


def test_sge_nslots_of_another_job_is_still_refused() -> None:
    env = fixture_env("sge_qrsh_inherit", NHOSTS="3", NSLOTS="5")
    with pytest.raises(ClusterConfigError, match="NSLOTS=5 but PE_HOSTFILE lists 3"):
        parse_job(environ=env)
