"""Heterogeneous jobs: what each component's nodes run (workers with their GPUs, or ps only)."""

from __future__ import annotations

import json

import pytest

from cluster_parsers import ClusterConfigError, JobInfo
from keras_distrib.plan import Plan, build_plan, component_roles, survivors_plan

pytestmark = pytest.mark.unit


def het_job(sizes: tuple[int, ...] = (2, 1), gpus: tuple[str, ...] = ("0", "1")) -> JobInfo:
    """Components of ``sizes`` nodes; the first component's nodes hold ``gpus``, the others none."""
    components = tuple(c for c, size in enumerate(sizes) for _ in range(size))
    names = tuple(f"n{i + 1}" for i in range(len(components)))
    return JobInfo("slurm", "4244", names, (1,) * len(names),
                   node_gpus=tuple(gpus if c == 0 else () for c in components),
                   node_components=components, components_source="SLURM_JOB_NODELIST_HET_GROUP_0/1")


def rows(plan: Plan) -> list[str]:
    return [f"{p.node} {p.job} {p.index} {','.join(p.gpus) or '-'}" for p in plan.processes]


@pytest.mark.parametrize(("sizes", "gpus", "wanted", "expected"), [
    ((2, 1), ("0", "1"), None, ["n1 chief 0 -", "n1 worker 0 0,1", "n2 worker 1 0,1", "n3 ps 0 -"]),
    ((1, 1), ("0",), None, ["n1 chief 0 -", "n1 worker 0 0", "n2 ps 0 -"]),
    ((3, 2), ("0", "1"), None,  # sizes that differ: two ps nodes
     ["n1 chief 0 -", "n1 worker 0 0,1", "n2 worker 1 0,1", "n3 worker 2 0,1", "n4 ps 0 -", "n5 ps 1 -"]),
    ((1, 1, 1), (), "workers,workers,ps",  # three components, two of them computing
     ["n1 chief 0 -", "n1 worker 0 -", "n2 worker 1 -", "n3 ps 0 -"]),
    ((1, 1, 1), (), "workers,ps,workers",
     ["n1 chief 0 -", "n1 worker 0 -", "n2 ps 0 -", "n3 worker 1 -"]),
])
def test_the_first_component_computes_and_the_others_hold_the_parameter_servers(
        sizes: tuple[int, ...], gpus: tuple[str, ...], wanted: str | None, expected: list[str]) -> None:
    job = het_job(sizes, gpus)
    plan = build_plan(job, "ps-per-node", roles=component_roles(job, "ps-per-node", wanted))
    assert rows(plan) == expected
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_a_plain_job_has_no_roles_and_refuses_the_option() -> None:
    plain = JobInfo("slurm", "7", ("n1", "n2"), (1, 1))
    assert component_roles(plain, "ps-per-node") == () and plain.num_components == 1
    with pytest.raises(ClusterConfigError, match=r"--component-roles 'workers,ps', but this job has one component"):
        component_roles(plain, "ps-per-node", "workers,ps")


@pytest.mark.parametrize("layout", ["worker-per-gpu", "allreduce", "jax", "jax-per-gpu"])
def test_other_layouts_refuse_a_heterogeneous_job(layout: str) -> None:
    with pytest.raises(ClusterConfigError, match=rf"layout {layout} cannot run a heterogeneous job \(2 components, "
                                                 r"SLURM_JOB_NODELIST_HET_GROUP_0/1\).*HINT: use --layout ps-per-node"):
        component_roles(het_job(), layout)


@pytest.mark.parametrize("wanted", ["ps,workers", "workers", "workers,ps,ps", "workers,workers", "workers,gpu", ""])
def test_roles_that_do_not_fit_are_refused_with_an_example(wanted: str) -> None:
    with pytest.raises(ClusterConfigError) as error:
        component_roles(het_job(), "ps-per-node", wanted or None) if wanted else component_roles(
            het_job((1, 1, 1)), "ps-per-node", ",")
    assert "HINT: write one of 'workers' or 'ps' per component" in str(error.value)


def test_gpu_counts_need_be_equal_only_on_the_computing_nodes() -> None:
    job = het_job((2, 1))
    assert len(build_plan(job, "ps-per-node", roles=("workers", "ps")).processes) == 4  # n3 has no GPU: fine
    uneven = JobInfo("slurm", "1", ("n1", "n2", "n3"), (1, 1, 1), node_gpus=(("0",), ("0", "1"), ()),
                     node_components=(0, 0, 1))
    with pytest.raises(ClusterConfigError, match=r"GPU counts differ between nodes \(n1=1, n2=2\)"):
        build_plan(uneven, "ps-per-node", roles=("workers", "ps"))


