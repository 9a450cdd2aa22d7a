"""The job plan: layouts, ports, equal GPUs, and how many tasks the scheduler must start."""

from __future__ import annotations

import json

import pytest
from _unit_helpers import fixture_env

from cluster_parsers import ClusterConfigError, JobInfo, SlurmParser
from keras_distrib.plan import (
    MAX_PORT,
    MIN_PORT,
    PORT_BLOCK,
    PORT_BLOCKS,
    PORT_RANGE_START,
    Plan,
    build_plan,
    derive_port_base,
    node_roles,
    process_for_task,
    survivors_plan,
    tasks_mode,
)


def job(nodes: int = 2, gpus: tuple[str, ...] = (), tasks: tuple[int, ...] | None = None, job_id: str = "113",
        launched: bool = True, node_gpus: tuple[tuple[str, ...], ...] | None = None) -> JobInfo:
    names = tuple(f"n{i + 1}" for i in range(nodes))
    return JobInfo("slurm", job_id, names, tasks or (1,) * nodes, node_gpus=node_gpus or (gpus,) * nodes,
                   tasks_source="SLURM_STEP_TASKS_PER_NODE='test'", tasks_launched=launched)


def rows(plan: Plan) -> list[str]:
    """Each process as 'node job index gpus', in plan order."""
    return [f"{p.node} {p.job} {p.index} {','.join(p.gpus) or '-'}" for p in plan.processes]


LAYOUTS = [
    ("ps-per-node", ("2", "3"),
     ["n1 chief 0 -", "n1 ps 0 -", "n1 worker 0 2,3", "n2 ps 1 -", "n2 worker 1 2,3"]),
    ("ps-per-node", (),  # CPU-only
     ["n1 chief 0 -", "n1 ps 0 -", "n1 worker 0 -", "n2 ps 1 -", "n2 worker 1 -"]),
    ("worker-per-gpu", ("2", "3"),
     ["n1 chief 0 -", "n1 ps 0 -", "n1 worker 0 2", "n1 worker 1 3", "n2 ps 1 -", "n2 worker 2 2", "n2 worker 3 3"]),
    ("worker-per-gpu", (),  # CPU-only: one worker per node
     ["n1 chief 0 -", "n1 ps 0 -", "n1 worker 0 -", "n2 ps 1 -", "n2 worker 1 -"]),
    ("allreduce", ("2", "3"), ["n1 worker 0 2,3", "n2 worker 1 2,3"]),
    ("allreduce", (), ["n1 worker 0 -", "n2 worker 1 -"]),
]


@pytest.mark.parametrize(("layout", "gpus", "expected"), LAYOUTS)
def test_layout(layout: str, gpus: tuple[str, ...], expected: list[str]) -> None:
    plan = build_plan(job(2, gpus), layout)
    assert rows(plan) == expected
    spec = plan.cluster_spec()
    assert {k: len(v) for k, v in spec.items()} == {j: sum(r.split()[1] == j for r in expected) for j in spec}
    assert set(spec) == {r.split()[1] for r in expected}  # allreduce: no chief, no ps
    assert sorted(a for v in spec.values() for a in v) == sorted(p.address for p in plan.processes)


@pytest.mark.parametrize(("layout", "gpus", "expected"), LAYOUTS)
def test_tf_config_of_every_process(layout: str, gpus: tuple[str, ...], expected: list[str]) -> None:
    plan = build_plan(job(2, gpus), layout)
    for proc in plan.processes:
        config = plan.tf_config(proc)
        assert config["task"] == {"type": proc.job, "index": proc.index}
        assert config["cluster"][proc.job][proc.index] == proc.address
        json.dumps(config)


def test_nodes_keep_their_own_gpu_lists_in_worker_per_gpu() -> None:
    plan = build_plan(job(2, node_gpus=(("0", "1"), ("5",))), "worker-per-gpu")
    assert [p.gpus for p in plan.processes if p.job == "worker"] == [("0",), ("1",), ("5",)]


def test_unknown_layout() -> None:
    with pytest.raises(ClusterConfigError, match="layout='ring'"):
        node_roles("ring", 0, ())


# --- ports ----------------------------------------------------------------------------

JOB_IDS = ["0", "1", "113", "499", "500", "4711", "987654321", "1234.server", "job-abc", "static"]


