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
