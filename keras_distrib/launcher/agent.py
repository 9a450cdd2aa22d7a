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
* signals: SIGINT/SIGTERM/SIGUSR1 are forwarded to the children.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from cluster_parsers import ClusterConfigError, JobInfo, node_of_rank

from . import control
from .children import Child, OutputFilter, describe_exit, shell_exit_code, spawn
from .. import contract
from ..contract import PREEMPTED_EXIT_CODE
from ..network import wait_reachable
from ..plan import CHIEF, JAX_LAYOUTS, Plan, Process, build_plan, process_for_task
from .interfaces import interface_ipv4
from .isolation import IsolationUnavailable, isolate_network
from .options import Options
from .prestart import require_free_ports, require_protocol
from .restarts import restart_targets, restart_line
from . import requeue as requeue_job

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# How long an agent with no script waits for agent 0's stop order after SIGTERM/SIGINT.
ORPHAN_STOP_WAIT = 30.0
# How long SCRIPT may take to end after a forwarded SIGTERM/SIGINT (it saves a checkpoint
# at its next step boundary) before the agent stops it: a hung SCRIPT never reaches one.
SCRIPT_STOP_WAIT = 120.0


def plan_digest(plan: Plan) -> str:
    """A short fingerprint of the plan, so agents can check they agree without sending it."""
    return hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode()).hexdigest()


def say(node: str, text: str) -> None:
    """One agent line on stderr, in the same prefixed style as the children's output."""
    sys.stderr.write(f"[{node} agent] keras_distrib: {text}\n")
    sys.stderr.flush()


@dataclass
class AgentSpec:
    """Who this agent is within the job."""

    agent_id: int
    num_agents: int
    node: str
    agent_nodes: dict[int, str]
    local: bool = False


def agent_spec(job: JobInfo, mode: str, local: bool) -> AgentSpec:
    """Agent identity: node index in agent mode, global rank in per-role mode."""
    if local:
        return AgentSpec(0, 1, job.nodes[0], {0: job.nodes[0]}, local=True)
    if mode == "per-role":
        names = {r: job.nodes[node_of_rank(r, job.tasks_per_node)[0]] for r in range(job.num_tasks)}
        return AgentSpec(job.rank, job.num_tasks, job.node, names)
    return AgentSpec(job.node_index, job.num_nodes, job.node, dict(enumerate(job.nodes)))


