"""A job whose job-id port block is taken on a node moves, as a whole, to a fallback block
that every agent agrees on (launcher/portblocks.py), with the real formation code."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from cluster_parsers import ClusterConfigError, JobInfo
from keras_distrib.launcher import control, portblocks
from keras_distrib.launcher.formation import Identity, form_job, rejoin_job
from keras_distrib.launcher.messages import Hello
from keras_distrib.launcher.options import Options
from keras_distrib.plan import (
    FALLBACK_BLOCKS, PORT_BLOCK, PORT_BLOCKS, PORT_RANGE_START, build_plan, fallback_bases, moved_plan,
)

pytestmark = pytest.mark.unit

OPTIONS = Options(startup_timeout=30.0, heartbeat_timeout=10.0)


def test_fallbacks_are_distinct_blocks_in_range_away_from_the_neighbours_blocks() -> None:
    for index in range(PORT_BLOCKS):
        base = PORT_RANGE_START + index * PORT_BLOCK
        fallbacks = fallback_bases(base)
        indices = [(b - PORT_RANGE_START) // PORT_BLOCK for b in fallbacks]
        assert len(set(fallbacks)) == FALLBACK_BLOCKS and base not in fallbacks
        assert all(0 <= i < PORT_BLOCKS and (b - PORT_RANGE_START) % PORT_BLOCK == 0 for i, b in zip(indices, fallbacks))
        # the jobs just before and after this one keep their own blocks: no fallback lands there
        assert all(min((i - index) % PORT_BLOCKS, (index - i) % PORT_BLOCKS) > 50 for i in indices)


def test_only_the_job_id_block_has_fallbacks() -> None:
    job = JobInfo("slurm", "4711", ("n1", "n2"), (1, 1))
    assert build_plan(job).port_fallbacks == fallback_bases(24220)
    assert build_plan(job, port_base=31000).port_fallbacks == ()  # --port-base: the user's choice stands
    reserved = JobInfo("slurm", "4711", ("n1", "n2"), (1, 1), reserved_ports=tuple(range(12000, 12020)),
                       reserved_ports_source="SLURM_STEP_RESV_PORTS='12000-12019'")
    assert build_plan(reserved).port_fallbacks == ()  # the scheduler's reservation is exclusive


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce", "worker-per-gpu"])
@pytest.mark.parametrize("nodes", [2, 3])
def test_a_moved_plan_shifts_every_port_and_nothing_else(layout: str, nodes: int) -> None:
    job = JobInfo("slurm", "17", tuple(f"n{i}" for i in range(nodes)), (1,) * nodes,
                  node_gpus=(("0", "1"),) * nodes)
    plan = build_plan(job, layout)
    target = plan.port_fallbacks[2]
    moved = moved_plan(plan, job, target)
    shift = target - plan.processes[0].port
    assert [(p.node, p.job, p.index, p.host, p.gpus) for p in moved.processes] == \
           [(p.node, p.job, p.index, p.host, p.gpus) for p in plan.processes]
    assert [p.port - shift for p in moved.processes] == [p.port for p in plan.processes]
    assert moved.control_port() == plan.control_port() + shift == portblocks.control_ports(plan)[3]
    assert "moved the job there" in moved.ports_source and moved.port_fallbacks == ()


def hello(agent: int, free: list[int] | None) -> Hello:
    return Hello(agent, f"n{agent}", None, "digest", free)


def test_the_block_for_all_starts_at_the_claimed_one_and_must_be_free_everywhere() -> None:
    plan = build_plan(JobInfo("slurm", "17", ("n0", "n1", "n2"), (1, 1, 1)))
    b = portblocks.blocks(plan)
    assert portblocks.block_for_all(plan, b[0], b, {1: hello(1, list(b)), 2: hello(2, list(b))}) == list(b)
    # taken on n2 only: the next block free everywhere
    assert portblocks.block_for_all(plan, b[0], b, {1: hello(1, list(b)), 2: hello(2, list(b[2:]))})[0] == b[2]
    # agent 0 could not claim b[0] (another job's agent 0 holds its control port): never back to it
    assert portblocks.block_for_all(plan, b[1], b, {1: hello(1, list(b)), 2: hello(2, list(b))})[0] == b[1]
    assert portblocks.block_for_all(plan, b[0], b, {1: hello(1, [b[0]]), 2: hello(2, [b[1]])}) == []
    assert portblocks.taken_on(plan, b[0], b[1:], "n0", {1: hello(1, list(b)), 2: hello(2, [b[1]])}) == ["n0", "n2"]


def two_agents(job_id: str, layout: str = "allreduce") -> tuple[JobInfo, list[Any]]:
    """A two-node job whose 'nodes' are this machine (the first node is reached as localhost)."""
    job = JobInfo("slurm", job_id, ("localhost", "n2"), (1, 1))
    plan = build_plan(job, layout)
    identities = [Identity(i, 2, job.nodes[i], dict(enumerate(job.nodes))) for i in range(2)]
    return job, [(identity, plan) for identity in identities]


def form_all(job: JobInfo, agents: list[Any], free: list[list[int]], logs: list[str]) -> list[Any]:
    """Every agent forms the job in its own thread (as on its node); their (channel, plan) or exception."""
    results: list[Any] = [None] * len(agents)

    class Log:
        def info(self, line: str) -> None:
            logs.append(line)

        warning = error = info

    def form(i: int) -> None:
        identity, plan = agents[i]
        try:
            results[i] = form_job(identity, job, plan, OPTIONS, lambda _e: None, Log(),
                                  portblocks.BlockClaims.unclaimed(free[i]))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=form, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def free_job_id() -> str:
    """A job id whose block and fallbacks are free on this machine (other tests may hold ports)."""
    for number in range(101, 600):
        plan = build_plan(JobInfo("slurm", str(number), ("localhost", "n2"), (1, 1)), "allreduce")
        every = [portblocks.shifted(p, plan, base) for base in portblocks.blocks(plan)
                 for p in range(plan.processes[0].port, plan.control_port() + 2)]
        if not any(portblocks.taken_port(p) for p in every + [portblocks.claim_port(b) for b in portblocks.blocks(plan)]):
            return str(number)
    raise AssertionError("no job id with free port blocks on this machine")


def close_all(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, tuple):
            result[0].close()


def test_another_jobs_agent_0_on_the_control_port_moves_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs whose ids are equal modulo 500: the other one's agent 0 holds our block's
    control port. Our agent 0 claims the first fallback; our other agent, greeted by the
    other job's agent 0 first, says so, goes on to the fallback; both run the same moved plan."""
    monkeypatch.chdir(tmp_path)
    job, agents = two_agents(free_job_id())
    plan = agents[0][1]
    theirs_logs: list[str] = []
    theirs = control.ControlServer(plan.control_port(), 1, b"their secret", log=theirs_logs.append,
                                   job=f"slurm-{int(job.job_id) + 500}")
    logs: list[str] = []
    try:
        ports = [{p.port for p in plan.processes if p.node == node} for node in job.nodes]
        ports[0].add(plan.control_port())
        # both 'nodes' are this machine: checked, not claimed (a claim would hide each from the other)
        free = [portblocks.claim_blocks(plan, mine, claim=False).free for mine in ports]
        assert free[0] == list(plan.port_fallbacks) and free[1] == list(portblocks.blocks(plan))
        results = form_all(job, agents, free, logs)
        try:
            assert all(isinstance(r, tuple) for r in results), results
            first = plan.port_fallbacks[0]
            assert [r[1].processes[0].port for r in results] == [first, first]
            assert results[0][1].cluster_spec() == results[1][1].cluster_spec()
            assert results[1][0].client.port == portblocks.control_ports(plan)[1]
        finally:
            close_all(results)
    finally:
        theirs.close()
    assert any("an agent of another job (slurm-" in line for line in theirs_logs), theirs_logs
    assert not any("failed authentication" in line for line in theirs_logs), theirs_logs