def test_survivors_keep_their_roles_and_a_lost_ps_component_is_named() -> None:
    job = het_job((2, 2), gpus=())
    plan = build_plan(job, "ps-per-node", roles=("workers", "ps"))
    left = survivors_plan(plan, job, ["n1", "n2", "n4"])
    assert rows(left) == ["n1 chief 0 -", "n1 worker 0 -", "n2 worker 1 -", "n4 ps 0 -"] and left.roles == plan.roles
    with pytest.raises(ClusterConfigError, match=r"none of the job's 2 node\(s\) is left in a parameter-server "
                                                 r"component \(n1=workers, n2=workers\)"):
        survivors_plan(plan, job, ["n1", "n2"])


# --- ports the scheduler reserved for the step (srun --resv-ports) ------------------------------

def test_reserved_ports_are_read_from_the_step() -> None:
    from _unit_helpers import fixture_env

    from cluster_parsers import SlurmParser

    job = SlurmParser(fixture_env("slurm_het_step_n3", SLURM_STEP_RESV_PORTS="12003-12005,12007")).parse()
    assert job.reserved_ports == (12003, 12004, 12005, 12007)
    assert job.reserved_ports_source == "SLURM_STEP_RESV_PORTS='12003-12005,12007'"
    assert SlurmParser(fixture_env("slurm_step_task0", SLURM_STEP_RESV_PORTS="12003-12022")).parse().reserved_ports[-1] \
        == 12022
    for bad in ("12005-12003", "ports", "12000-70000"):
        with pytest.raises(ClusterConfigError, match=rf"SLURM_STEP_RESV_PORTS='{bad}' .*HINT: expected e.g. 12000-12019"):
            SlurmParser(fixture_env("slurm_step_task0", SLURM_STEP_RESV_PORTS=bad)).parse()


@pytest.mark.parametrize(("reserved", "first_port", "source"), [
    (range(12003, 12023), 12003, "SLURM_STEP_RESV_PORTS='r', reserved for this step by the scheduler"),
    (range(12003, 12008), 12003, "SLURM_STEP_RESV_PORTS='r', reserved for this step by the scheduler"),  # 3 + 2
    # Slurm's default for a step (tasks per node + 1): too few, so the job-id block.
    (range(12001, 12003), 24220, "the block derived from job id 4711 (24220-24239; taken on a node, the job moves "
                                 "to a fallback block); SLURM_STEP_RESV_PORTS='r' holds 2 port(s) in a row, fewer than the 5 this plan needs on a host (srun "
                                 "--resv-ports=5 reserves them)"),
    ((12003, 12004, 12005, 12006, 12010), 24220, None),  # not 5 in a row
])
def test_the_plan_uses_reserved_ports_when_they_hold_what_it_needs(reserved: range, first_port: int,
                                                                   source: str | None) -> None:
    job = JobInfo("slurm", "4711", ("n1", "n2"), (1, 1), reserved_ports=tuple(reserved),
                  reserved_ports_source="SLURM_STEP_RESV_PORTS='r'")
    plan = build_plan(job, "ps-per-node")
    assert [p.port for p in plan.processes] == [first_port + i for i in (0, 1, 2, 0, 1)]
    assert plan.control_port() == first_port + 3
    if source is not None:
        assert plan.ports_source == source
    assert build_plan(job, "ps-per-node", port_base=23000).processes[0].port == 23000  # --port-base wins


# --- components the scheduler does not name: --component-sizes (PBS select chunks, LSF -R) ---------

def test_a_pbs_select_of_two_chunks_is_split_by_the_sizes_given() -> None:
    from _unit_helpers import fixture_env

    from cluster_parsers import PbsParser
    from keras_distrib.plan import split_components

    job = split_components(PbsParser(fixture_env("pbs_select_two_chunks")).parse(), "2,1")
    plan = build_plan(job, "ps-per-node", roles=component_roles(job, "ps-per-node"))
    assert [(p.node, p.job) for p in plan.processes] == [("gpu01", "chief"), ("gpu01", "worker"), ("gpu02", "worker"),
                                                         ("cpu01", "ps")]
    assert job.components_source == "--component-sizes 2,1"


@pytest.mark.parametrize("sizes", ["2,2", "3", "2,0,1", "a,1", "2,,1"])
def test_sizes_that_do_not_split_the_nodes_are_refused(sizes: str) -> None:
    from keras_distrib.plan import split_components

    plain = JobInfo("pbs", "7", ("n1", "n2", "n3"), (1, 1, 1))
    with pytest.raises(ClusterConfigError, match=r"does not split the job's 3 nodes.*HINT: .*--component-sizes 2,1"):
        split_components(plain, sizes)


def test_sizes_on_a_job_the_scheduler_split_are_refused() -> None:
    from keras_distrib.plan import split_components

    with pytest.raises(ClusterConfigError, match=r"already split this job into 2 components"):
        split_components(het_job(), "2,1")
    assert split_components(het_job(), None) == het_job()