@dataclass
class Agent:
    """Runs one agent's share of the plan; ``run()`` returns the agent's exit code."""

    spec: AgentSpec
    job: JobInfo
    plan: Plan
    options: Options
    mode: str
    script_argv: list[str]
    check: bool
    # SimpleQueue.put is reentrant, so the signal handler may call it safely.
    events: queue.SimpleQueue[tuple[Any, ...]] = field(default_factory=queue.SimpleQueue)
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    interrupted: int | None = None
    done_agents: set[int] = field(default_factory=set)
    server: control.ControlServer | None = None
    client: control.ControlClient | None = None
    plan_file: Path | None = None
    secret_file: Path | None = None
    # How a child is started, and the cluster as JSON: the control-plane benchmark, which
    # simulates thousands of agents in one process, passes a fake and a shared encoding.
    spawner: Callable[..., Child] = spawn
    cluster_json: str | None = None
    # Restarts: how each child was started (argv, env), by process name; deaths so far.
    started_as: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)
    restarts: int = 0

    # -- start-up ---------------------------------------------------------------

    def my_processes(self) -> list[Process]:
        if self.spec.local:
            mine = list(self.plan.processes)
        elif self.mode == "per-role":
            mine = [process_for_task(self.job, self.plan)]
        else:
            mine = self.plan.on_node(self.job.node_index)
        jax = self.plan.layout in JAX_LAYOUTS  # every jax process runs the check itself
        if self.check and self.spec.agent_id == 0 and not jax and not any(p.job == CHIEF for p in self.plan.processes):
            # allreduce has no chief: the check runs as an extra client on the first node.
            first = self.plan.processes[0]
            mine.append(Process(first.node, 0, CHIEF, 0, first.host, self.plan.control_port() + 1, ()))
        return mine

    def runs_script(self, proc: Process) -> bool:
        if self.check and self.plan.layout not in JAX_LAYOUTS:
            return proc.job == CHIEF
        return self.plan.runs_script(proc)

    def argv_for(self, proc: Process) -> list[str]:
        if self.runs_script(proc):
            return [sys.executable, "-m", "keras_distrib.check"] if self.check else self.script_argv
        return [sys.executable, "-m", "keras_distrib.servers"]

    def start(self, procs: list[Process]) -> None:
        """Write the plan file once for this node, then start ``procs`` (see contract.py)."""
        if self.plan_file is None:
            self.plan_file = contract.write_plan_file(json.dumps(self.plan.to_json()))
        # Encoded once per node: TF_CONFIG is only built when the cluster can fit in it.
        cluster_json = self.cluster_json or json.dumps(self.plan.cluster_spec())
        for proc in procs:
            env = contract.child_env(
                os.environ, self.plan, proc, self.plan_file, startup_timeout=self.options.startup_timeout,
                verbose=self.options.verbose, checkpoint_every=self.options.checkpoint_every,
                interface=self.options.interface, cluster_json=cluster_json,
            )
            self.started_as[proc.name] = (self.argv_for(proc), env)
            self.children.append(
                self.spawner(proc, self.argv_for(proc), env, self.runs_script(proc), self._on_exit,
                             output=self.output_filter(proc))
            )

    def output_filter(self, proc: Process) -> OutputFilter:
        """Banners hidden unless --verbose; allreduce workers other than 0 quiet unless --verbose."""
        quiet = self.plan.layout == "allreduce" and proc.job != CHIEF and proc.index != 0 and not self.options.verbose
        return OutputFilter(banners=self.options.verbose, quiet=quiet, has_gpus=bool(proc.gpus))

    def _on_exit(self, child: Child, code: int) -> None:
        self.events.put(("exit", child, code))

    def form_job(self) -> None:
        """Connect and authenticate the agents; check that all computed the same plan.

        Every agent builds the plan itself (it is deterministic); agent 0 compares their
        digests and sends only what it alone knows (the interface addresses), so the
        start message stays small at any job size.
        """
        my_ip = interface_ipv4(self.options.interface, self.spec.node) if self.options.interface else None
        if self.spec.num_agents == 1:
            if my_ip:
                self.plan = self._with_hosts({n: my_ip for n in self.plan.nodes})
            return
        port = self.plan.control_port()
        try:
            secret, self.secret_file = control.job_secret(self.plan.scheduler, self.plan.job_id, os.environ)
        except OSError as exc:
            raise control.ControlError(
                f"cannot create the job secret in {Path.cwd() / control.SECRET_DIR} ({exc.strerror}); "
                f"run from a writable directory shared by the nodes, or export {control.SECRET_VAR}=<random string> "
                "in the job script"
            ) from None
        digest = plan_digest(self.plan)
        if self.spec.agent_id == 0:
            others = {a: n for a, n in self.spec.agent_nodes.items() if a != 0}
            self.server = control.ControlServer(
                port, self.spec.num_agents - 1, secret, log=lambda line: say(self.spec.node, line),
                heartbeat_timeout=self.options.heartbeat_timeout, valid_agents=others,
            )
            hellos = self.server.gather(self.options.startup_timeout, others)
            differ = sorted(a for a, h in hellos.items() if h.get("plan") != digest)
            if differ:
                raise control.ControlError(
                    f"the plan computed on {control.first_few(others[a] for a in differ)} differs from this node's "
                    "(different options or job variables on those nodes?)"
                )
            start: dict[str, Any] = {}
            if my_ip:
                start["hosts"] = {h["node"]: h["ip"] for h in hellos.values()} | {self.spec.node: my_ip}
                self.plan = self._with_hosts(start["hosts"])
            self.server.broadcast({"start": start})
            self.server.listen(lambda agent, msg: self.events.put(("peer", agent, msg)))
        else:
            first = self.plan.processes[0].node
            hello = {"agent": self.spec.agent_id, "node": self.spec.node, "ip": my_ip, "plan": digest}
            self.client = control.ControlClient(
                first, port, hello, self.options.startup_timeout, secret, self.options.heartbeat_timeout
            )
            message = self.client.receive()
            if not message or "start" not in message:
                raise control.ControlError(f"the agent on {first} went away before the job started")
            if message["start"].get("hosts"):
                self.plan = self._with_hosts(message["start"]["hosts"])
            threading.Thread(target=self._relay_from_agent0, daemon=True).start()

    def _with_hosts(self, hosts: dict[str, str]) -> Plan:
        return build_plan(self.job, self.plan.layout, self.plan.processes[0].port, self.plan.protocol, hosts)

    def _relay_from_agent0(self) -> None:
        assert self.client is not None
        while (message := self.client.receive()) is not None:
            self.events.put(("peer", 0, message))
        self.events.put(("peer", 0, None))

    def watch_startup(self) -> None:
        """Agent 0: report the TF servers that do not listen within the start-up timeout."""
        servers = [p for p in self.plan.processes if p.job != CHIEF]
        missing = wait_reachable([p.address for p in servers], self.options.startup_timeout)
        self.events.put(("startup", [p for p in servers if p.address in missing]))

    # -- the event loop -----------------------------------------------------------

    def run(self) -> int:
        try:
            self.form_job()
        except control.ControlError as exc:
            say(self.spec.node, f"error: {exc}. HINT: start one agent per node "
                "(srun --ntasks-per-node=1), check that node names resolve and the ports are open.")
            return 1
        # Caught before the children start: a signal that comes while they start (say the
        # script's first line is already out) is queued and forwarded, not lost or fatal.
        previous = {s: signal.signal(s, lambda signum, _f: self.events.put(("signal", signum))) for s in FORWARDED_SIGNALS}
        self.start(self.my_processes())
        if self.spec.agent_id == 0 and not self.check:  # the check reports unreachable tasks itself
            # The script starts at once, in parallel with the servers: TensorFlow's chief
            # waits for its peers, and importing TensorFlow in parallel saves seconds.
            # The watchdog turns a peer that never comes up into one clear line.
            threading.Thread(target=self.watch_startup, daemon=True).start()
        return self.loop(previous)

    def runs_any_script(self) -> bool:
        return any(c.runs_script for c in self.children)

    def loop(self, previous: dict[int, Any]) -> int:
        """Handle events until the job ends; then restore the ``previous`` signal handlers."""
        try:
            while True:
                event = self.events.get()
                code = self.handle(event)
                if code is not None:
                    return code
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.shutdown()

    def handle(self, event: tuple[Any, ...]) -> int | None:
        kind = event[0]
        if kind == "exit":
            return self.on_child_exit(event[1], event[2])
        if kind == "peer":
            return self.on_peer(event[1], event[2])
        if kind == "signal":
            return self.on_signal(event[1])
        if kind == "startup":
            return self.on_startup(event[1])
        if kind == "script-stop-deadline":
            say(self.spec.node, f"SCRIPT did not end within {SCRIPT_STOP_WAIT:.0f} s of the "
                f"{signal.Signals(self.interrupted).name}; stopping every process (SIGKILL after "
                f"{self.options.shutdown_grace:g} s).")
            return self.stop(shell_exit_code(-self.interrupted))
        if kind == "stop-deadline":
            say(self.spec.node, f"no stop order from the first node within {ORPHAN_STOP_WAIT:.0f} s of the signal; stopping.")
            return shell_exit_code(-self.interrupted) if self.interrupted else 1
        raise AssertionError(kind)

    def on_startup(self, unreachable: list[Process]) -> int | None:
        if unreachable and not self.stopping:
            listing = control.first_few(f"{p.address} ({p.name} on {p.node})" for p in unreachable)
            jax = self.plan.layout in JAX_LAYOUTS
            what = "JAX processes never reached keras_distrib.distribution()" if jax else "TF servers are still unreachable"
            return self.fail(
                f"after {self.options.startup_timeout:.0f} s these {what}: {listing}. "
                + ("HINT: call keras_distrib.distribution() at the top of SCRIPT; if it is called, check" if jax else "HINT: check")
                + " that each name resolves to the right address on every node (getent hosts NODE), "
                "that no firewall blocks the ports, or pick the network with --interface",
                1,
            )
        return None

    def on_child_exit(self, child: Child, code: int) -> int | None:
        if self.stopping or child not in self.children:  # not in: replaced by a restart
            return None
        if self.interrupted and not child.runs_script:
            # The SIGINT/SIGTERM this agent got (Slurm also signals every process of the
            # step) ended it: expected, not a failure. Wait for a script that got it too.
            if self.runs_any_script():
                return None
            if self.client is not None:
                self.client.send({"failed": f"{child.label} ended after the signal", "code": shell_exit_code(code)})
            return self.stop(shell_exit_code(-self.interrupted))
        # A script that died of the SIGUSR1 it was sent (no checkpoint_dir, no handler) stopped on request.
        if self.may_restart() and (not child.runs_script or (code < 0 and code != -signal.SIGUSR1)):
            return self.on_death(child, code)
        if child.runs_script and (code in (0, PREEMPTED_EXIT_CODE) or not self.plan.every_process_runs_script or self.interrupted):
            if code != 0 or self.interrupted:
                say(self.spec.node, f"{child.label} finished with {describe_exit(code)}")
            if any(c.runs_script and c.popen.poll() is None for c in self.children):
                return None
            return self.script_done(shell_exit_code(code))
        return self.fail(f"{child.label} exited unexpectedly with {describe_exit(code)}", shell_exit_code(code) or 1)

    def script_done(self, code: int) -> int | None:
        """This agent's scripts all ended; in allreduce, agent 0 waits for every agent."""
        if self.spec.agent_id != 0:
            assert self.client is not None
            self.client.send({"done": self.spec.agent_id, "code": code})
            return None
        self.done_agents.add(0)
        if code == PREEMPTED_EXIT_CODE:
            return self.after_preemption()
        if code != 0 or not self.plan.every_process_runs_script or len(self.done_agents) == self.spec.num_agents:
            return self.stop(code)
        return None

    def on_peer(self, agent: int, message: dict[str, Any] | None) -> int | None:
        if self.stopping:
            return None
        if self.spec.agent_id != 0:
            if message is None:
                if self.interrupted:  # agent 0 ended on the same signal
                    return self.stop(shell_exit_code(-self.interrupted))
                say(self.spec.node, f"error: lost contact with the first node's agent ({self.spec.agent_nodes[0]}); stopping.")
                return self.stop(1)
            if "stop" in message:
                return self.stop(0)
            if "restart" in message:
                self.restart_local(message["restart"])
            return None
        if message is None:
            if self.interrupted:  # that agent ended on the same signal; the script decides
                return None
            return self.fail(f"the agent on {self.spec.agent_nodes[agent]} disconnected unexpectedly", 1)
        if control.LOST in message:
            return self.on_node_lost(self.spec.agent_nodes[agent], message[control.LOST])
        if "failed" in message:
            return self.stop(int(message.get("code") or 1))
        if "died" in message:
            return self.decide_restart(message["died"], message["label"], int(message["code"]))
        if "done" in message:
            if message.get("code") == PREEMPTED_EXIT_CODE:
                return self.after_preemption()
            if message.get("code"):
                return self.stop(int(message["code"]))
            self.done_agents.add(agent)
            if self.plan.every_process_runs_script and len(self.done_agents) == self.spec.num_agents:
                return self.stop(0)
        return None

    def on_node_lost(self, node: str, silent_for: float) -> int:
        """Agent 0: a node went silent. Stop the job; with --requeue, requeue it to resume elsewhere."""
        reason = f"lost the node {node}: its agent sent no heartbeat for {silent_for:.0f} s (node down or network cut)"
        if not self.options.requeue:
            return self.fail(reason, 1)
        say(self.spec.node, f"error: {reason}; stopping the job and requeueing it, to resume from the last checkpoint.")
        code = requeue_job.requeue(self.plan.scheduler, os.environ, True, lambda line: say(self.spec.node, line))
        return self.stop(1 if code == PREEMPTED_EXIT_CODE else code)

    def on_signal(self, signum: int) -> int | None:
        """Forward to the children; SIGINT/SIGTERM also end the job once the script ends."""
        if signum == signal.SIGUSR2:  # SGE's -notify warning before a kill: a time-limit warning
            signum = signal.SIGUSR1
        for child in self.children:
            # A server gets SIGTERM for a SIGINT: it keeps serving through its grace (the
            # script may checkpoint on KeyboardInterrupt, with variables on the ps), and a
            # server still starting exits quietly instead of dying in a traceback.
            child.signal(signal.SIGTERM if signum == signal.SIGINT and not child.runs_script else signum)
        if signum == signal.SIGUSR1:
            return None
        self.interrupted = signum
        say(self.spec.node, f"got {signal.Signals(signum).name}; forwarded to this node's processes.")
        if not self.runs_any_script():
            if self.spec.agent_id == 0 or self.spec.local:
                return self.stop(shell_exit_code(-signum))
            threading.Timer(ORPHAN_STOP_WAIT, lambda: self.events.put(("stop-deadline",))).start()
        else:
            deadline = threading.Timer(SCRIPT_STOP_WAIT, lambda: self.events.put(("script-stop-deadline",)))
            deadline.daemon = True  # an agent that ended before it must not wait for it
            deadline.start()
        return None

    # -- restarts (docs/faults.md) ------------------------------------------------------

    def may_restart(self) -> bool:
        return self.options.max_restarts > 0 and not self.check and not self.interrupted

    def on_death(self, child: Child, code: int) -> int | None:
        """A process died (a server's any exit, a script's signal): agent 0 decides."""
        if self.spec.agent_id != 0:
            assert self.client is not None
            self.client.send({"died": child.proc.name, "label": child.label, "code": code})
            return None
        return self.decide_restart(child.proc.name, child.label, code)

    def decide_restart(self, dead: str, label: str, code: int) -> int | None:
        """Agent 0: restart what ``dead`` takes down, on every node, or fail when the budget is spent."""
        budget = self.options.max_restarts
        if self.restarts >= budget:
            return self.fail(
                f"{label} exited unexpectedly with {describe_exit(code)}; the restart budget is spent "
                f"({self.restarts}/{budget}). HINT: look for the cause in its output above; raise --max-restarts if deaths are expected",
                shell_exit_code(code) or 1,
            )
        self.restarts += 1
        targets = restart_targets(self.plan, dead)
        say(self.spec.node, restart_line(label, describe_exit(code), targets, dead, self.restarts, budget))
        self.done_agents.clear()
        if self.server is not None:
            self.server.broadcast({"restart": targets})
        self.restart_local(targets)
        return None

    def restart_local(self, targets: list[str]) -> None:
        """Kill this node's processes among ``targets`` (if alive), then start them again as before."""
        old = [c for c in self.children if c.proc.name in targets]
        for child in old:
            child.signal(signal.SIGKILL)
            child.popen.wait()
        for child in old:
            argv, env = self.started_as[child.proc.name]
            fresh = self.spawner(child.proc, argv, env, child.runs_script, self._on_exit,
                                 output=self.output_filter(child.proc))
            self.children[self.children.index(child)] = fresh

    def after_preemption(self) -> int:
        """Agent 0: SCRIPT saved a checkpoint on SIGUSR1/SIGTERM and exited: requeue, or say why not."""
        say(self.spec.node, "SCRIPT saved a checkpoint after a preemption/time-limit signal and stopped.")
        code = requeue_job.requeue(self.plan.scheduler, os.environ, self.options.requeue, lambda line: say(self.spec.node, line))
        return self.stop(code)

    def fail(self, reason: str, code: int) -> int:
        say(self.spec.node, f"error: {reason}; stopping the job.")
        if self.client is not None:
            self.client.send({"failed": reason, "code": code})
        return self.stop(code)

    def stop(self, code: int) -> int:
        self.stopping = True
        if self.server is not None:
            self.server.broadcast({"stop": code})
        return code

    def shutdown(self) -> None:
        """SIGTERM every child's process group, SIGKILL after the grace time, drain output."""
        self.stopping = True
        for child in self.children:
            # TF servers hold nothing to save and outlive SIGTERM (servers.py): kill them.
            child.signal(signal.SIGTERM if child.runs_script else signal.SIGKILL)
        deadline = time.monotonic() + self.options.shutdown_grace
        for child in self.children:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        for child in self.children:
            child.signal(signal.SIGKILL)
            child.popen.wait()
            child.pump.join(timeout=2)
        for endpoint in (self.server, self.client):
            if endpoint is not None:
                endpoint.close()
        if self.plan_file is not None:
            contract.remove_plan_file(self.plan_file)
        if self.secret_file is not None and self.spec.agent_id == 0:
            self.secret_file.unlink(missing_ok=True)  # the job is over: nobody needs it


