"""The agent's state machine, driven with fake children, a fake channel and fake timers.

No process, socket or thread: each case feeds events to ``Agent.handle`` and checks the
state, the result, what the agent did to its processes and what it sent to the others.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from cluster_parsers import JobInfo
from keras_distrib.contract import PREEMPTED_EXIT_CODE
from keras_distrib.launcher.agent import TRANSITIONS, Agent, LaunchSpec, State
from keras_distrib.launcher.formation import Identity
from keras_distrib.launcher.messages import (
    ChildExited, Died, Done, Event, Failed, FromPeer, Hello, JobMessage, OrphanStopDeadline, PeerGone, PeerSilent, Restart,
    ScriptStopDeadline, WorkersEndDeadline, SignalReceived, Start, StartupChecked, Stop,
)
from keras_distrib.launcher.options import Options
from keras_distrib.launcher.workers import Launch
from keras_distrib.plan import Plan, Process, build_plan

pytestmark = pytest.mark.unit


@dataclass(eq=False)
class FakeChild:
    proc: Process
    runs_script: bool
    alive: bool = True
    tail: tuple[bytes, ...] = ()  # its output's last lines

    @property
    def label(self) -> str:
        return f"{self.proc.name} on {self.proc.node}"


@dataclass
class FakeProcesses:
    children: list[FakeChild] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    restarted: list[list[str]] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)
    reformed: list[list[str]] = field(default_factory=list)  # what each re-forming started here
    plan_file: Path | None = None  # where progress files are (None: none yet, as before a start)

    def start(self, plan: Plan, launches: list[Launch]) -> None:
        self.launches += launches
        self.children += [FakeChild(launch.proc, launch.runs_script) for launch in launches]

    def restart(self, names: list[str]) -> int:
        self.restarted.append(list(names))
        old = [c for c in self.children if c.proc.name in names]
        for child in old:
            self.children[self.children.index(child)] = FakeChild(child.proc, child.runs_script)
        return len(old)

    def reform(self, plan: Plan, launches: list[Launch]) -> None:
        self.reformed.append([launch.proc.name for launch in launches])
        self.children = [FakeChild(launch.proc, launch.runs_script) for launch in launches]

    def current(self, child: Any) -> bool:
        return child in self.children

    def has_script(self) -> bool:
        return any(c.runs_script for c in self.children)

    def script_running(self) -> bool:
        return any(c.runs_script and c.alive for c in self.children)

    def forward(self, signum: int) -> None:
        self.forwarded.append(signum)

    def shutdown(self, grace: float) -> None:
        pass

    def watched(self) -> list[Any]:
        return []  # no operating-system process to sample

    def progress_file(self, proc: Process) -> Path | None:
        from keras_distrib.contract import progress_file

        return None if self.plan_file is None else progress_file(self.plan_file, proc)

    def named(self, name: str) -> FakeChild:
        return next(c for c in self.children if c.proc.name == name)


@dataclass
class FakeChannel:
    to_leader_sent: list[JobMessage] = field(default_factory=list)
    to_all_sent: list[JobMessage] = field(default_factory=list)
    linger: float = 0.0

    def to_leader(self, message: JobMessage) -> None:
        self.to_leader_sent.append(message)

    def to_all(self, message: JobMessage) -> None:
        self.to_all_sent.append(message)

    def close(self) -> tuple[int, ...]:
        return ()


@dataclass
class FakeTimers:
    pending: list[tuple[float, Event]] = field(default_factory=list)

    def after(self, seconds: float, event: Event) -> None:
        self.pending.append((seconds, event))


@dataclass
class Harness:
    agent: Agent
    processes: FakeProcesses
    channel: FakeChannel
    timers: FakeTimers
    requeued: list[bool]

    def exit(self, name: str, code: int) -> None:
        """The child ``name`` ends with ``code`` (a negative code: killed by that signal)."""
        child = self.processes.named(name)
        child.alive = False
        self.agent.handle(ChildExited(child, code))  # type: ignore[arg-type]

    @property
    def state(self) -> State:
        return self.agent.state


NODES = ("n1", "n2", "n3")


def harness(layout: str = "ps-per-node", agent_id: int = 0, requeue_code: int = 0, backend: str = "tensorflow",
            **options: Any) -> Harness:
    job = JobInfo("slurm", "5", NODES, (1, 1, 1), node_index=agent_id)
    plan = build_plan(job, layout, backend=backend)
    identity = Identity(agent_id, len(NODES), NODES[agent_id], dict(enumerate(NODES)))
    processes, channel, timers, requeued = FakeProcesses(), FakeChannel(), FakeTimers(), []

    def requeue(scheduler: str, environ: Any, enabled: bool, say: Any) -> int:
        requeued.append(enabled)
        return requeue_code if enabled else PREEMPTED_EXIT_CODE

    agent = Agent(LaunchSpec(job, plan, Options(**options), script="train.py"), identity, processes=processes,
                  timers=timers, requeue=requeue, environ={})
    agent.begin(channel, plan)
    return Harness(agent, processes, channel, timers, requeued)


@pytest.fixture(autouse=True)
def lines() -> Iterator[list[str]]:
    """The agent's log lines (whatever logging the process has configured)."""
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)  # the transitions are DEBUG lines
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("keras_distrib")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


# -- start ---------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "agent_id", "expected"), [
    ("ps-per-node", 0, [("chief:0", True), ("ps:0", False), ("worker:0", False)]),
    ("ps-per-node", 2, [("ps:2", False), ("worker:2", False)]),
    ("allreduce", 1, [("worker:1", True)]),
    ("jax", 0, [("worker:0", True)]),
])
def test_start_launches_this_nodes_processes(layout: str, agent_id: int, expected: list[Any]) -> None:
    h = harness(layout, agent_id)
    assert h.state is State.RUNNING and h.agent.generation.number == 0
    assert [(launch.proc.name, launch.runs_script) for launch in h.processes.launches] == expected
    for launch in h.processes.launches:
        assert launch.argv[-1] == "train.py" if launch.runs_script else launch.argv[-1] == "keras_distrib.servers"
    # allreduce: workers other than 0 are quiet unless --verbose
    assert [launch.quiet for launch in h.processes.launches] == [layout == "allreduce" and agent_id > 0] * len(expected)
    assert h.channel.to_all_sent == h.channel.to_leader_sent == []


