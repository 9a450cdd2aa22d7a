"""The per-node agent: starts this node's processes of the plan and sees the job to its end.

One agent runs per node (or per task in per-role mode, or one for everything in local
mode). Agent 0 runs on the chief's node; the others connect to it over the control
channel (keras_distrib.launcher.control). The rules:

* start-up: agent 0 waits for every agent to connect, then all start their processes at
  once; an agent or TF server still missing after --startup-timeout is named in one line;
* normal end: when the script ends (the chief, or all allreduce workers), every process on
  every node is stopped and agent 0 exits with the script's exit code;
* failure: any process dying unexpectedly stops the whole job with one line naming it,
  unless restarts are allowed (--max-restarts, see restarts.py): agent 0 then orders the
  restart of the dead process (and of those that depend on it) on every node;
* signals: SIGINT/SIGTERM/SIGUSR1 are forwarded to the children;
* node loss with --min-nodes M: when a node other than the first is lost (silence, its
  agent gone, its processes beyond the restart budget or hung without restarts) and at
  least M nodes are left, agent 0 re-forms the job on them as a new generation of the plan
  (plan.survivors_plan): every agent restarts its processes from it and SCRIPT resumes from
  its last checkpoint. The first node (agent 0, the chief) is never dropped. A dropped
  agent that reaches agent 0 again (a link back) joins at the job's next checkpoint, up to
  the job's size (--max-nodes).

Policy apart from mechanism, as torch's elastic agent does: ``Agent`` is a state machine
(``State``, changed only by ``_enter``) that handles typed events (messages.py) and
decides; what it decides is done by its mechanism (mechanism.py): this node's processes
(workers.LocalProcesses), the channel to the other agents (formation.py), timers and the
scheduler's commands. Its state is one object per concern: ``RunStatus`` (the plan, held
once as a ``Generation`` and replaced as a whole), ``RestartCount`` and ``Membership``.
docs/launcher-internals.md draws the states.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import progress
from ..contract import PREEMPTED_EXIT_CODE, SETUP_EXIT_CODE
from ..logs import ROOT as ROOT_LOGGER
from ..logs import LineFormatter, NodeLogger
from ..network import wait_reachable
from ..plan import CHIEF, TUNER_LAYOUT, Plan, Process, process_for_task
from . import control
from .control import first_few
from . import requeue as requeue_job
from .children import Child, describe_exit, shell_exit_code
from .formation import Channel, Identity, SoloChannel, form_job
from .portblocks import BlockClaims
from .spec import LaunchSpec
from .membership import Membership, MembershipPolicy
from .messages import (
    ChildExited, Died, Done, Event, Failed, FailureDue, FromPeer, Hung, JoinDue, OrphanStopDeadline, PeerGone, PeerJoined,
    PeerSilent, RejoinFailed, Rejoined, Restart, ScriptStopDeadline, SignalReceived, Start, StartupChecked, Stop, Stuck,
    WorkersEndDeadline,
)
from .mechanism import Processes, SchedulerCalls, ThreadTimers, Timers
from .restarts import RestartCount, restart_line, restart_targets
from .states import TRANSITIONS, Generation, RunResult, RunStatus, State
from .watchdog import HangGuard, default_stacks_dir, lost_connection
from .workers import ChildSettings, Launch, LocalProcesses

logger = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# How long an agent with no script waits for agent 0's stop order after SIGTERM/SIGINT.
ORPHAN_STOP_WAIT = 30.0
# How long SCRIPT may take to end after a forwarded SIGTERM/SIGINT (it saves a checkpoint
# at its next step boundary) before the agent stops it: a hung SCRIPT never reaches one.
SCRIPT_STOP_WAIT = 120.0
#: Seconds the JAX workers of a ps layout get to end SCRIPT by themselves after the chief's ended.
WORKERS_END_WAIT = 30.0




class Agent(MembershipPolicy):
    """One agent's share of the job: a state machine over events; ``run()`` returns a RunResult.

    The mechanism (``processes``, ``timers``, ``requeue``, the channel that ``begin``
    gets) is injected, so tests drive the policy with fakes, without processes.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        identity: Identity,
        processes: Processes | None = None,
        timers: Timers | None = None,
        requeue: Callable[..., int] = requeue_job.requeue,
        environ: Mapping[str, str] = os.environ,
        end_step: Callable[..., None] = requeue_job.end_step,
    ) -> None:
        self.spec = spec
        self.identity = identity
        # SimpleQueue.put is reentrant, so a signal handler may post safely.
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        options = spec.options
        self.processes: Processes = processes or LocalProcesses(
            lambda child, code: self.post(ChildExited(child, code)),
            ChildSettings(options.startup_timeout, options.verbose, options.checkpoint_every, options.interface,
                          spec.log_dir, options.require_gpus),
        )
        self.timers: Timers = timers or ThreadTimers(self.post)
        self.scheduler = SchedulerCalls(environ, requeue, end_step)
        self.channel: Channel = SoloChannel()
        self.status = RunStatus(Generation(0, spec.plan))
        self.restarts = RestartCount()
        self.membership = Membership(spec.plan)
        self._ended = threading.Event()  # set when run() returns: its threads stop polling
        self.hangs = HangGuard(  # the hang watchdog (watchdog.py); started by run()
            self.post, self.processes.watched, self.processes.progress_file, lambda: self.plan.processes,
            spec.log_dir or default_stacks_dir(spec.job.scheduler, spec.job.job_id), float(options.hang_timeout),
            identity.num_agents, enabled=options.hang_timeout > 0 and not spec.runs_check)

    @property
    def log(self) -> NodeLogger:
        return NodeLogger(logger, self.identity.node)

    @property
    def state(self) -> State:
        return self.status.state

    @property
    def result(self) -> RunResult | None:
        return self.status.result

    @property
    def generation(self) -> Generation:
        return self.status.generation

    @property
    def plan(self) -> Plan:
        return self.status.generation.plan

    @property
    def members(self) -> set[int]:
        """The agents whose node is in the current generation (all of them until a re-forming)."""
        nodes = set(self.plan.nodes)
        return {a for a, node in self.identity.agent_nodes.items() if node in nodes}

    def post(self, event: Event) -> None:
        self.events.put(event)

    # -- what runs here -------------------------------------------------------------

    def my_processes(self) -> list[Process]:
        plan, identity = self.plan, self.identity
        if identity.local:
            mine = list(plan.processes)
        elif self.spec.mode == "per-role":
            mine = [process_for_task(self.spec.job, plan)]
        else:
            mine = [p for p in plan.processes if p.node == self.identity.node]  # node indices change on re-forming
        checks = self.spec.runs_check and identity.leader and not plan.is_jax  # jax processes check themselves
        if checks and not any(p.job == CHIEF for p in plan.processes):
            # allreduce has no chief: the check runs as an extra client on the first node.
            first = plan.processes[0]
            mine.append(Process(first.node, 0, CHIEF, 0, first.host, plan.control_port() + 1, ()))
        return mine

    def runs_script(self, proc: Process) -> bool:
        if self.spec.runs_check and not self.plan.is_jax:
            return proc.job == CHIEF
        return self.plan.runs_script(proc)

    def launch_of(self, proc: Process) -> Launch:
        script = self.runs_script(proc)
        if not script:
            argv: tuple[str, ...] = (sys.executable, "-m", "keras_distrib.servers")
        elif self.spec.runs_check:
            argv = (sys.executable, "-m", "keras_distrib.check")
        else:
            runner = ("-m", "keras_distrib.tuning") if self.plan.layout == TUNER_LAYOUT else ()
            argv = (sys.executable, "-u", *runner, str(self.spec.script), *self.spec.script_args)
        verbose = self.spec.options.verbose
        quiet = not verbose and not self.plan.speaks_for_itself(proc)
        return Launch(proc, argv, script, banners=verbose, quiet=quiet)

    # -- transitions ------------------------------------------------------------------

    def _enter(self, state: State) -> None:
        if state is self.status.state:
            return
        if state not in TRANSITIONS[self.status.state]:
            raise AssertionError(f"agent {self.identity.agent_id}: no transition {self.status.state.name} -> {state.name}")
        self.log.debug(f"state {self.status.state.name} -> {state.name}")
        self.status.state = state

    def begin(self, channel: Channel, plan: Plan) -> None:
        """FORMING -> RUNNING: the job formed on ``plan``; start this node's processes."""
        self.channel = channel
        self.status.generation = Generation(self.status.generation.number, plan)
        self.membership.formed_plan = plan
        self.processes.start(plan, [self.launch_of(p) for p in self.my_processes()])
        self._enter(State.RUNNING)

    def _stop(self, code: int, reason: str | None = None) -> None:
        """-> STOPPED with ``code``; agent 0 tells every agent to stop."""
        self.channel.to_all(Stop(code))
        self.status.result = RunResult(code, reason, self.restarts.used)
        self._enter(State.STOPPED)

    def fail(self, reason: str, code: int) -> None:
        self.log.error(f"{reason}; stopping the job.")
        self.channel.to_leader(Failed(reason, code))
        self._stop(code, reason)

    # -- the event loop ---------------------------------------------------------------

    def run(self, claims: BlockClaims | None = None) -> RunResult:
        """Form the job, start this node's processes, handle events until the job ends.

        ``claims``: the plan's port blocks free for this agent's processes, claimed on its node
        (`portblocks.claim_blocks`), where the plan may move; None when its ports are fixed.
        """
        try:
            channel, plan = (self._join(), None) if self.spec.join else self.form(claims)
        except control.ControlError as exc:
            hint = ("--join needs the job running, with the same options as its agents" if self.spec.join else
                    "start one agent per node (srun --ntasks-per-node=1)")
            self.log.error(f"{exc}. HINT: {hint}; check that node names resolve and the ports are open.")
            return RunResult(1, str(exc))
        # Caught before the children start: a signal that comes while they start (say the
        # script's first line is already out) is queued and forwarded, not lost or fatal.
        previous = {s: signal.signal(s, lambda signum, _f: self.post(SignalReceived(signum))) for s in FORWARDED_SIGNALS}
        kept = self._keep_own_lines()
        try:
            if plan is None:  # --join: no processes until agent 0 takes this node in
                self.channel = channel
            else:
                self.begin(channel, plan)
            if self.identity.leader and not self.spec.runs_check:  # the check reports unreachable tasks itself
                # The script starts at once, in parallel with the servers: TensorFlow's chief
                # waits for its peers, and importing TensorFlow in parallel saves seconds.
                # The watch turns a peer that never comes up into one clear line.
                threading.Thread(target=self._watch_startup, name="startup-watch", daemon=True).start()
            self.hangs.start()
            while self.status.state is not State.STOPPED:
                self.handle(self.events.get())
        finally:
            self._ended.set()
            self.hangs.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.status.state is not State.STOPPED:  # an exception: the processes must still go
                self._enter(State.STOPPED)
            self.processes.shutdown(self.spec.options.shutdown_grace)
            unacknowledged = self.channel.close()
            if self.spec.log_dir is not None and self.identity.leader:
                self.log.info(f"the full output of every process is in {self.spec.log_dir}")
            if self.identity.leader and self.spec.options.exit_code_file and self.status.result is not None:
                self._write_exit_code(self.status.result.code)
            self._end_step_if_a_node_is_lost(unacknowledged)
            if kept is not None:
                logging.getLogger(ROOT_LOGGER).removeHandler(kept)
                kept.close()
        assert self.status.result is not None
        return self.status.result

    def _end_step_if_a_node_is_lost(self, unacknowledged: tuple[int, ...]) -> None:
        """A cut node's task keeps srun (or its peers) waiting until the scheduler gives the node up.

        ``unacknowledged``: agents that did not disconnect after agent 0's Stop (a node cut off
        as training ended, before its silence was noticed): named, and the step ended too.
        """
        if self.status.result is None:
            return
        if unacknowledged:
            nodes = first_few(self.identity.agent_nodes[a] for a in unacknowledged)
            self.log.warning(
                f"the agent on {nodes} did not acknowledge the end of the job within "
                f"{self.channel.linger:g} s (its node cut off or frozen?); the job's "
                f"result stands. HINT: check that node and its network; its processes may run until the scheduler gives it up.")
        if self.status.result.lost_node is not None or self.membership.silent_nodes or unacknowledged:
            self.scheduler.end_step(self.plan.scheduler, self.log.info)

    def _write_exit_code(self, code: int) -> None:
        """--exit-code-file: the job's exit code, for a job script whose srun returns another (the step ended)."""
        path = Path(str(self.spec.options.exit_code_file))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{code}\n")
        except OSError as exc:
            self.log.warning(f"cannot write the exit code to {path} ({exc.strerror}).")

    def _keep_own_lines(self) -> logging.Handler | None:
        """This agent's own lines also go to LOG_DIR/agent-ID.log (None: no log directory)."""
        if self.spec.log_dir is None:
            return None
        try:
            handler = logging.FileHandler(self.spec.log_dir / f"agent-{self.identity.agent_id}.log")
        except OSError:
            return None
        handler.setFormatter(LineFormatter())
        logging.getLogger(ROOT_LOGGER).addHandler(handler)
        return handler

    def form(self, claims: BlockClaims | None = None) -> tuple[Channel, Plan]:
        """Connect the agents (formation.py): the channel, and the plan all agreed on."""
        return form_job(self.identity, self.spec.job, self.plan, self.spec.options, self.post, self.log, claims)

    def _watch_startup(self) -> None:
        """Agent 0: report the TF servers that do not listen within the start-up timeout."""
        servers = self.plan.listeners()
        missing = wait_reachable([p.address for p in servers], self.spec.options.startup_timeout, stop=self._ended)
        self.post(StartupChecked(tuple(p for p in servers if p.address in missing)))

    def handle(self, event: Event) -> None:
        """One event: decide, act through the mechanism, maybe change state."""
        if self.status.state is State.STOPPED:
            return
        match event:
            case ChildExited(child, code):
                self._on_child_exit(child, code)
            case FromPeer(agent, message):
                self._on_message(agent, message)
            case PeerGone(agent):
                self._on_peer_gone(agent)
            case PeerSilent(agent, seconds):
                self._on_node_lost(self.identity.agent_nodes[agent], seconds)
            case PeerJoined(agent, hello):
                self._on_joined(agent, hello)
            case JoinDue():
                self._on_join_due()
            case Rejoined(channel):
                self._on_rejoined(channel)
            case FailureDue():
                self._on_failure_due(event)
            case RejoinFailed(reason):
                self.log.warning(f"cannot rejoin the job: {reason}; stopping.")
                self._stop(0)
            case SignalReceived(signum):
                self._on_signal(signum)
            case StartupChecked(unreachable):
                self._on_startup(list(unreachable))
            case ScriptStopDeadline():
                assert self.status.interrupted is not None
                self.log.info(f"SCRIPT did not end within {SCRIPT_STOP_WAIT:.0f} s of the {signal.Signals(self.status.interrupted).name}; "
                              f"stopping every process (SIGKILL after {self.spec.options.shutdown_grace:g} s).")
                self._stop(shell_exit_code(-self.status.interrupted))
            case Hung(child, seconds, state, stacks):
                self._on_hung(child, f"made no progress for {seconds:.0f} s (state: {state}); its Python stacks: {stacks}")
            case WorkersEndDeadline() if self.status.chief_code is not None and self.processes.script_running():
                self.log.info(f"the chief's SCRIPT ended {WORKERS_END_WAIT:.0f} s ago and workers here still run it; "
                              "stopping them.")
                self._script_done(self.status.chief_code)
            case OrphanStopDeadline():
                self.log.info(f"no stop order from the first node within {ORPHAN_STOP_WAIT:.0f} s of the signal; stopping.")
                self._stop(shell_exit_code(-self.status.interrupted) if self.status.interrupted else 1)
            case _:
                raise AssertionError(event)

    # -- the decisions ----------------------------------------------------------------

    def _on_startup(self, unreachable: list[Process]) -> None:
        if not unreachable:
            return
        listing = control.first_few(f"{p.address} ({p.name} on {p.node})" for p in unreachable)
        if self.plan.is_jax:
            what, first = ("JAX processes never reached keras_distrib.distribution()",
                           "call keras_distrib.distribution() at the top of SCRIPT; if it is called, check")
        elif self.plan.layout == TUNER_LAYOUT:
            what, first = ("KerasTuner oracles never listened",
                           "the oracle listens once SCRIPT calls tuner.search() on the first node; if it does, check")
        else:
            what, first = "TF servers are still unreachable", "check"
        self.fail(
            f"after {self.spec.options.startup_timeout:.0f} s these {what}: {listing}. HINT: {first}"
            " that each name resolves to the right address on every node (getent hosts NODE), "
            "that no firewall blocks the ports, or pick the network with --interface",
            1,
        )

    def _on_child_exit(self, child: Child, code: int) -> None:
        if not self.processes.current(child):  # replaced by a restart
            return
        if self.status.interrupted and not child.runs_script:
            # The SIGINT/SIGTERM this agent got (Slurm also signals every process of the
            # step) ended it: expected, not a failure. Wait for a script that got it too.
            if self.processes.has_script():
                return
            self.channel.to_leader(Failed(f"{child.label} ended after the signal", shell_exit_code(code)))
            self._stop(shell_exit_code(-self.status.interrupted))
            return
        if not child.runs_script and code == SETUP_EXIT_CODE:  # its own error line said why
            self.fail(f"{child.label} stopped with exit code {code}: its setup is wrong, as its line above says. "
                      "HINT: fix what that line names; a restart would stop the same way", code)
            return
        # A peer stopped and this one failed because of it: a fault, not SCRIPT's error.
        blamed = (self.hangs.blame(child) if child.runs_script and code not in (0, PREEMPTED_EXIT_CODE)
                  and not self.status.interrupted else None)
        lost = lost_connection(child.tail) if child.runs_script and code > 0 and blamed is None else None
        # Not SCRIPT's end: a JAX ps worker's error, or a lost connection (with --min-nodes, agent 0
        # first waits to see whether a lost node explains it).
        fault = (code > 0 and code != PREEMPTED_EXIT_CODE and not self.status.interrupted
                 and (self.plan.restarts_on_error(child.proc) or (lost is not None and not self._elastic())))
        # A script that died of the SIGUSR1 it was sent (no checkpoint_dir, no handler) stopped on request.
        if self._leader_decides() and (not child.runs_script or (code < 0 and code != -signal.SIGUSR1) or fault):
            self._on_death(child, code)
            return
        if child.runs_script and not fault and (code in (0, PREEMPTED_EXIT_CODE) or not self.plan.every_process_runs_script
                                                or self.status.interrupted):
            if code != 0 or self.status.interrupted:
                self.log.info(f"{child.label} finished with {describe_exit(code)}")
            elif self.identity.leader:
                self._warn_if_unported(child)
            if self.plan.ends_script(child.proc):
                self.status.chief_code = shell_exit_code(code)
                if self.processes.script_running() and code in (0, PREEMPTED_EXIT_CODE):  # JAX workers: let them end first
                    self.timers.after(WORKERS_END_WAIT, WorkersEndDeadline())
                else:
                    self._script_done(self.status.chief_code)
                return
            if not self.processes.script_running():
                self._script_done(self.status.chief_code if self.status.chief_code is not None
                                  else shell_exit_code(code))
            return
        if blamed is not None:
            culprit, what = blamed
            self._on_hung(culprit, what + f" ({child.label} exited with {describe_exit(code)} because of it)")
            return
        if child.runs_script and self._elastic():
            after = f" after a lost connection ({lost})" if lost else ""
            self._script_failed(f"{child.label} exited unexpectedly with {describe_exit(code)}{after}",
                                shell_exit_code(code) or 1, child.proc.name if lost else "")
            return
        self.fail(f"{child.label} exited unexpectedly with {describe_exit(code)}", shell_exit_code(code) or 1)

    def _warn_if_unported(self, child: Child) -> None:
        """Agent 0: SCRIPT ended well without ever calling keras_distrib: name the idle processes."""
        path = self.processes.progress_file(child.proc)
        others = [p.name for p in self.plan.processes if p.name != child.proc.name]
        # One line per job: the first SCRIPT process speaks for the others (all-reduce, jax).
        if path is None or self.spec.runs_check or not others or child.proc.index != 0:
            return
        if progress.announced(path):
            return
        if self.plan.every_process_runs_script:
            what = f"each of the {len(self.plan.processes)} processes ran it alone, on all the data, without the others"
        else:
            what = f"it trained in {child.proc.name} alone while {', '.join(others)} stayed idle"
        self.log.warning(
            f"SCRIPT never called keras_distrib (strategy(), distribution(), cluster() or fit()): {what}. "
            "HINT: port it as docs/porting.md shows: keras_distrib.strategy() first (jax layouts: "
            "keras_distrib.distribution()), the model built under it, keras_distrib.fit for model.fit."
        )

    def _script_done(self, code: int) -> None:
        """This agent's SCRIPTs all ended; in allreduce and jax, agent 0 waits for every agent."""
        if not self.identity.leader:
            self.channel.to_leader(Done(self.identity.agent_id, code, self.status.generation.number))
            if self.status.state is State.RUNNING:
                self._enter(State.WAITING)
            return
        self.status.done_agents.add(0)
        if code == PREEMPTED_EXIT_CODE:
            self._after_preemption()
        elif code != 0 and self._elastic():
            self._hold_failure(f"SCRIPT ended with exit code {code}", code)
        elif code != 0 or not self.plan.every_process_runs_script or self.status.done_agents >= self.members:
            self._stop(code)
        elif self.status.state is State.RUNNING:
            self._enter(State.WAITING)

    def _on_message(self, agent: int, message: Any) -> None:
        if not self.identity.leader:  # from agent 0: orders
            match message:
                case Stop():
                    self._stop(0)
                case Restart(targets):
                    self._restart_here(list(targets))
                case Start(_, number, nodes, ports) if nodes and number > self.status.generation.number:
                    self._reform_here(number, tuple(nodes), ports)
            return
        if isinstance(message, (Died, Done)) and message.generation != self.status.generation.number:
            self.log.debug(f"dropped {message} of generation {message.generation} (now {self.status.generation.number})")
            return
        if agent not in self.members:  # a dropped agent's last words: its processes are no longer the job's
            return
        match message:
            case Failed(reason, code, restartable) if self._elastic():
                self._hold_failure(reason, int(code or 1), restartable)
            case Failed(_, code):
                self._stop(int(code or 1))
            case Died(name, label, code, _):
                self._decide_restart(name, label, code)
            case Stuck(name, label, what, seen) if seen >= self.restarts.seen:  # else: already restarted
                self._decide_restart(name, label, 1, what)
            case Done(_, code, _) if code == PREEMPTED_EXIT_CODE:
                self._after_preemption()
            case Done(_, code, _) if code and self._elastic():
                self._hold_failure(f"SCRIPT on {self.identity.agent_nodes[agent]} ended with exit code {code}", int(code))
            case Done(_, code, _) if code:
                self._stop(int(code))
            case Done():
                self.status.done_agents.add(agent)
                if self.plan.every_process_runs_script and self.status.done_agents >= self.members:
                    self._stop(0)

    def _on_peer_gone(self, agent: int) -> None:
        if not self.identity.leader:
            if self.status.interrupted:  # agent 0 ended on the same signal
                self._stop(shell_exit_code(-self.status.interrupted))
                return
            first = self.identity.agent_nodes[0]
            if self._may_rejoin():
                self._rejoin(f"lost contact with the first node's agent ({first})")
                return
            self.log.error(f"lost contact with the first node's agent ({first}); stopping.")
            self._stop(1, f"lost contact with the first node's agent ({first})")
        elif agent not in self.members:  # dropped by a re-forming: it stopped, as told (or left again)
            self.membership.joining.pop(agent, None)
            return
        elif (left := self._may_continue(node := self.identity.agent_nodes[agent])) is not None:
            self._reform(node, left, "its agent disconnected")
        elif self.status.interrupted:  # that agent ended on the same signal; the script decides
            return
        elif not self.spec.options.requeue:
            self.fail(f"the agent on {node} disconnected unexpectedly", 1)
            self.status.result = replace(self.status.result, lost_node=node)  # run() ends the step once all is stopped
        else:  # as for a silent node (`_on_node_lost`)
            self.log.error(f"the agent on {node} disconnected unexpectedly; stopping the job and requeueing it, to resume "
                           "from the last checkpoint.")
            code = self.scheduler.requeue(self.plan.scheduler, True, self.log.info)
            self._stop(1 if code == PREEMPTED_EXIT_CODE else code, f"the agent on {node} disconnected unexpectedly")

    def _on_signal(self, signum: int) -> None:
        """Forward to the children; SIGINT/SIGTERM also end the job once the script ends."""
        if signum == signal.SIGUSR2:  # SGE's -notify warning before a kill: a time-limit warning
            signum = signal.SIGUSR1
        self.processes.forward(signum)
        if signum == signal.SIGUSR1:
            if self.identity.leader:  # a warning that comes once training is done changes nothing: say it came
                self.log.info("got a time-limit or preemption warning (SIGUSR1); passed on to SCRIPT, which saves a "
                              "checkpoint and stops if it is still training.")
            return
        self.status.interrupted = signum
        self.log.info(f"got {signal.Signals(signum).name}; forwarded to this node's processes.")
        self._enter(State.DRAINING)
        if not self.processes.has_script():
            if self.identity.leader:
                self._stop(shell_exit_code(-signum))
            else:
                self.timers.after(ORPHAN_STOP_WAIT, OrphanStopDeadline())
        else:
            self.timers.after(SCRIPT_STOP_WAIT, ScriptStopDeadline())

    # -- restarts (docs/faults.md) ------------------------------------------------------

    def _may_restart(self) -> bool:
        return self.spec.options.max_restarts > 0 and not self.spec.runs_check and not self.status.interrupted

    def _leader_decides(self) -> bool:
        """Whether a death or hang goes to agent 0's decision: restarts allowed, or a re-forming possible."""
        elastic = self.spec.options.min_nodes is not None and not self.spec.runs_check and not self.status.interrupted
        return self._may_restart() or elastic

    def _on_death(self, child: Child, code: int) -> None:
        """A process died (a server's any exit, a script's signal): agent 0 decides."""
        if not self.identity.leader:
            self.channel.to_leader(Died(child.proc.name, child.label, code, self.status.generation.number))
        else:
            self._decide_restart(child.proc.name, child.label, code)

    def _on_hung(self, culprit: Process | Any, what: str) -> None:
        """A process is stuck (``what`` says how, and where its stacks are): name it, then as a death."""
        proc = getattr(culprit, "proc", culprit)
        if (proc is not culprit and not self.processes.current(culprit)) or self.status.interrupted:
            return  # replaced by a restart meanwhile, or the job is ending on a signal anyway
        label = f"{proc.name} on {proc.node}"
        if not self._leader_decides():
            self.fail(f"{label} {what}. HINT: its stacks show where it waits; --max-restarts N restarts stuck "
                      "processes, --hang-timeout sets how long no progress is allowed", 1)
            return
        if self.identity.leader:  # its restart line names it
            self._decide_restart(proc.name, label, 1, what)
        else:
            self.log.debug(f"{label} {what}; agent 0 decides")
            self.channel.to_leader(Stuck(proc.name, label, what, self.restarts.seen))

    def _decide_restart(self, dead: str, label: str, code: int, what: str | None = None) -> None:
        """Agent 0: restart what ``dead`` takes down, on every node, or fail when the budget is spent.

        ``what``: how a stuck (not dead) process failed, for the lines.
        """
        budget = self.spec.options.max_restarts
        if self.restarts.used >= budget:
            node = self._node_of(dead)
            if node is not None and (left := self._may_continue(node)) is not None:
                self._reform(node, left, f"{label} {what or 'exited with ' + describe_exit(code)}; the restart "
                                         f"budget is spent ({self.restarts.used}/{budget})")
                return
            self.fail(
                f"{label} {what or 'exited unexpectedly with ' + describe_exit(code)}; the restart budget is spent "
                f"({self.restarts.used}/{budget}). HINT: look for the cause in its "
                f"{'stacks' if what else 'output above'}; raise --max-restarts if "
                f"{'hangs' if what else 'deaths'} are expected",
                shell_exit_code(code) or 1,
            )
            return
        self.restarts.used += 1
        if what:  # a stuck process, perhaps on another node: the chief here waits for its restart
            self.hangs.restart_clocks()
        targets = restart_targets(self.plan, dead)
        self.log.info(restart_line(label, describe_exit(code), targets, dead, self.restarts.used, budget, what))
        self.status.done_agents.clear()
        self.channel.to_all(Restart(tuple(targets)))
        self._restart_here(targets)

    def _restart_here(self, targets: list[str]) -> None:
        self.restarts.seen += 1
        self.hangs.keep_frozen_stacks(targets)  # a peer's stopped process, before the kill
        if self.processes.restart(targets) and self.status.state is State.WAITING:
            self._enter(State.RUNNING)

    def _after_preemption(self) -> None:
        """Agent 0: SCRIPT saved a checkpoint on SIGUSR1/SIGTERM and exited: requeue, or say why not."""
        self.log.info("SCRIPT saved a checkpoint after a preemption/time-limit signal and stopped.")
        self._stop(self.scheduler.requeue(self.plan.scheduler, self.spec.options.requeue, self.log.info))
