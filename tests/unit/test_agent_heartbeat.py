"""Agent 0 names a node whose agent went silent (no heartbeat), with the real agent code."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cluster_parsers import JobInfo
from keras_distrib.launcher.agent import Agent, LaunchSpec, State
from keras_distrib.launcher.formation import Identity, form_job
from keras_distrib.launcher.messages import FromPeer, Start, Stop
from keras_distrib.launcher.options import Options
from keras_distrib.logs import configure_launcher
from keras_distrib.plan import build_plan

pytestmark = pytest.mark.unit


def free_port_block() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1] - 10


def make_agent(agent_id: int, job: JobInfo, port_base: int, options: Options, processes: Any = None) -> Agent:
    identity = Identity(agent_id, job.num_nodes, job.nodes[agent_id], dict(enumerate(job.nodes)))
    here = JobInfo(job.scheduler, job.job_id, job.nodes, job.tasks_per_node, node_index=agent_id)
    return Agent(LaunchSpec(here, build_plan(here, "allreduce", port_base), options, script="train.py"), identity,
                 processes=processes)


def form(agent: Agent) -> None:
    """The real formation, then the channel handed to the agent (no process is started)."""
    agent.channel, plan = form_job(agent.identity, agent.spec.job, agent.plan, agent.spec.options, agent.post, agent.log)


def formed_agents(job: JobInfo, port_base: int, options: Options, processes: Any = None) -> list[Agent]:
    """One agent per node of ``job``, each forming the job in its own thread (as on its node)."""
    agents = [make_agent(i, job, port_base, options, processes and processes()) for i in range(len(job.nodes))]
    configure_launcher()  # the launcher's entry point does this: lines go to stderr
    threads = [threading.Thread(target=form, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return agents


@pytest.mark.parametrize("requeue", [False, True])
def test_a_silent_node_stops_the_job_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str], requeue: bool) -> None:
    """With --requeue the job is also requeued (a fake scontrol records the call), to resume from
    the last checkpoint on the nodes the scheduler gives it next."""
    monkeypatch.chdir(tmp_path)  # the job secret file goes here
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    job = JobInfo("slurm", "99", ("localhost", "n2", "n3"), (1, 1, 1))
    options = Options(startup_timeout=120.0, heartbeat_timeout=1.5, requeue=requeue)
    port_base = free_port_block()
    agents = formed_agents(job, port_base, options)
    try:
        assert hasattr(agents[0].channel, "server") and all(hasattr(a.channel, "client") for a in agents[1:])
        agents[2].channel.client._closed.set()  # n3 goes silent: no heartbeat, its socket stays open
        started = time.monotonic()
        event: Any = agents[0].events.get(timeout=15)
        agents[0].handle(event)
        assert agents[0].result is not None
        code = agents[0].result.code
        took = time.monotonic() - started
        assert code == (0 if requeue else 1) and took < 10
        err = capsys.readouterr().err
        assert "lost the node n3: its agent sent no heartbeat for" in err and "stopping the job" in err
        if requeue:
            assert calls.read_text() == "requeue 99\n"
            assert "requeued job 99 (scontrol requeue 99)" in err
        else:
            assert not calls.exists() and "requeue" not in err
        # n2 is told to stop; it was never reported lost
        assert agents[1].events.get(timeout=5) == FromPeer(0, Stop(code))
        assert (tmp_path / ".keras_distrib" / "secret-slurm-99").read_text() != ""
    finally:
        for a in agents:
            a.channel.close()
    assert not (tmp_path / ".keras_distrib" / "secret-slurm-99").exists()  # agent 0 removed it at the end


def test_with_min_nodes_a_silent_node_is_dropped_and_the_others_re_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The real channel carries the re-forming order: n2 restarts its process from the survivors' plan."""
    from test_agent_lifecycle import FakeProcesses

    monkeypatch.chdir(tmp_path)
    job = JobInfo("slurm", "98", ("localhost", "n2", "n3"), (1, 1, 1))
    options = Options(startup_timeout=120.0, heartbeat_timeout=1.5, min_nodes=2)
    port_base = free_port_block()
    agents = formed_agents(job, port_base, options, FakeProcesses)
    try:
        for a in agents:
            a.begin(a.channel, a.plan)
        agents[2].channel.client._closed.set()  # n3 goes silent
        agents[0].handle(agents[0].events.get(timeout=15))
        assert agents[0].result is None and agents[0].state is State.RUNNING and agents[0].generation.number == 1
        err = capsys.readouterr().err
        assert "lost n3; continuing on 2 nodes (localhost, n2) from the start (its agent sent no heartbeat for" in err
        order = agents[1].events.get(timeout=5)
        assert order == FromPeer(0, Start(generation=1, nodes=("localhost", "n2")))
        agents[1].handle(order)
        assert agents[1].state is State.RUNNING and agents[1].generation.number == 1
        assert agents[1].processes.reformed == [["worker:1"]]  # type: ignore[attr-defined]
    finally:
        for a in agents:
            a.channel.close()


def test_a_dropped_agent_reconnects_and_rejoins_at_the_next_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25 §2 over the real channel: n3 goes silent and is dropped; its agent notices, stops
    its processes and connects again; agent 0 takes it back once a newer checkpoint exists."""
    from test_agent_lifecycle import FakeProcesses, checkpoint_at

    from keras_distrib.launcher.messages import JoinDue, PeerGone, PeerJoined, Rejoined

    monkeypatch.chdir(tmp_path)
    job = JobInfo("slurm", "97", ("localhost", "n2", "n3"), (1, 1, 1))
    options = Options(startup_timeout=120.0, heartbeat_timeout=1.5, min_nodes=2)
    agents = formed_agents(job, free_port_block(), options, FakeProcesses)
    first, _, third = agents

    def checkpoint(step: int, epoch: int) -> None:
        checkpoint_at(first.processes, tmp_path, monkeypatch, step, epoch, "worker-0")

    try:
        for a in agents:
            a.begin(a.channel, a.plan)
        checkpoint(100, 1)
        third.channel.client._closed.set()  # n3 goes silent (its heartbeat thread stops)
        first.handle(first.events.get(timeout=15))
        assert first.plan.nodes == ("localhost", "n2")
        gone = third.events.get(timeout=15)  # agent 0 dropped the silent connection
        assert gone == PeerGone(0)
        third.handle(gone)
        assert third.state is State.FORMING and third.processes.reformed == [[]]  # type: ignore[attr-defined]
        back = third.events.get(timeout=15)
        assert isinstance(back, Rejoined)
        third.handle(back)
        joined = first.events.get(timeout=15)
        assert isinstance(joined, PeerJoined) and joined.agent == 2
        first.handle(joined)
        first.handle(JoinDue())  # no newer checkpoint yet
        assert first.plan.nodes == ("localhost", "n2")
        checkpoint(200, 2)
        first.handle(JoinDue())
        assert first.plan.nodes == job.nodes and first.generation.number == 2
        order = third.events.get(timeout=5)
        assert order == FromPeer(0, Start(generation=2, nodes=job.nodes))
        third.handle(order)
        assert third.state is State.RUNNING and third.processes.reformed[-1] == ["worker:2"]  # type: ignore[attr-defined]
        err = capsys.readouterr().err
        assert "n3 rejoined; continuing on 3 nodes (localhost, n2, n3) from the checkpoint at epoch 2, step 200" in err
    finally:
        for a in agents:
            a.channel.close()