def isolate_local_job(node: str, wanted: bool) -> None:
    """Local mode: run the job in a private network (loopback only), or say why not."""
    if not wanted:
        say(node, "warning: --no-isolation: the job's TF servers listen on every interface of this "
            "machine while it runs, reachable (and usable) by anyone who can reach this machine.")
        return
    try:
        isolate_network()
    except IsolationUnavailable as exc:
        say(node, f"warning: cannot give the local job a private network ({exc.strerror}); its TF servers "
            "listen on every interface of this machine while it runs, reachable by anyone who can reach it.")


def launch(
    job: JobInfo,
    plan: Plan,
    options: Options,
    mode: str,
    script: str | None,
    script_args: list[str],
    check: bool,
    local: bool,
) -> int:
    """Validate what needs this machine, then run this task's agent."""
    if script is not None and not check:
        if not Path(script).is_file():
            raise ClusterConfigError(
                f"SCRIPT {script!r} does not exist (working directory {os.getcwd()}).",
                "give the training script's path, e.g. python -m keras_distrib.slurm train.py --epochs 3.",
            )
        script_argv = [sys.executable, "-u", script, *script_args]
    else:
        script_argv = []
    if options.interface:
        interface_ipv4(options.interface, job.node)  # fail before starting anything
    require_protocol(options.protocol)
    if local:
        isolate_local_job(job.nodes[0], options.isolate)
    agent = Agent(agent_spec(job, mode, local), job, plan, options, mode, script_argv, check or script is None)
    ports = {p.port: p.name for p in agent.my_processes()}
    if agent.spec.agent_id == 0 and agent.spec.num_agents > 1:
        ports[plan.control_port()] = "the agents' control port"
    require_free_ports(ports, job.node)
    return agent.run()