@pytest.mark.parametrize("job_id", JOB_IDS)
@pytest.mark.parametrize("layout", ["ps-per-node", "worker-per-gpu", "allreduce"])
def test_derived_ports_in_documented_range_and_distinct_per_host(job_id: str, layout: str) -> None:
    plan = build_plan(job(3, ("0", "1", "2", "3"), job_id=job_id), layout)
    ports = [(p.host, p.port) for p in plan.processes]
    assert len(set(ports)) == len(ports)  # distinct for each process on the same host
    base = derive_port_base(job_id)
    assert all(base <= port < base + PORT_BLOCK for _, port in ports)
    assert PORT_RANGE_START <= base and base + PORT_BLOCK <= PORT_RANGE_START + PORT_BLOCK * PORT_BLOCKS


def test_derived_port_depends_only_on_job_id() -> None:
    assert derive_port_base("113") == derive_port_base("113")
    # Consecutive jobs sharing nodes get disjoint port blocks.
    bases = {derive_port_base(str(i)) for i in range(1000, 1000 + PORT_BLOCKS)}
    assert len(bases) == PORT_BLOCKS


def test_distinct_hosts_reuse_ports_but_shared_hosts_do_not() -> None:
    # In local mode every emulated node maps to the same address.
    plan = build_plan(job(3), "ps-per-node", hosts={f"n{i}": "127.0.0.1" for i in (1, 2, 3)})
    assert len({p.address for p in plan.processes}) == len(plan.processes) == 7
    separate = build_plan(job(3), "ps-per-node")
    assert len({p.port for p in separate.processes}) == 3  # chief/ps/worker slots on n1


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce"])
def test_all_ranks_compute_the_same_plan(layout: str) -> None:
    plans = [build_plan(SlurmParser(fixture_env(f)).parse(), layout).to_json()
             for f in ("slurm_step_task0", "slurm_step_task5")]
    assert plans[0] == plans[1]
    assert plans[0]["nodes"] == ["n1", "n2", "n3"]


@pytest.mark.parametrize("port_base", [MIN_PORT, 23000, MAX_PORT - 2])  # MAX_PORT - 2: the last port used
def test_port_override(port_base: int) -> None:
    plan = build_plan(job(2), "ps-per-node", port_base=port_base)
    assert [p.port for p in plan.on_node(0)] == [port_base, port_base + 1, port_base + 2]
    assert [p.port for p in plan.on_node(1)] == [port_base, port_base + 1]


@pytest.mark.parametrize("port_base", [0, 80, MIN_PORT - 1, MAX_PORT + 1, 70000, -5])
def test_port_base_outside_1024_65535(port_base: int) -> None:
    with pytest.raises(ClusterConfigError, match=f"KERAS_DISTRIB_PORT_BASE={port_base} is outside 1024-65535") as err:
        build_plan(job(2), port_base=port_base)
    assert "--port-base" in err.value.hint and "KERAS_DISTRIB_PORT_BASE" in err.value.hint


@pytest.mark.parametrize(
    ("layout", "gpus", "port_base"),
    # The first node runs chief + ps + workers: 3 ports in ps-per-node, 5 with three GPUs per worker.
    [("ps-per-node", (), MAX_PORT - 1), ("ps-per-node", (), MAX_PORT), ("worker-per-gpu", ("0", "1", "2"), MAX_PORT - 3)],
)
def test_port_range_exhausted(layout: str, gpus: tuple[str, ...], port_base: int) -> None:
    with pytest.raises(ClusterConfigError, match=f"KERAS_DISTRIB_PORT_BASE={port_base} leaves no port") as err:
        build_plan(job(2, gpus), layout, port_base=port_base)
    assert "--port-base" in err.value.hint


# --- equal GPUs -----------------------------------------------------------------------

UNEQUAL = (("0", "1"), ("0",))


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce"])
def test_unequal_gpu_counts_rejected(layout: str) -> None:
    with pytest.raises(ClusterConfigError) as err:
        build_plan(job(2, node_gpus=UNEQUAL), layout)
    assert "n1=2, n2=1" in err.value.message and layout in err.value.message
    assert "worker-per-gpu" in err.value.hint


def test_unequal_gpu_counts_fine_with_one_worker_per_gpu() -> None:
    assert len(build_plan(job(2, node_gpus=UNEQUAL), "worker-per-gpu").processes) == 6


# --- how many tasks the scheduler started ---------------------------------------------