def test_a_block_taken_on_another_node_only_moves_the_job_there_and_a_rejoining_agent_finds_agent_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """n2 reports the first two blocks taken: agent 0, which claimed the first, moves the job
    to the third and listens on its control port too; an agent that rejoins later with the
    original plan finds agent 0 by trying the blocks in turn."""
    monkeypatch.chdir(tmp_path)
    job, agents = two_agents(free_job_id())
    plan = agents[0][1]
    blocks = list(portblocks.blocks(plan))
    logs: list[str] = []
    results = form_all(job, agents, [blocks, blocks[2:]], logs)
    try:
        assert all(isinstance(r, tuple) for r in results), results
        assert [r[1].processes[0].port for r in results] == [blocks[2], blocks[2]]
        assert any("are taken on n2 (another job" in line and f"uses {blocks[2]}-" in line for line in logs), logs
        with socket.create_connection(("localhost", portblocks.control_ports(plan)[2]), timeout=5):
            pass  # agent 0 listens on the control port of the block the job moved to
        results[1][0].close()
        again = rejoin_job(agents[1][0], plan, OPTIONS, lambda _e: None, timeout=10)
        again.close()
    finally:
        close_all(results)


def test_no_block_free_on_every_node_is_refused_with_the_taken_blocks_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job, agents = two_agents(free_job_id())
    blocks = list(portblocks.blocks(agents[0][1]))
    results = form_all(job, agents, [blocks[:1], blocks[1:]], [])
    close_all(results)
    assert isinstance(results[0], ClusterConfigError), results
    message = str(results[0])
    assert message.startswith("no port block is free on every node of the job: taken are ")
    assert f"{blocks[0]}-{blocks[0] + PORT_BLOCK - 1} on n2" in message and f"{blocks[1]}-" in message
    assert "HINT: pass --port-base" in message
    assert isinstance(results[1], control.ControlError)  # agent 0 went away before the start