def test_only_the_allowed_transitions_happen() -> None:
    h = harness()
    h.agent._enter(State.DRAINING)
    with pytest.raises(AssertionError, match="no transition DRAINING -> FORMING"):
        h.agent._enter(State.FORMING)  # a job draining on a signal is not re-formed
    assert TRANSITIONS[State.STOPPED] == frozenset()
    # an elastic re-forming: running or waiting -> forming -> running
    assert State.FORMING in TRANSITIONS[State.RUNNING] and State.FORMING in TRANSITIONS[State.WAITING]
    assert State.RUNNING in TRANSITIONS[State.FORMING]


# -- deaths and restarts ------------------------------------------------------------------


def test_a_dead_worker_with_restarts_left_is_restarted_alone(lines: list[str]) -> None:
    h = harness(max_restarts=2)
    h.exit("worker:0", -signal.SIGKILL)
    assert h.state is State.RUNNING and h.agent.restarts.used == 1
    assert h.processes.restarted == [["worker:0"]]
    assert h.channel.to_all_sent == [Restart(("worker:0",))]
    assert "worker:0 on n1 exited with signal 9 (SIGKILL); restarting it (1/2)" in lines


@pytest.mark.parametrize("agent_id", [0, 1])
def test_a_server_that_stops_on_its_setup_fails_the_job_without_restarts(agent_id: int, lines: list[str]) -> None:
    """Exit code 2 (e.g. --require-gpus and no GPU seen): a restart would stop the same way."""
    h = harness(agent_id=agent_id, max_restarts=3)
    h.exit(f"worker:{agent_id}", 2)
    assert h.processes.restarted == [] and h.state is State.STOPPED and h.agent.result.code == 2
    assert any(f"worker:{agent_id} on n{agent_id + 1} stopped with exit code 2: its setup is wrong" in line
               for line in lines)
    if agent_id:
        assert h.channel.to_leader_sent[-1] == Failed(h.agent.result.reason, 2)


def test_a_dead_ps_restarts_the_chief_too() -> None:
    h = harness()
    h.agent.handle(FromPeer(1, Died("ps:1", "ps:1 on n2", -9)))
    assert h.channel.to_all_sent == [Restart(("ps:1", "chief:0"))]
    assert h.processes.restarted == [["ps:1", "chief:0"]]


def test_an_exit_of_a_replaced_child_is_no_news() -> None:
    h = harness()
    old = h.processes.named("worker:0")
    h.exit("worker:0", -9)
    h.agent.handle(ChildExited(old, -9))  # type: ignore[arg-type]  # the same, delivered late
    assert h.agent.restarts.used == 1 and h.state is State.RUNNING


def test_another_node_reports_a_death_and_waits_for_the_order() -> None:
    h = harness(agent_id=1)
    h.exit("worker:1", -9)
    assert h.channel.to_leader_sent == [Died("worker:1", "worker:1 on n2", -9)]
    assert h.processes.restarted == []
    h.agent.handle(FromPeer(0, Restart(("worker:1",))))
    assert h.processes.restarted == [["worker:1"]] and h.state is State.RUNNING


def test_allreduce_restart_brings_a_waiting_agent_back_to_running() -> None:
    h = harness("allreduce", agent_id=1)
    h.exit("worker:1", 0)
    assert h.state is State.WAITING and h.channel.to_leader_sent == [Done(1, 0)]
    h.agent.handle(FromPeer(0, Restart(("worker:0", "worker:1", "worker:2"))))
    assert h.state is State.RUNNING


@pytest.mark.parametrize("max_restarts", [0, 1, 2])
def test_a_spent_budget_stops_the_job_naming_the_process(max_restarts: int, lines: list[str]) -> None:
    h = harness(max_restarts=max_restarts)
    for _ in range(max_restarts):
        h.exit("ps:0", -9)
        assert h.state is State.RUNNING
    h.exit("ps:0", -9)
    assert h.state is State.STOPPED and h.agent.result is not None
    assert h.agent.result.code == 137 and h.agent.result.restarts == max_restarts
    assert h.channel.to_all_sent[-1] == Stop(137)
    if max_restarts:
        assert f"the restart budget is spent ({max_restarts}/{max_restarts})" in lines[-1]
    else:  # restarts off: the first death stops the job
        assert lines[-1] == "ps:0 on n1 exited unexpectedly with signal 9 (SIGKILL); stopping the job."


def test_script_failing_on_its_own_is_not_restarted() -> None:
    h = harness()
    h.exit("chief:0", 3)
    assert h.agent.result is not None and h.agent.result.code == 3 and h.processes.restarted == []


# -- preemption and signals -------------------------------------------------------------------


@pytest.mark.parametrize(("requeue", "code"), [(False, PREEMPTED_EXIT_CODE), (True, 0)])
def test_a_checkpoint_after_preemption_requeues_when_asked(requeue: bool, code: int) -> None:
    h = harness(requeue=requeue)
    h.agent.handle(SignalReceived(signal.SIGUSR1))
    assert h.processes.forwarded == [signal.SIGUSR1] and h.state is State.RUNNING
    h.exit("chief:0", PREEMPTED_EXIT_CODE)
    assert h.requeued == [requeue]
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == code


def test_sigterm_drains_then_ends_with_the_script() -> None:
    h = harness()
    h.agent.handle(SignalReceived(signal.SIGTERM))
    assert h.state is State.DRAINING and h.processes.forwarded == [signal.SIGTERM]
    assert [type(e) for _, e in h.timers.pending] == [ScriptStopDeadline]
    h.exit("ps:0", -signal.SIGTERM)  # a server ended by the same signal: expected, not restarted
    assert h.state is State.DRAINING and h.processes.restarted == []
    h.exit("chief:0", PREEMPTED_EXIT_CODE)
    assert h.agent.result is not None and h.agent.result.code == PREEMPTED_EXIT_CODE