@pytest.mark.parametrize(
    ("layout", "gpus", "tasks", "launched", "mode"),
    [
        ("ps-per-node", (), (1, 1, 1), True, "agent"),  # srun --ntasks-per-node=1
        ("ps-per-node", (), (3, 2, 2), True, "per-role"),  # one task per process
        ("worker-per-gpu", ("0", "1"), (4, 3, 3), True, "per-role"),
        ("allreduce", ("0", "1"), (1, 1, 1), True, "agent"),
        ("ps-per-node", (), (4, 4, 4), False, "agent"),  # allocated slots, nothing launched yet
        ("ps-per-node", (), (2, 2, 2), True, None),
        ("ps-per-node", (), (4, 2, 2), True, None),
        ("allreduce", (), (2, 1, 1), True, None),
        ("worker-per-gpu", ("0", "1"), (4, 3, 2), True, None),
    ],
)
def test_tasks_mode(layout: str, gpus: tuple[str, ...], tasks: tuple[int, ...], launched: bool, mode: str | None) -> None:
    j = job(3, gpus, tasks=tasks, launched=launched)
    plan = build_plan(j, layout)
    if mode is not None:
        assert tasks_mode(j, plan, "HINT-TEXT") == mode
        return
    with pytest.raises(ClusterConfigError) as err:
        tasks_mode(j, plan, "srun --ntasks-per-node=1")
    assert "SLURM_STEP_TASKS_PER_NODE='test'" in err.value.message
    assert err.value.hint == "srun --ntasks-per-node=1"


def test_per_role_task_runs_its_local_rank_process() -> None:
    base = job(2, tasks=(3, 2))
    plan = build_plan(base, "ps-per-node")
    picked = [
        process_for_task(JobInfo("slurm", "113", base.nodes, base.tasks_per_node, rank=r, local_rank=lr, node_index=ni), plan).name
        for r, ni, lr in [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1)]
    ]
    assert picked == ["chief:0", "ps:0", "worker:0", "ps:1", "worker:1"]


def test_plan_json_round_trip() -> None:
    plan = build_plan(job(3, ("2", "3")), "worker-per-gpu", port_base=23000)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan


@pytest.mark.parametrize("job_id", ["\u00b2", "12\u00b3", "\u0663\u0664"])  # superscripts, Arabic-Indic digits
def test_port_base_of_a_job_id_with_unicode_digits(job_id: str) -> None:
    base = derive_port_base(job_id)
    assert base == derive_port_base(job_id)  # stable, no ValueError


@pytest.mark.parametrize("layout", ["ps-per-node", "worker-per-gpu", "allreduce", "jax", "jax-per-gpu"])
@pytest.mark.parametrize("nodes", [1, 3])
def test_runs_script_and_control_port_agree_with_a_full_scan(layout: str, nodes: int) -> None:
    """The O(1) answers the agent asks per child match the plain definitions (a scan each)."""
    plan = build_plan(job(nodes, gpus=("0", "1")), layout, 23000)
    runners = [p for p in plan.processes if p.job == "chief" or layout in ("allreduce", "jax", "jax-per-gpu")]
    assert [p for p in plan.processes if plan.runs_script(p)] == runners == plan.script_runners
    first_host = plan.processes[0].host
    assert plan.control_port() == max(p.port for p in plan.processes if p.host == first_host) + 1
    assert plan.control_port() == plan.control_port()  # cached, same answer


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce"])
def test_survivors_plan_keeps_the_first_node_and_its_ports_and_renumbers(layout: str) -> None:
    j = job(3)
    plan = build_plan(j, layout)
    left = survivors_plan(plan, j, ("n1", "n3"))
    assert left.nodes == ("n1", "n3") and left.layout == layout and left.job_id == plan.job_id
    assert {p.node for p in left.processes} == {"n1", "n3"}
    workers = [p for p in left.processes if p.job == "worker"]
    assert [(p.node, p.index, p.node_index) for p in workers] == [("n1", 0, 0), ("n3", 1, 1)]  # renumbered
    # each surviving host keeps the ports it had: the first node's, and so the control port, do not change
    before = {(p.node, p.job): p.port for p in plan.processes}
    assert all(before[(p.node, p.job)] == p.port for p in left.processes)
    assert left.control_port() == plan.control_port()
    assert left == survivors_plan(plan, j, ("n1", "n3"))  # pure: every agent computes the same


def test_survivors_plan_packs_the_ports_of_one_host() -> None:
    j = job(3)
    plan = build_plan(j, "ps-per-node", 25000, hosts={n: "127.0.0.1" for n in j.nodes})
    left = survivors_plan(plan, j, ("n1", "n2"))
    assert [p.port for p in left.processes] == list(range(25000, 25005))  # chief, 2 ps, 2 workers on one host
    assert left.cluster_spec()["ps"] == ["127.0.0.1:25001", "127.0.0.1:25003"]


@pytest.mark.parametrize("nodes", [(), ("n2", "n3"), ("n1", "n9")])
def test_survivors_plan_refuses_a_set_without_the_first_node_or_with_strangers(nodes: tuple[str, ...]) -> None:
    j = job(3)
    with pytest.raises(AssertionError, match="the first kept"):  # a bug of the caller, not a user error
        survivors_plan(build_plan(j), j, nodes)