def test_a_client_skips_a_program_that_is_no_agent_when_it_has_other_ports_to_try() -> None:
    squatter = socket.create_server(("127.0.0.1", 0))
    squatter_port = squatter.getsockname()[1]
    server = control.ControlServer(free_port(), 1, b"s", bind="127.0.0.1", log=lambda _l: None,
                                   job="slurm-1")

    def greet_garbage() -> None:
        conn, _ = squatter.accept()
        conn.sendall(b"HTTP/1.0 400 Bad Request\r\n")
        conn.close()

    threading.Thread(target=greet_garbage, daemon=True).start()
    try:
        client = control.ControlClient("127.0.0.1", squatter_port, {"agent": 1, "node": "n1"}, 10, b"s",
                                       job="slurm-1", also_at=[server.port])
        assert client.port == server.port
        client.close()
    finally:
        server.close()
        squatter.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_claim_keeps_another_jobs_agent_off_the_block_on_this_node_until_it_is_dropped() -> None:
    """Two jobs with the same blocks on one node: the agent that claims first has them all; the
    other finds none free, even though no process listens yet. Once the first keeps only its
    job's block, the others are free again; a connection to a claim is refused at once."""
    plan = build_plan(JobInfo("slurm", free_job_id(), ("localhost", "n2"), (1, 1)), "allreduce")
    mine = [p.port for p in plan.processes if p.node == "n2"]
    first = portblocks.claim_blocks(plan, mine)
    try:
        assert first.free == list(portblocks.blocks(plan))
        assert portblocks.claim_blocks(plan, mine).free == []  # the other job's agent, a moment later
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", portblocks.claim_port(first.free[0])), timeout=5)
        first.keep(first.free[2])
        other = portblocks.claim_blocks(plan, mine)
        assert other.free == [b for b in portblocks.blocks(plan) if b != first.free[2]]
        other.close()
        # the agents of one job on one node (one task per process) check without claiming
        assert portblocks.claim_blocks(plan, mine, claim=False).free == [b for b in portblocks.blocks(plan)
                                                                         if b != first.free[2]]
    finally:
        first.close()