def test_a_hung_script_is_stopped_at_the_deadline(lines: list[str]) -> None:
    h = harness()
    h.agent.handle(SignalReceived(signal.SIGINT))
    h.agent.handle(ScriptStopDeadline())
    assert h.agent.result is not None and h.agent.result.code == 130
    assert lines[-1].startswith("SCRIPT did not end within 120 s of the SIGINT")


def test_sigterm_on_a_node_without_script_waits_for_the_order() -> None:
    h = harness(agent_id=2)
    h.agent.handle(SignalReceived(signal.SIGTERM))
    assert h.state is State.DRAINING and [type(e) for _, e in h.timers.pending] == [OrphanStopDeadline]
    h.agent.handle(FromPeer(0, Stop(143)))
    assert h.agent.result is not None and h.agent.result.code == 0


def test_no_order_after_the_signal_stops_anyway() -> None:
    h = harness(agent_id=2)
    h.agent.handle(SignalReceived(signal.SIGTERM))
    h.agent.handle(OrphanStopDeadline())
    assert h.agent.result is not None and h.agent.result.code == 143


def test_sigterm_on_agent_0_without_script_stops_at_once() -> None:
    h = harness("allreduce", agent_id=0)
    h.processes.children.clear()  # e.g. the check: nothing of SCRIPT here
    h.agent.handle(SignalReceived(signal.SIGTERM))
    assert h.agent.result is not None and h.agent.result.code == 143 and h.channel.to_all_sent == [Stop(143)]


# -- peers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("requeue", [False, True])
def test_a_lost_node_stops_the_job_and_requeues_when_asked(requeue: bool, lines: list[str]) -> None:
    h = harness(requeue=requeue)
    h.agent.handle(PeerSilent(2, 31.2))
    assert h.state is State.STOPPED and h.agent.result is not None
    assert h.agent.result.reason == "lost the node n3: its agent sent no heartbeat for 31 s (node down or network cut)"
    assert h.requeued == ([True] if requeue else [])
    assert h.agent.result.code == (0 if requeue else 1)
    assert h.agent.result.lost_node == (None if requeue else "n3")  # without requeue, run() ends the step
    assert h.channel.to_all_sent == [Stop(h.agent.result.code)]


@pytest.mark.parametrize("requeue", [False, True])
def test_an_agent_that_disconnects_stops_the_job_and_requeues_it_when_asked(requeue: bool) -> None:
    """As a silent node: a chaos run killed an agent with the job at its --min-nodes, and the
    job stopped although --requeue was given."""
    h = harness(requeue=requeue)
    h.agent.handle(PeerGone(1))
    assert h.agent.result is not None and h.agent.result.code == (0 if requeue else 1)
    assert h.agent.result.reason == "the agent on n2 disconnected unexpectedly"
    assert h.requeued == ([True] if requeue else [])


def test_losing_agent_0_stops_this_node() -> None:
    h = harness(agent_id=1)
    h.agent.handle(PeerGone(0))
    assert h.agent.result is not None and h.agent.result.code == 1


def test_another_agents_failure_stops_the_job_with_its_code() -> None:
    h = harness()
    h.agent.handle(FromPeer(2, Failed("worker:2 on n3 exited unexpectedly with exit code 4", 4)))
    assert h.agent.result is not None and h.agent.result.code == 4 and h.channel.to_all_sent == [Stop(4)]


def test_unreachable_servers_at_start_up_fail_naming_them() -> None:
    h = harness()
    h.agent.handle(StartupChecked(()))
    assert h.state is State.RUNNING
    ps = h.agent.plan.find("ps", 1)
    h.agent.handle(StartupChecked((ps,)))
    assert h.agent.result is not None and h.agent.result.code == 1 and "(ps:1 on n2)" in (h.agent.result.reason or "")


# -- clean exit -------------------------------------------------------------------------------


def test_ps_job_ends_when_the_chief_ends() -> None:
    h = harness()
    h.exit("chief:0", 0)
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 0
    assert h.agent.result.reason is None and h.channel.to_all_sent == [Stop(0)]
    h.agent.handle(PeerGone(1))  # after the end, nothing changes
    assert h.agent.result.code == 0


@pytest.mark.parametrize("code", [0, PREEMPTED_EXIT_CODE])
def test_a_jax_ps_job_ends_when_the_chief_ends_though_its_worker_still_runs_script(code: int) -> None:
    """On JAX the ps layouts' workers run SCRIPT only to serve the chief's fits: one still in it
    (restarted after its fit, waiting for parts that never come) must not hold the job past a wait."""
    h = harness(backend="jax")
    assert h.processes.named("worker:0").runs_script and h.processes.named("worker:0").alive
    h.exit("chief:0", code)
    assert h.state is State.RUNNING and [type(e) for _, e in h.timers.pending] == [WorkersEndDeadline]
    h.agent.handle(h.timers.pending[0][1])
    assert h.state is State.STOPPED and h.agent.result is not None
    assert h.channel.to_all_sent == [Stop(0)] if code == 0 else h.requeued == [False]


@pytest.mark.parametrize("code", [0, PREEMPTED_EXIT_CODE])
def test_a_jax_ps_job_ends_with_the_chiefs_code_when_its_workers_end_by_themselves(code: int) -> None:
    h = harness(backend="jax")
    h.exit("chief:0", code)
    h.exit("worker:0", 0)  # a worker's own code does not decide the job's
    assert h.state is State.STOPPED and h.agent.result is not None
    assert h.channel.to_all_sent == [Stop(0)] if code == 0 else h.requeued == [False]
    h.agent.handle(h.timers.pending[0][1])  # the wait's end after the stop: no news
    assert h.state is State.STOPPED


def test_a_jax_ps_chief_that_fails_ends_the_job_at_once() -> None:
    h = harness(backend="jax")
    h.exit("chief:0", 1)
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1


def test_allreduce_job_ends_when_every_agent_is_done() -> None:
    h = harness("allreduce")
    h.exit("worker:0", 0)
    assert h.state is State.WAITING and h.channel.to_all_sent == []
    h.agent.handle(FromPeer(1, Done(1, 0)))
    assert h.state is State.WAITING
    h.agent.handle(FromPeer(2, Done(2, 0)))
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 0
    assert h.channel.to_all_sent == [Stop(0)]


