"""SlurmParser against environments recorded from a real Slurm 22.05 job (tests/unit/fixtures)."""

from __future__ import annotations

import dataclasses

import pytest
from _unit_helpers import fixture_env

from cluster_parsers import ClusterConfigError, JobInfo, SlurmParser


def parse(env: dict[str, str]) -> JobInfo:
    return SlurmParser(env).parse()


@pytest.mark.parametrize(
    ("fixture", "rank", "local_rank", "node_index", "node"),
    [("slurm_step_task0", 0, 0, 0, "n1"), ("slurm_step_task5", 5, 1, 2, "n3")],
)
def test_real_multi_node_step(fixture: str, rank: int, local_rank: int, node_index: int, node: str) -> None:
    job = parse(fixture_env(fixture))
    assert (job.scheduler, job.job_id) == ("slurm", "113")
    assert job.nodes == ("n1", "n2", "n3")
    assert job.tasks_per_node == (2, 2, 2)
    assert (job.rank, job.local_rank, job.node_index, job.node) == (rank, local_rank, node_index, node)
    assert job.gpus == () and job.node_gpus == ((), (), ())  # CPU-only cluster
    assert job.tasks_launched
    assert "SLURM_STEP_TASKS_PER_NODE='2(x3)'" in job.tasks_source


def test_every_task_of_a_step_sees_the_same_job() -> None:
    jobs = [parse(fixture_env(name)) for name in ("slurm_step_task0", "slurm_step_task5")]
    shared = [dataclasses.replace(j, rank=0, local_rank=0, node_index=0) for j in jobs]
    assert shared[0] == shared[1]


def test_sbatch_script_uses_job_variables() -> None:
    job = parse(fixture_env("slurm_sbatch"))
    assert (job.job_id, job.nodes, job.tasks_per_node) == ("114", ("n1", "n2"), (2, 2))
    assert "SLURM_TASKS_PER_NODE" in job.tasks_source
    # The batch script counts allocated slots: no srun has started tasks yet.
    assert not job.tasks_launched


def test_step_variables_win_over_job_variables() -> None:
    # srun -N2 inside a 4-node allocation (tensorflow#36094): the step is what runs.
    env = fixture_env("slurm_sbatch", SLURM_JOB_NODELIST="n[1-4]", SLURM_TASKS_PER_NODE="1(x4)", SLURM_NTASKS="4",
                      SLURM_STEP_NODELIST="n[3-4]", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_STEP_NUM_TASKS="2",
                      SLURMD_NODENAME="n4")
    job = parse(env)
    assert (job.nodes, job.tasks_per_node, job.node_index) == (("n3", "n4"), (1, 1), 1)


@pytest.mark.parametrize(
    ("env", "nodes"),
    [
        ({"SLURM_JOBID": "9", "SLURM_JOB_NODELIST": "a[1-2]"}, ("a1", "a2")),  # old job id name
        ({"SLURM_JOB_ID": "9", "SLURM_NODELIST": "b[1-2]"}, ("b1", "b2")),  # old node list name
    ],
)
def test_legacy_variable_names(env: dict[str, str], nodes: tuple[str, ...]) -> None:
    job = parse(env)
    assert (job.job_id, job.nodes, job.tasks_per_node) == ("9", nodes, (1, 1))


def test_uneven_tasks_per_node() -> None:
    env = {"SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n[01-04]", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
           "SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    job = parse(env)
    assert (job.tasks_per_node, job.num_tasks, job.node) == ((2, 2, 2, 1), 7, "n04")


def test_node_index_without_slurmd_nodename_uses_nodeid() -> None:
    env = {"SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_NODEID": "1"}
    assert parse(env).node == "n2"


def test_gpu_job_keeps_slurm_ids_verbatim() -> None:
    job = parse(fixture_env("slurm_gpu_step"))
    assert job.nodes == ("gpu07", "gpu08") and job.node == "gpu08"
    assert job.gpus == ("2", "3")
    assert job.node_gpus == (("2", "3"), ("2", "3"))


@pytest.mark.parametrize(
    ("gpu_env", "expected"),
    [
        # The ids the process can open win: under ConstrainDevices=yes SLURM_*_GPUS keep the
        # node's global ids, "not relative to any device cgroup" (sbatch(1)).
        ({"SLURM_STEP_GPUS": "5", "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}, ("0",)),
        ({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}, ("0", "1")),
        ({"SLURM_STEP_GPUS": "5", "SLURM_JOB_GPUS": "2,3"}, ("5",)),  # step before job
        ({"SLURM_JOB_GPUS": "2,3"}, ("2", "3")),  # never renumbered
        ({"CUDA_VISIBLE_DEVICES": "1,0", "SLURM_GPUS_ON_NODE": "2"}, ("1", "0")),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f3a,GPU-77c1"}, ("GPU-8f3a", "GPU-77c1")),  # UUIDs kept
        ({"SLURM_GPUS_ON_NODE": "3"}, ("0", "1", "2")),  # only a count: ids 0..N-1
        ({"CUDA_VISIBLE_DEVICES": ""}, ()),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ()),
        ({}, ()),  # CPU-only job
    ],
)
def test_gpu_source_precedence(gpu_env: dict[str, str], expected: tuple[str, ...]) -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", **gpu_env}
    assert parse(env).node_gpus == (expected, expected)


STEP = {"SLURM_JOB_ID": "113", "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_STEP_NUM_TASKS": "6"}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST"),
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-"}, "SLURM_STEP_NODELIST='n[1-'"),
        ({**STEP, "SLURM_STEP_NODELIST": "n[3-1]"}, "SLURM_STEP_NODELIST='n[3-1]'"),
        ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "SLURM_STEP_TASKS_PER_NODE='2(x2)'"),
        ({**STEP, "SLURM_STEP_NUM_TASKS": "5"}, "SLURM_STEP_NUM_TASKS=5"),
        ({**STEP, "SLURM_STEP_NUM_TASKS": "six"}, "SLURM_STEP_NUM_TASKS='six'"),
        ({**STEP, "SLURMD_NODENAME": "n9"}, "SLURMD_NODENAME='n9'"),
        ({**STEP, "SLURM_NODEID": "3"}, "SLURM_NODEID=3"),
        ({**STEP, "SLURM_PROCID": "x"}, "SLURM_PROCID='x'"),
        ({**STEP, "SLURM_JOB_GPUS": "2,,3"}, "SLURM_JOB_GPUS='2,,3'"),
        ({**STEP, "SLURM_GPUS_ON_NODE": "two"}, "SLURM_GPUS_ON_NODE='two'"),
    ],
)
def test_bad_input_names_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ClusterConfigError) as err:
        parse(env)
    assert named in err.value.message
    assert err.value.hint


