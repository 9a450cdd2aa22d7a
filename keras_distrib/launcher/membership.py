"""Elastic membership (docs/faults.md, Node loss): its record, and the agent's policy for it.

* ``Membership``: agent 0's record of the nodes beyond the current plan (the nodes the
  job formed on, those back and waiting to join, those dropped for silence), with the
  decisions that follow from it alone, each given what else it needs as arguments.
* ``MembershipPolicy``: the handlers of ``agent.Agent`` (mixed into it, no state of its
  own) for a node lost with --min-nodes (the job re-forms on the survivors), a dropped
  agent that reconnects (it joins at the next checkpoint, up to --max-nodes), and a SCRIPT
  failure held until a node loss explains it. They act through the agent's state machine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from dataclasses import dataclass, field, replace

from .. import progress
from ..contract import PREEMPTED_EXIT_CODE
from ..plan import Plan, moved_plan, survivors_plan
from . import control
from .formation import Channel, plan_digest, rejoin_job
from .messages import FailureDue, Failed, Hello, JoinDue, RejoinFailed, Rejoined, Start
from .states import Generation, State

# How long an agent cut off from agent 0 (--min-nodes) keeps trying to reach it again.
REJOIN_WAIT = 600.0
# How often agent 0 looks for the checkpoint at which a node that came back joins.
JOIN_POLL = 1.0
# With --min-nodes, a SCRIPT that fails waits this long past the heartbeat timeout for the
# node loss that may have caused it (a collective or a ps on a cut node) before the job stops.
FAILURE_GRACE = 5.0


@dataclass
class Membership:
    """Agent 0's record of the job's nodes beyond the current plan."""

    formed_plan: Plan  # generation 0's: every re-forming picks its nodes from it
    joining: dict[int, str] = field(default_factory=dict)  # agents back after a drop, by id: their nodes
    join_mark: tuple[int, int] | None = None  # the writer's last checkpoint when they came back
    join_armed: bool = False  # a JoinDue is pending
    silent_nodes: set[str] = field(default_factory=set)  # dropped for silence: their tasks may still run

    @staticmethod
    def survivors(plan: Plan, lost: str, min_nodes: int | None) -> tuple[str, ...] | None:
        """The nodes the job goes on on without ``lost``; None: too few, or ``lost`` is the
        first node (agent 0 and the chief live there: it is never dropped)."""
        left = tuple(n for n in plan.nodes if n != lost)
        ok = min_nodes is not None and lost != plan.nodes[0] and lost in plan.nodes and len(left) >= min_nodes
        return left if ok else None

    def forget(self, node: str) -> None:
        """``node`` left again before it joined."""
        self.joining = {a: n for a, n in self.joining.items() if n != node}

    def refusal(self, node: str, plan: Plan, closed: str | None, same_plan: bool,
                max_nodes: int | None) -> tuple[int, str] | None:
        """(log level, line) saying why the agent of ``node``, connected again, stays out;
        None: it may join. ``closed``: the job's state where it takes no node (else None)."""
        if node in plan.nodes:  # a second agent for a node in the job (--join on a node not lost)
            return logging.WARNING, f"an agent on {node} connected to join, but {node} is in the job; it stays out."
        if closed is not None:
            return logging.INFO, f"the agent on {node} connected again; the job is {closed}, so it stays out."
        if not same_plan:
            return logging.WARNING, f"the agent on {node} connected again with another plan (other options?); it stays out."
        limit = max_nodes or len(self.formed_plan.nodes)
        if len(plan.nodes) + len(self.joining) >= limit:
            return logging.INFO, f"{node} is back, but the job runs on its {limit} nodes (--max-nodes); it stays out."
        return None

    def admit(self, agent: int, node: str, checkpoint: tuple[int, int] | None) -> None:
        """``node`` joins at the first checkpoint after ``checkpoint`` (the last one now)."""
        if not self.joining:
            self.join_mark = checkpoint
        self.joining[agent] = node

    def take_back(self, plan: Plan) -> tuple[list[str], tuple[str, ...]]:
        """(the nodes back, every node of the next generation, in the formed plan's order)."""
        back = [n for n in self.formed_plan.nodes if n in self.joining.values()]
        nodes = tuple(n for n in self.formed_plan.nodes if n in plan.nodes or n in back)
        self.joining.clear()
        self.silent_nodes -= set(back)
        return back, nodes