def test_allreduce_job_ends_with_the_first_nonzero_code() -> None:
    h = harness("allreduce", max_restarts=0)
    h.agent.handle(FromPeer(1, Done(1, 2)))
    assert h.agent.result is not None and h.agent.result.code == 2


# -- the wire ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("message", "wire"), [
    (Stop(3), {"stop": 3}),
    (Restart(("ps:1", "chief:0")), {"restart": ["ps:1", "chief:0"]}),
    (Failed("why", 4), {"failed": "why", "code": 4}),
    (Died("ps:1", "ps:1 on n2", -9), {"died": "ps:1", "label": "ps:1 on n2", "code": -9}),
    (Done(2, 0), {"done": 2, "code": 0}),
    (Start(), {"start": {"generation": 0}}),
    (Start({"n1": "10.0.0.1"}, 1), {"start": {"hosts": {"n1": "10.0.0.1"}, "generation": 1}}),
    (Start(generation=2, nodes=("n1", "n3")), {"start": {"generation": 2, "nodes": ["n1", "n3"]}}),
    (Died("ps:1", "ps:1 on n2", -9, 1), {"died": "ps:1", "label": "ps:1 on n2", "code": -9, "generation": 1}),
    (Done(2, 0, 3), {"done": 2, "code": 0, "generation": 3}),
])
def test_each_message_keeps_its_wire_format(message: Any, wire: dict[str, Any]) -> None:
    from keras_distrib.launcher.messages import decode, to_wire

    assert to_wire(message) == wire and decode(wire) == message


@pytest.mark.parametrize("wire", [{}, [], {"bogus": 1}, {"died": "ps:0", "code": 1}, {"failed": "no code"},
                                  {"start": 5}, {"restart": 7}])
def test_unknown_or_malformed_messages_are_refused(wire: Any) -> None:
    from keras_distrib.launcher.messages import MessageError, decode

    with pytest.raises(MessageError):
        decode(wire)


# -- node loss with --min-nodes: continue on the survivors --------------------------------------


@pytest.mark.parametrize(("layout", "here"), [
    ("ps-per-node", ["chief:0", "ps:0", "worker:0"]),
    ("allreduce", ["worker:0"]),
])
def test_a_lost_node_with_min_nodes_reforms_on_the_survivors(layout: str, here: list[str], lines: list[str]) -> None:
    h = harness(layout, min_nodes=2, requeue=True)
    h.agent.handle(PeerSilent(2, 31.2))
    assert h.state is State.RUNNING and h.agent.generation.number == 1 and h.agent.result is None
    assert h.agent.plan.nodes == ("n1", "n2")
    assert h.channel.to_all_sent == [Start(generation=1, nodes=("n1", "n2"))]
    assert h.processes.reformed == [here]
    assert lines[-1] == ("lost n3; continuing on 2 nodes (n1, n2) from the start "
                         "(its agent sent no heartbeat for 31 s)")
    assert h.requeued == []
    # the next generation's plan: n3's processes gone, the others renumbered from 0
    workers = [p.name for p in h.agent.plan.processes if p.job == "worker"]
    assert workers == ["worker:0", "worker:1"]
    # the dropped agent disconnecting or staying silent afterwards is no news
    h.agent.handle(PeerGone(2))
    h.agent.handle(PeerSilent(2, 60))
    assert h.state is State.RUNNING and h.channel.to_all_sent == [Start(generation=1, nodes=("n1", "n2"))]


def test_allreduce_after_a_reforming_ends_when_the_survivors_are_done() -> None:
    h = harness("allreduce", min_nodes=2)
    h.agent.handle(PeerSilent(1, 31))
    assert h.agent.plan.nodes == ("n1", "n3")
    h.exit("worker:0", 0)
    h.agent.handle(FromPeer(2, Done(2, 0, 1)))  # n3's agent, in generation 1: the last one
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 0


def test_a_second_loss_below_the_minimum_stops_or_requeues_as_before(lines: list[str]) -> None:
    h = harness(min_nodes=2)
    h.agent.handle(PeerSilent(2, 31))
    assert h.state is State.RUNNING and h.agent.generation.number == 1
    h.agent.handle(PeerSilent(1, 32))  # one node would be left: below 2
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1
    assert h.agent.result.reason == "lost the node n2: its agent sent no heartbeat for 32 s (node down or network cut)"
    assert h.agent.result.lost_node == "n2"


@pytest.mark.parametrize("requeue", [False, True])
def test_below_min_nodes_stops_or_requeues_as_before(requeue: bool) -> None:
    h = harness(min_nodes=3, requeue=requeue)
    h.agent.handle(PeerSilent(2, 31.2))
    assert h.state is State.STOPPED and h.agent.result is not None
    assert h.agent.result.code == (0 if requeue else 1) and h.requeued == ([True] if requeue else [])
    assert h.channel.to_all_sent == [Stop(h.agent.result.code)] and h.processes.reformed == []


def test_an_agent_that_disconnects_is_dropped_with_min_nodes(lines: list[str]) -> None:
    h = harness(min_nodes=2)
    h.agent.handle(PeerGone(1))
    assert h.state is State.RUNNING and h.agent.plan.nodes == ("n1", "n3")
    assert lines[-1] == "lost n2; continuing on 2 nodes (n1, n3) from the start (its agent disconnected)"


def test_the_first_node_is_never_dropped(lines: list[str]) -> None:
    # the chief's death with the budget spent: the first node would be lost, so the job stops as before
    h = harness(min_nodes=1, max_restarts=0)
    h.exit("ps:0", -9)
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 137
    assert h.processes.reformed == [] and not any(line.startswith("lost ") for line in lines)
    assert not h.agent._may_continue("n1")


def test_budget_spent_drops_the_node_of_the_dead_process(lines: list[str]) -> None:
    h = harness(min_nodes=2, max_restarts=0)
    h.agent.handle(FromPeer(2, Died("worker:2", "worker:2 on n3", -9)))
    assert h.state is State.RUNNING and h.agent.plan.nodes == ("n1", "n2")
    assert h.channel.to_all_sent == [Start(generation=1, nodes=("n1", "n2"))]
    assert h.processes.reformed == [["chief:0", "ps:0", "worker:0"]]
    assert lines[-1] == ("lost n3; continuing on 2 nodes (n1, n2) from the start (worker:2 on n3 exited with "
                         "signal 9 (SIGKILL); the restart budget is spent (0/0))")