def test_a_joining_step_sees_the_job_as_its_agents_did() -> None:
    """``srun --jobid=1 -N1 -w n3 --overlap`` from the head node (recorded on the test
    cluster): SLURM_JOB_NODELIST is the new step's node there, SLURM_NODELIST the job's."""
    env = fixture_env("slurm_join_step")
    assert env["SLURM_JOB_NODELIST"] == "n3" and env["SLURM_NODELIST"] == "n[1-3]"
    joining = SlurmParser(env).join_info()
    agents = parse(fixture_env("slurm_step_task5", SLURM_STEP_TASKS_PER_NODE="1(x3)", SLURM_STEP_NUM_TASKS="3",
                               SLURM_NTASKS="3", SLURM_TASKS_PER_NODE="1(x3)", SLURM_PROCID="2", SLURM_LOCALID="0"))
    assert joining.nodes == agents.nodes == ("n1", "n2", "n3")
    assert (joining.node_index, joining.rank, joining.node, joining.tasks_per_node) == (2, 2, "n3", (1, 1, 1))
    assert joining.job_id == "1"


def test_joining_on_a_node_outside_the_job_names_it() -> None:
    with pytest.raises(ClusterConfigError, match=r"SLURMD_NODENAME='n9' is not in SLURM_NODELIST='n\[1-3\]'"):
        SlurmParser(fixture_env("slurm_join_step", SLURMD_NODENAME="n9")).join_info()


# --- heterogeneous jobs (sbatch -N2 : -N1), recorded on the test cluster -------------------

@pytest.mark.parametrize(("fixture", "nodes", "components", "node", "launched"), [
    ("slurm_het_batch", ("n1", "n2", "n3"), (0, 0, 1), "n1", False),  # its SLURM_JOB_NODELIST is n[1-2] only
    ("slurm_het_step_n1", ("n1", "n2", "n3"), (0, 0, 1), "n1", True),
    ("slurm_het_step_n3", ("n1", "n2", "n3"), (0, 0, 1), "n3", True),
    # -w n3 -N1 : -N2: the step's list is sorted (n[1-3]); the components say n3 comes first.
    ("slurm_het_reversed_step_n1", ("n3", "n1", "n2"), (0, 1, 1), "n1", True),
])
def test_a_heterogeneous_job_is_every_component_in_order(fixture: str, nodes: tuple[str, ...],
                                                          components: tuple[int, ...], node: str,
                                                          launched: bool) -> None:
    job = parse(fixture_env(fixture))
    assert (job.nodes, job.node_components, job.node, job.tasks_launched) == (nodes, components, node, launched)
    assert job.num_components == 2 and job.components_source == "SLURM_JOB_NODELIST_HET_GROUP_0..1"
    assert job.rank == job.node_index and job.tasks_per_node == (1, 1, 1)


def test_the_agents_of_every_component_plan_the_same_cluster() -> None:
    from keras_distrib.launcher.formation import plan_digest
    from keras_distrib.plan import build_plan, component_roles

    plans = []
    for fixture, gpus in (("slurm_het_step_n1", "0,1"), ("slurm_het_step_n3", "")):  # GPUs on component 0 only
        job = parse(fixture_env(fixture, CUDA_VISIBLE_DEVICES=gpus))
        plans.append(build_plan(job, "ps-per-node", roles=component_roles(job, "ps-per-node")))
    hosts = {job: [a.split(":")[0] for a in addresses] for job, addresses in plans[0].cluster_spec().items()}
    assert hosts == {"chief": ["n1"], "ps": ["n3"], "worker": ["n1", "n2"]}
    assert plans[0].cluster_spec() == plans[1].cluster_spec()
    assert plan_digest(plans[0]) == plan_digest(plans[1])
    assert plans[0].find("worker", 1).gpus == ("0", "1")  # the workers' agents know their GPUs


def test_a_plain_srun_in_a_heterogeneous_job_is_refused_with_the_het_group_form() -> None:
    env = fixture_env("slurm_het_step_n1", SLURM_STEP_NODELIST="n[1-2]", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    with pytest.raises(ClusterConfigError, match=r"SLURM_STEP_NODELIST='n\[1-2\]' runs on 2 of the 3 nodes of this "
                                                 r"heterogeneous job .*HINT: .*srun --het-group=0,1"):
        parse(env)


def test_a_node_in_two_components_is_refused() -> None:
    env = fixture_env("slurm_het_batch", SLURM_JOB_NODELIST_HET_GROUP_1="n2")
    with pytest.raises(ClusterConfigError, match=r"SLURM_JOB_NODELIST_HET_GROUP_1='n2' holds n2, which component 0 "
                                                 r"holds too. HINT: give each component its own nodes"):
        parse(env)