class MembershipPolicy:
    """The node-loss and node-return handlers of ``agent.Agent``, which this class is mixed into.

    They read the agent's ``status``, ``membership``, ``spec`` and ``identity`` and act
    through its mechanism (``processes``, ``channel``, ``timers``, ``scheduler``).
    """

    def _on_node_lost(self, node: str, silent_for: float) -> None:
        """Agent 0: a node went silent. Go on without it (--min-nodes), or stop; with --requeue, requeue."""
        if node not in self.plan.nodes:  # dropped already (or came back and left again before joining)
            self.membership.forget(node)
            return
        if (left := self._may_continue(node)) is not None:
            self.membership.silent_nodes.add(node)
            self._reform(node, left, f"its agent sent no heartbeat for {silent_for:.0f} s")
            return
        reason = f"lost the node {node}: its agent sent no heartbeat for {silent_for:.0f} s (node down or network cut)"
        if not self.spec.options.requeue:
            self.fail(reason, 1)
            self.status.result = replace(self.status.result, lost_node=node)  # run() ends the step once all is stopped
            return
        self.log.error(f"{reason}; stopping the job and requeueing it, to resume from the last checkpoint.")
        code = self.scheduler.requeue(self.plan.scheduler, True, self.log.info)
        self._stop(1 if code == PREEMPTED_EXIT_CODE else code, reason)

    # -- node loss: continue on the survivors (--min-nodes; docs/faults.md, Node loss) ----------

    def _node_of(self, name: str) -> str | None:
        """The node of the current plan's process ``name`` (``job:index``); None if it has none."""
        job, _, index = name.partition(":")
        try:
            return self.plan.find(job, int(index)).node
        except (KeyError, ValueError):
            return None

    def _may_continue(self, lost: str) -> tuple[str, ...] | None:
        """Agent 0: the nodes the job goes on on without ``lost``; None: stop or requeue as before."""
        if (not self.identity.leader or self.status.interrupted or self.spec.runs_check
                or self.status.state not in (State.RUNNING, State.WAITING)):
            return None
        return Membership.survivors(self.plan, lost, self.spec.options.min_nodes)

    def _reform(self, lost: str, left: tuple[str, ...], why: str) -> None:
        """Agent 0: say so in one line, order every agent onto the next generation, and go there."""
        self.log.warning(f"lost {lost}; continuing on {len(left)} nodes ({', '.join(left)}) "
                         f"{self._resume_point()} ({why})")
        number = self.status.generation.number + 1
        self.channel.to_all(Start(generation=number, nodes=left, ports=self._moved_to()))  # a dropped agent still connected stops on it
        self._reform_here(number, left)

    def _writer_says(self, read: Callable[[Path], Any]) -> Any:
        """``read`` of the checkpoint writer's progress file (progress.py); None: no file yet."""
        writer = next((p for p in self.plan.script_runners if p.index == 0), None)
        path = None if writer is None else self.processes.progress_file(writer)
        return None if path is None else read(path)

    def _last_checkpoint(self) -> tuple[int, int] | None:
        """(step, epoch) of the writer's last checkpoint; None: none."""
        return self._writer_says(progress.last_checkpoint)

    def _resume_point(self) -> str:
        """Where SCRIPT resumes, for the membership lines."""
        if self.plan.is_jax:  # the jax layouts' SCRIPT checkpoints itself (no keras_distrib.fit): no note
            return "from its last checkpoint"
        last = self._last_checkpoint()
        if last is None:
            return "from the start"
        step, epoch = last
        return f"from the checkpoint at epoch {epoch}, step {step}"

    # -- a node comes back (docs/faults.md, Node loss) ---------------------------------------

    def _elastic(self) -> bool:
        return self.spec.options.min_nodes is not None and not self.spec.runs_check and not self.status.interrupted

    def _script_failed(self, reason: str, code: int, restartable: str = "") -> None:
        """SCRIPT failed here (--min-nodes): a node lost meanwhile may be why, so agent 0 waits to see
        (``restartable``: the process, when it lost its connection)."""
        if self.identity.leader:
            self._hold_failure(reason, code, restartable)
        else:  # report and wait for the order: cut off from agent 0, this agent rejoins instead
            # A warning: agent 0 decides whether it is the job's error (a lost peer's doing is not).
            self.log.warning(f"{reason}; the first node's agent decides (--min-nodes).")
            self.channel.to_leader(Failed(reason, code, restartable))

    def _hold_failure(self, reason: str, code: int, restartable: str = "") -> None:
        """Agent 0: stop the job for ``reason`` unless a node loss re-forms it within the grace (or,
        for a lost connection, restart then, within --max-restarts)."""
        grace = self.spec.options.heartbeat_timeout + FAILURE_GRACE
        then = "restarts" if restartable and self._restart_left() else "stops"
        self.log.warning(f"{reason}; the job {then} in {grace:.0f} s unless a node is found lost by then "
                         "(--min-nodes: a lost peer fails the others' collectives).")
        self.timers.after(grace, FailureDue(reason, code, self.status.generation.number, restartable,
                                            self.restarts.used))

    def _restart_left(self) -> bool:
        return self._may_restart() and self.restarts.used < self.spec.options.max_restarts

    def _on_failure_due(self, due: FailureDue) -> None:
        """Agent 0: no node loss explained a held failure: restart for a lost connection while the
        budget lasts (a network fault that passed), else stop the job."""
        if due.generation != self.status.generation.number or due.restarts != self.restarts.used:
            return  # a re-forming or a restart since replaced what failed
        if due.restartable and self._restart_left():
            self.log.warning(f"{due.reason}; no node was lost meanwhile: a passing network fault.")
            self._decide_restart(due.restartable, f"{due.restartable} on {self._node_of(due.restartable)}", due.code)
            return
        self.log.error(f"{due.reason}; no node was lost meanwhile; stopping the job.")
        self._stop(due.code, due.reason)

    def _may_rejoin(self) -> bool:
        """A follower cut off from agent 0: try to rejoin (--min-nodes), rather than stop."""
        return (self.spec.options.min_nodes is not None and not self.spec.runs_check and not self.status.interrupted
                and self.status.state in (State.RUNNING, State.WAITING, State.FORMING))

    def _rejoin(self, why: str) -> None:
        """RUNNING/WAITING -> FORMING: stop this node's processes (the job goes on without them), reconnect."""
        again = self.status.state is State.FORMING  # a reconnection refused (agent 0 still held the old one)
        if again:
            self.log.debug(f"{why}; reconnecting")
        else:
            self.log.warning(f"{why}; stopped this node's processes (the job goes on without them) and trying "
                             f"for {REJOIN_WAIT:.0f} s to reach it again, to rejoin at the job's next checkpoint.")
        self.processes.reform(self.plan, [])
        self._enter(State.FORMING)
        self._reconnect_in_background(delay=1.0 if again else 0.0)

    def _reconnect_in_background(self, delay: float) -> None:
        def reconnect() -> None:
            threading.Event().wait(delay)
            try:
                channel = rejoin_job(self.identity, self.spec.plan, self.spec.options, self.post, REJOIN_WAIT)
            except (control.ControlError, OSError) as exc:
                self.post(RejoinFailed(str(exc)))
                return
            self.post(Rejoined(channel))

        threading.Thread(target=reconnect, name="rejoin", daemon=True).start()

    def _join(self) -> Channel:
        """--join: connect to agent 0 as this node's agent (FORMING, no processes); it takes this
        node in at the job's next checkpoint, as a dropped agent that came back."""
        self.log.info(f"joining the running job: connecting to the first node's agent "
                      f"({self.identity.agent_nodes[0]}) for up to {REJOIN_WAIT:.0f} s.")
        channel = rejoin_job(self.identity, self.spec.plan, self.spec.options, self.post, REJOIN_WAIT)
        self.log.info("connected to the first node's agent; it takes this node in at the job's next checkpoint.")
        return channel

    def _on_rejoined(self, channel: Channel) -> None:
        self.channel.close()
        self.channel = channel
        if self.status.state is State.FORMING:
            self.log.info("connected to the first node's agent again; it takes this node back at the job's next checkpoint.")

    def _on_joined(self, agent: int, hello: Hello) -> None:
        """Agent 0: a dropped agent connected again: it joins at the next checkpoint, up to --max-nodes."""
        node = self.identity.agent_nodes.get(agent)
        if node is None or not self.identity.leader:
            return
        takes_nodes = (self.spec.options.min_nodes is not None and self.status.state is State.RUNNING
                       and not self.status.interrupted)
        refusal = self.membership.refusal(node, self.plan, None if takes_nodes else self.status.state.value,
                                          hello.plan == plan_digest(self.spec.plan), self.spec.options.max_nodes)
        if refusal is not None:
            self.log.log(*refusal)
            return
        self.membership.admit(agent, node, self._last_checkpoint())
        when = "now (SCRIPT checkpoints itself)" if self.plan.is_jax else "at the job's next checkpoint"
        self.log.info(f"{node} is back (its agent connected again); it joins {when}.")
        self._arm_join(0.0 if self.plan.is_jax else JOIN_POLL)

    def _arm_join(self, seconds: float = JOIN_POLL) -> None:
        if not self.membership.join_armed:
            self.membership.join_armed = True
            self.timers.after(seconds, JoinDue())

    def _on_join_due(self) -> None:
        """Agent 0: once the writer checkpointed after the nodes came back, re-form with them."""
        self.membership.join_armed = False
        if not self.membership.joining or self.status.state is not State.RUNNING or self.status.interrupted:
            return
        if not self.plan.is_jax and self._writer_says(progress.training_done):
            # Re-forming now would run SCRIPT again with nothing left to train.
            back = ", ".join(self.membership.joining.values())
            self.log.info(f"{back} came back, but SCRIPT's training has done its last epoch; it stays out.")
            self.membership.joining.clear()
            return
        mark = self._last_checkpoint()
        fit_runs = self._writer_says(progress.fit_running)
        if not self.plan.is_jax and (mark is None or mark == self.membership.join_mark or not fit_runs):
            self._arm_join()
            return
        back, nodes = self.membership.take_back(self.plan)
        self.log.warning(f"{', '.join(back)} rejoined; continuing on {len(nodes)} nodes ({', '.join(nodes)}) "
                         f"{self._resume_point()}")
        number = self.status.generation.number + 1
        self.channel.to_all(Start(generation=number, nodes=nodes, ports=self._moved_to()))
        self._reform_here(number, nodes)

    def _moved_to(self) -> int | None:
        """The first port of the block the job moved to at start-up (`portblocks`), or None."""
        base = self.membership.formed_plan.processes[0].port
        return base if base != self.spec.plan.processes[0].port else None

    def _reform_here(self, number: int, nodes: tuple[str, ...], ports: int | None = None) -> None:
        """Every agent: RUNNING/WAITING -> FORMING -> RUNNING on generation ``number``, the plan on ``nodes``
        (``ports``: where the job moved at start-up, news to an agent that joined with --join)."""
        rejoining = self.status.state is State.FORMING  # a dropped agent back, not (yet) among ``nodes``
        if ports is not None and ports != self.membership.formed_plan.processes[0].port:
            self.membership.formed_plan = moved_plan(self.membership.formed_plan, self.spec.job, ports)
        self._enter(State.FORMING)
        self.status.generation = Generation(number, survivors_plan(self.membership.formed_plan, self.spec.job, nodes))
        self.restarts.seen += 1  # a Stuck report from before is stale
        self.status.done_agents.clear()  # the new generation's SCRIPTs have not ended
        if self.identity.node not in nodes:
            if rejoining:  # another node's loss or return: keep waiting for this one's turn
                return
            # dropped while still connected (its processes failed): stop
            self.log.info(f"this node left the job, which goes on on {', '.join(nodes)}; stopping here.")
            self._stop(0)
            return
        self.processes.reform(self.plan, [self.launch_of(p) for p in self.my_processes()])
        self._enter(State.RUNNING)