def test_with_min_nodes_a_follower_reports_a_death_instead_of_failing() -> None:
    h = harness(agent_id=2, min_nodes=2, max_restarts=0)
    h.exit("worker:2", -9)
    assert h.state is State.RUNNING and h.channel.to_leader_sent == [Died("worker:2", "worker:2 on n3", -9, 0)]


def test_follower_reforms_on_start() -> None:
    h = harness(agent_id=2, min_nodes=2)
    h.agent.handle(FromPeer(0, Start(generation=1, nodes=("n1", "n3"))))  # n2 was lost
    assert h.state is State.RUNNING and h.agent.generation.number == 1
    assert h.processes.reformed == [["ps:1", "worker:1"]]
    h.agent.handle(FromPeer(0, Start(generation=1, nodes=("n1", "n3"))))  # the same order again: nothing
    assert h.processes.reformed == [["ps:1", "worker:1"]]
    h.exit("worker:1", -9)
    assert h.agent.channel.to_leader_sent[-1] == Died("worker:1", "worker:1 on n3", -9, 1)


def test_a_dropped_follower_stops_with_0() -> None:
    h = harness(agent_id=2, min_nodes=2)
    h.agent.handle(FromPeer(0, Start(generation=1, nodes=("n1", "n2"))))
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 0
    assert h.processes.reformed == []


def test_stale_died_and_done_of_an_older_generation_are_ignored() -> None:
    h = harness("allreduce", min_nodes=2, max_restarts=1)
    h.agent.handle(PeerSilent(2, 31))
    h.agent.handle(FromPeer(1, Died("worker:1", "worker:1 on n2", -9, 0)))  # from before the re-forming
    assert h.agent.restarts.used == 0 and h.channel.to_all_sent == [Start(generation=1, nodes=("n1", "n2"))]
    h.agent.handle(FromPeer(1, Done(1, 1, 0)))  # an old SCRIPT's failure: its process is gone
    assert h.state is State.RUNNING
    h.agent.handle(FromPeer(1, Died("worker:1", "worker:1 on n2", -9, 1)))  # the current generation's
    assert h.agent.restarts.used == 1 and h.channel.to_all_sent[-1] == Restart(("worker:0", "worker:1"))


def test_no_reforming_while_draining_on_a_signal() -> None:
    h = harness(min_nodes=2)
    h.agent.handle(SignalReceived(signal.SIGTERM))
    h.agent.handle(PeerSilent(2, 31))
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.lost_node == "n3"


@pytest.mark.parametrize(("layout", "writer"), [("ps-per-node", "chief-0"), ("allreduce", "worker-0")])
def test_the_line_names_the_writers_last_checkpoint(layout: str, writer: str, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> None:
    h = harness(layout, min_nodes=2)
    checkpoint_at(h.processes, tmp_path, monkeypatch, 812, 4, writer)
    h.agent.handle(PeerSilent(2, 31.2))
    assert lines[-1] == ("lost n3; continuing on 2 nodes (n1, n2) from the checkpoint at epoch 4, step 812 "
                         "(its agent sent no heartbeat for 31 s)")


def test_a_hang_without_restarts_drops_the_node(lines: list[str]) -> None:
    from keras_distrib.launcher.messages import Hung, Stuck

    follower = harness(agent_id=2, min_nodes=2, max_restarts=0)
    follower.agent.handle(Hung(follower.processes.named("ps:2"), 300, "stopped", "/tmp/stacks"))  # type: ignore[arg-type]
    assert follower.state is State.RUNNING  # reported, not failed: agent 0 decides
    assert follower.channel.to_leader_sent == [
        Stuck("ps:2", "ps:2 on n3", "made no progress for 300 s (state: stopped); its Python stacks: /tmp/stacks", 0)]
    h = harness(min_nodes=2, max_restarts=0)
    h.agent.handle(FromPeer(2, follower.channel.to_leader_sent[0]))
    assert h.state is State.RUNNING and h.agent.plan.nodes == ("n1", "n2")
    assert lines[-1].startswith("lost n3; continuing on 2 nodes (n1, n2) from the start (ps:2 on n3 made no progress "
                                "for 300 s (state: stopped)")
    assert lines[-1].endswith("; the restart budget is spent (0/0))")


# -- a node comes back (issue 25 §2) --------------------------------------------------------


def checkpoint_at(processes: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, step: int, epoch: int,
                  writer: str = "chief-0", fit_runs: bool = True, last_epoch: bool = False) -> None:
    """The writer notes a checkpoint in its progress file, as its Checkpointer.save does inside
    a fit (``fit_runs``; ``last_epoch``: the fit's last one), (``processes``: the fakes)."""
    from keras_distrib import contract, progress

    processes.plan_file = tmp_path / "plan.json"
    monkeypatch.setenv(contract.PROGRESS_FILE_VAR, str(tmp_path / f"{contract.PROGRESS_FILE_PREFIX}{writer}"))
    progress.reset()
    try:
        counter = progress._current()
        assert counter is not None
        counter.enter(0)  # the depth as the file held it is not read back: write it anew
        counter.enter(1 if fit_runs else 0)
        progress.training_ended(last_epoch)
        progress.checkpointed(step, epoch)
    finally:
        progress.reset()


def hello_of(h: Harness, agent: int, **changes: Any) -> Hello:
    from keras_distrib.launcher.formation import plan_digest

    return replace(Hello(agent, NODES[agent], None, plan_digest(h.agent.spec.plan)), **changes)


def test_a_node_back_joins_at_the_next_checkpoint(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                  lines: list[str]) -> None:
    from keras_distrib.launcher.messages import JoinDue, PeerJoined

    h = harness(min_nodes=2)
    checkpoint_at(h.processes, tmp_path, monkeypatch, 400, 2)
    h.agent.handle(PeerSilent(2, 31))
    assert h.agent.plan.nodes == ("n1", "n2") and h.agent.membership.silent_nodes == {"n3"}
    h.agent.handle(PeerJoined(2, hello_of(h, 2)))
    assert lines[-1] == "n3 is back (its agent connected again); it joins at the job's next checkpoint."
    assert [type(e) for _, e in h.timers.pending] == [JoinDue]
    h.agent.handle(JoinDue())  # no checkpoint since it came back: wait
    assert h.agent.plan.nodes == ("n1", "n2") and len(h.timers.pending) == 2
    checkpoint_at(h.processes, tmp_path, monkeypatch, 600, 3)
    h.agent.handle(JoinDue())
    assert h.agent.plan.nodes == NODES and h.agent.generation.number == 2 and h.state is State.RUNNING
    assert h.channel.to_all_sent[-1] == Start(generation=2, nodes=NODES)
    assert h.processes.reformed[-1] == ["chief:0", "ps:0", "worker:0"]
    assert lines[-1] == "n3 rejoined; continuing on 3 nodes (n1, n2, n3) from the checkpoint at epoch 3, step 600"
    assert h.agent.membership.silent_nodes == set() and h.agent.membership.joining == {}
    # the plan is the job's first one again: n3 holds ps:2 and worker:2
    assert h.agent.plan == h.agent.membership.formed_plan


def test_a_node_back_when_training_is_done_stays_out(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                    lines: list[str]) -> None:
    """A node that comes back must never restart a job whose training is done: the checkpoint
    of the fit's last epoch takes no node back (SCRIPT would run again with nothing to train)."""
    from keras_distrib.launcher.messages import JoinDue, PeerJoined

    h = harness(min_nodes=2)
    checkpoint_at(h.processes, tmp_path, monkeypatch, 400, 2)
    h.agent.handle(PeerSilent(2, 31))
    h.agent.handle(PeerJoined(2, hello_of(h, 2)))
    checkpoint_at(h.processes, tmp_path, monkeypatch, 600, 3, fit_runs=False)  # between fits, or before one
    h.agent.handle(JoinDue())
    assert h.agent.plan.nodes == ("n1", "n2") and h.agent.membership.joining == {2: "n3"}  # it waits
    checkpoint_at(h.processes, tmp_path, monkeypatch, 800, 4, last_epoch=True)
    h.agent.handle(JoinDue())
    assert h.agent.plan.nodes == ("n1", "n2") and h.agent.generation.number == 1 and h.state is State.RUNNING
    assert h.agent.membership.joining == {} and h.processes.reformed == [["chief:0", "ps:0", "worker:0"]]
    assert lines[-1] == "n3 came back, but SCRIPT's training has done its last epoch; it stays out."


def test_a_node_that_leaves_again_before_the_checkpoint_does_not_join(tmp_path: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from keras_distrib.launcher.messages import JoinDue, PeerJoined

    h = harness(min_nodes=2)
    h.agent.handle(PeerSilent(2, 31))
    h.agent.handle(PeerJoined(2, hello_of(h, 2)))
    h.agent.handle(PeerGone(2))
    checkpoint_at(h.processes, tmp_path, monkeypatch, 600, 3)
    h.agent.handle(JoinDue())
    assert h.agent.plan.nodes == ("n1", "n2") and h.agent.generation.number == 1


@pytest.mark.parametrize(("options", "hello", "said"), [
    ({"min_nodes": 1, "max_nodes": 2}, None, "n3 is back, but the job runs on its 2 nodes (--max-nodes); it stays out."),
    ({"min_nodes": 2}, {"plan": "another"},
     "the agent on n3 connected again with another plan (other options?); it stays out."),
])
def test_a_node_back_stays_out_beyond_max_nodes_or_with_another_plan(options: dict[str, Any], hello: Any,
                                                                     said: str, lines: list[str]) -> None:
    from keras_distrib.launcher.messages import PeerJoined

    h = harness(**options)
    h.agent.handle(PeerSilent(2, 31))
    h.agent.handle(PeerJoined(2, hello_of(h, 2, **(hello or {}))))
    assert lines[-1] == said and h.timers.pending == [] and h.agent.membership.joining == {}


def test_jax_takes_a_node_back_at_once(lines: list[str]) -> None:
    from keras_distrib.launcher.messages import JoinDue, PeerJoined

    h = harness("jax", min_nodes=2)
    h.agent.handle(PeerSilent(1, 31))
    h.agent.handle(PeerJoined(1, hello_of(h, 1)))
    assert h.timers.pending == [(0.0, JoinDue())]
    h.agent.handle(JoinDue())
    assert h.agent.plan.nodes == NODES
    assert lines[-1] == "n2 rejoined; continuing on 3 nodes (n1, n2, n3) from its last checkpoint"


def test_a_cut_off_follower_stops_its_processes_and_rejoins_on_start(monkeypatch: pytest.MonkeyPatch,
                                                                     lines: list[str]) -> None:
    from keras_distrib.launcher.messages import Rejoined, RejoinFailed

    h = harness(agent_id=2, min_nodes=2)
    tries: list[float] = []
    monkeypatch.setattr(h.agent, "_reconnect_in_background", lambda delay: tries.append(delay))
    h.agent.handle(PeerGone(0))
    assert h.state is State.FORMING and h.processes.reformed == [[]] and tries == [0.0]
    assert lines[-1].startswith("lost contact with the first node's agent (n1); stopped this node's processes")
    h.agent.handle(PeerGone(0))  # the new connection refused (agent 0 still held the old one): try again
    assert tries == [0.0, 1.0] and h.state is State.FORMING
    channel = FakeChannel()
    h.agent.handle(Rejoined(channel))
    assert h.agent.channel is channel
    h.agent.handle(FromPeer(0, Start(generation=1, nodes=("n1", "n2"))))  # dropped: keep waiting
    assert h.state is State.FORMING and h.processes.reformed == [[], []]
    h.agent.handle(FromPeer(0, Start(generation=2, nodes=NODES)))  # taken back
    assert h.state is State.RUNNING and h.processes.reformed[-1] == ["ps:2", "worker:2"]
    h.agent.handle(PeerGone(0))
    h.agent.handle(RejoinFailed("nothing listens at n1:1 any more (the job ended there)"))
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 0


def test_without_min_nodes_a_cut_off_follower_stops() -> None:
    h = harness(agent_id=2)
    h.agent.handle(PeerGone(0))
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1


def test_the_end_writes_the_exit_code_and_ends_the_step_while_a_silent_node_may_run(tmp_path: Any) -> None:
    from keras_distrib.launcher.messages import FailureDue

    h = harness(min_nodes=2, exit_code_file=str(tmp_path / "sub" / "exit-code"))
    ended: list[str] = []
    h.agent.scheduler = replace(h.agent.scheduler, end_job_step=lambda scheduler, environ, say: ended.append(scheduler))
    h.agent.form = lambda _free=(): (h.channel, h.agent.plan)  # type: ignore[method-assign]
    h.agent.status.state = State.FORMING  # as before run()
    h.agent.post(PeerSilent(2, 31))
    h.agent.post(FromPeer(1, Failed("worker:1 on n2 exited with 3", 3)))
    h.agent.post(FailureDue("worker:1 on n2 exited with 3", 3, 1))  # no loss within the grace
    assert h.agent.run().code == 3
    assert (tmp_path / "sub" / "exit-code").read_text() == "3\n" and ended == ["slurm"]


@pytest.mark.parametrize(("unacknowledged", "code", "named"), [
    ((), 0, None),
    ((2,), 0, "n3"),         # cut off as the last epoch ended: training done, the job ends well
    ((1, 2), 1, "n2, n3"),
])
def test_agents_that_do_not_acknowledge_the_end_are_named_and_the_step_ended(
        unacknowledged: tuple[int, ...], code: int, named: str | None, lines: list[str]) -> None:
    """A node cut off just before the job ends is not noticed (its silence is younger than the
    heartbeat timeout), and srun would wait for its task until Slurm gives the node up: agent 0
    names the agents that did not disconnect after its Stop and ends the step."""
    h = harness("allreduce")
    ended: list[str] = []
    h.agent.scheduler = replace(h.agent.scheduler, end_job_step=lambda scheduler, environ, say: ended.append(scheduler))
    h.agent.form = lambda _free=(): (h.channel, h.agent.plan)  # type: ignore[method-assign]
    h.channel.close = lambda: unacknowledged  # type: ignore[method-assign]
    h.channel.linger = 13.0
    h.agent.status.state = State.FORMING  # as before run(), its processes started already:
    h.agent.begin = lambda _channel, _plan: h.agent._enter(State.RUNNING)  # type: ignore[method-assign]
    h.processes.named("worker:0").alive = False
    h.agent.post(ChildExited(h.processes.named("worker:0"), code))  # type: ignore[arg-type]
    for agent in (1, 2):  # their SCRIPTs ended too (before the cut)
        h.agent.post(FromPeer(agent, Done(agent, 0, 0)))
    assert h.agent.run().code == code
    warned = [line for line in lines if "did not acknowledge the end of the job" in line]
    if named is None:
        assert ended == [] and warned == []
    else:
        assert ended == ["slurm"] and len(warned) == 1
        assert warned[0].startswith(f"the agent on {named} did not acknowledge the end of the job within 13 s")
        assert "result stands. HINT:" in warned[0]


@pytest.mark.parametrize("layout", ["allreduce", "jax"])
def test_with_min_nodes_a_failed_script_waits_for_the_loss_that_explains_it(layout: str, lines: list[str]) -> None:
    """A cut node fails its peers' collectives before its silence is noticed: that is a node loss, not a job failure."""
    from keras_distrib.launcher.messages import FailureDue

    follower = harness(layout, agent_id=1, min_nodes=2)
    follower.exit("worker:1", 1)
    assert follower.state is State.RUNNING  # reported, and waits for the order
    assert follower.channel.to_leader_sent == [Failed("worker:1 on n2 exited unexpectedly with exit code 1", 1)]
    h = harness(layout, min_nodes=2, heartbeat_timeout=10)
    h.exit("worker:0", 1)
    h.agent.handle(FromPeer(1, follower.channel.to_leader_sent[0]))
    assert h.state is State.RUNNING and [s for s, _ in h.timers.pending] == [15.0, 15.0]
    h.agent.handle(PeerSilent(2, 10.5))  # n3's silence: the job re-forms, and the failures are explained
    assert h.agent.plan.nodes == ("n1", "n2") and h.state is State.RUNNING
    for _, due in h.timers.pending:
        h.agent.handle(due)
    assert h.state is State.RUNNING and h.agent.result is None
    h.agent.handle(FromPeer(1, Failed("worker:1 on n2 exited unexpectedly with exit code 1", 1)))  # a real one
    h.agent.handle(FailureDue("worker:1 on n2 exited unexpectedly with exit code 1", 1, 1))
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1
    assert lines[-1] == "worker:1 on n2 exited unexpectedly with exit code 1; no node was lost meanwhile; stopping the job."


def test_without_min_nodes_a_failed_script_stops_the_job_at_once() -> None:
    h = harness("allreduce")
    h.exit("worker:0", 1)
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1


def test_a_joining_agent_connects_without_processes_and_starts_when_taken_in(monkeypatch: pytest.MonkeyPatch,
                                                                            lines: list[str]) -> None:
    """--join: a new agent for a running job connects as its node's agent, runs nothing until
    agent 0's order takes the node in, then runs that node's processes of the plan."""
    from keras_distrib.launcher import membership

    job = JobInfo("slurm", "5", NODES, (1, 1, 1), node_index=2)
    plan = build_plan(job, "ps-per-node")
    processes, channel = FakeProcesses(), FakeChannel()
    agent = Agent(LaunchSpec(job, plan, Options(min_nodes=2), script="train.py", join=True),
                  Identity(2, 3, "n3", dict(enumerate(NODES))), processes=processes, timers=FakeTimers(), environ={})
    reached: list[tuple[Any, ...]] = []
    monkeypatch.setattr(membership, "rejoin_job", lambda *a: reached.append(a) or channel)
    agent.post(FromPeer(0, Start(generation=3, nodes=NODES)))
    agent.post(FromPeer(0, Stop(0)))
    result = agent.run()
    assert reached and reached[0][1] == plan  # the digest agent 0 checks is of the job's first plan
    assert processes.launches == [] and processes.reformed == [["ps:2", "worker:2"]]
    assert agent.generation.number == 3 and result.code == 0
    assert "connected to the first node's agent; it takes this node in at the job's next checkpoint." in lines


def test_a_second_agent_for_a_node_in_the_job_stays_out(lines: list[str]) -> None:
    from keras_distrib.launcher.messages import PeerJoined

    h = harness(min_nodes=2)
    h.agent.handle(PeerJoined(2, hello_of(h, 2)))
    assert lines[-1] == "an agent on n3 connected to join, but n3 is in the job; it stays out."
    assert h.agent.membership.joining == {} and h.agent.plan.nodes == NODES


# What TensorFlow 2.21 printed when an all-reduce peer's link was cut for 8 s (bench/chaos.py,
# allreduce): the coordination service's missed heartbeats abort the collective.
LOST_CONNECTION_TAIL = (
    b"Traceback (most recent call last):\n",
    b'  File "train.py", line 18, in <module>\n',
    b"tensorflow.python.framework.errors_impl.DeadlineExceededError: Graph execution error:\n",
    b"Collective ops is aborted by: Deadline Exceeded\n",
    b"Additional GRPC error information from remote target /job:worker/replica:0/task:2 while calling "
    b"/tensorflow.WorkerService/RecvBuf:\n",
)


@pytest.mark.parametrize("tail, expected", [
    (LOST_CONNECTION_TAIL, "DeadlineExceededError"),
    ((b"tensorflow.python.framework.errors_impl.UnavailableError: recvmsg:Connection reset by peer\n",),
     "UnavailableError"),
    ((b"jaxlib._jax.XlaRuntimeError: UNAVAILABLE: failed to connect to all addresses\n",), "UNAVAILABLE"),
    ((b"jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED: Barrier timed out\n",), "DEADLINE_EXCEEDED"),
    ((b"ValueError: Input 0 of layer dense is incompatible\n",), None),
    ((b"AbortedError: not quite\n", b"During handling of the above exception, another exception occurred:\n",
      b"KeyError: 'loss'\n"), None),  # the last exception is the script's own
    ((b"epoch 3/5\n",), None),
])
def test_a_lost_connection_is_read_from_the_last_exception_line(tail: tuple[bytes, ...], expected: str | None) -> None:
    from keras_distrib.launcher.watchdog import lost_connection

    assert lost_connection(tail) == expected


def test_with_min_nodes_a_lost_connection_no_node_loss_explains_restarts_every_worker_once(lines: list[str]) -> None:
    """A link cut shorter than the heartbeat timeout fails the collectives and no node is lost:
    a passing network fault, restarted within --max-restarts (once for all the failures)."""
    from keras_distrib.launcher.messages import FailureDue

    follower = harness("allreduce", agent_id=1, min_nodes=2, max_restarts=3)
    follower.processes.named("worker:1").tail = LOST_CONNECTION_TAIL
    follower.exit("worker:1", 1)
    reason = "worker:1 on n2 exited unexpectedly with exit code 1 after a lost connection (DeadlineExceededError)"
    assert follower.channel.to_leader_sent == [Failed(reason, 1, "worker:1")]
    h = harness("allreduce", min_nodes=2, max_restarts=3, heartbeat_timeout=10)
    h.processes.named("worker:0").tail = LOST_CONNECTION_TAIL
    h.exit("worker:0", 1)
    h.agent.handle(FromPeer(1, follower.channel.to_leader_sent[0]))
    assert "the job restarts in 15 s unless a node is found lost by then" in lines[-1]
    dues = [due for _, due in h.timers.pending if isinstance(due, FailureDue)]
    assert len(dues) == 2
    for due in dues:
        h.agent.handle(due)
    assert h.processes.restarted == [["worker:0", "worker:1", "worker:2"]] and h.agent.restarts.used == 1
    assert h.state is State.RUNNING and h.agent.result is None
    assert any("no node was lost meanwhile: a passing network fault." in line for line in lines)


def test_with_min_nodes_a_lost_connection_stops_the_job_once_the_budget_is_spent(lines: list[str]) -> None:
    from keras_distrib.launcher.messages import FailureDue

    h = harness("allreduce", min_nodes=2, max_restarts=0, heartbeat_timeout=10)
    h.processes.named("worker:0").tail = LOST_CONNECTION_TAIL
    h.exit("worker:0", 1)
    assert "the job stops in 15 s" in lines[-1]
    [due] = [due for _, due in h.timers.pending if isinstance(due, FailureDue)]
    h.agent.handle(due)
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1


def test_a_failure_held_before_a_restart_does_not_stop_the_restarted_job() -> None:
    """A peer's collective fails before the killed worker's death is handled: the restart the
    death orders replaces what failed, so the held failure stops nothing."""
    from keras_distrib.launcher.messages import FailureDue

    h = harness("allreduce", min_nodes=2, max_restarts=3, heartbeat_timeout=10)
    h.exit("worker:0", 1)  # the script's own error, as far as anyone knows yet
    h.agent.handle(FromPeer(2, Died("worker:2", "worker:2 on n3", -9)))
    assert h.processes.restarted == [["worker:0", "worker:1", "worker:2"]]
    for _, due in h.timers.pending:
        if isinstance(due, FailureDue):
            h.agent.handle(due)
    assert h.state is State.RUNNING and h.agent.result is None


def test_without_min_nodes_a_lost_connection_restarts_and_a_scripts_own_error_stops() -> None:
    h = harness("allreduce", max_restarts=3)
    h.processes.named("worker:0").tail = LOST_CONNECTION_TAIL
    h.exit("worker:0", 1)
    assert h.processes.restarted == [["worker:0", "worker:1", "worker:2"]] and h.state is State.RUNNING
    h.processes.named("worker:0").tail = (b"ValueError: bad input\n",)
    h.exit("worker:0", 1)
    assert h.state is State.STOPPED and h.agent.result is not None and h.agent.result.code == 1
