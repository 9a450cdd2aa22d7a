"""Job formation at scale: N simulated agents on this machine, the real agent code.

    python bench/control_plane.py [--sizes 100,1000,5000] [--smoke] [--rounds 1] [--out DIR]

For each size N, agent 0 runs in its own process and the N-1 other agents run as threads
in a few worker processes. Every agent is the launcher's real ``Agent``: it computes its
plan digest, connects to agent 0's control port, proves the job secret, waits for the
start message and writes each of its children's environments (``contract.py``); only
``spawn`` is replaced by a fake that checks the environment would pass ``execve`` (no
variable over MAX_ARG_STRLEN, the whole under ARG_MAX) and records the time.

Reported per size: the time from the last agent's start to the last child started
(goal < 5 s at 5,000), agent 0's peak RSS (goal < 500 MiB), and the ratio to the
smallest size (about linear is the goal). Agent 0's CPU time to form the job is reported
too: the hub is the one serial part on a real cluster, and CPU time (unlike the wall times
above) does not grow with the N simulated agents competing for this machine's cores. One machine hosts all N agents, so the work
every node does once for itself (build the plan, its digest, write the plan file) would
cost N times here: it is computed once per worker process and shared by its threads,
and reported separately as "per-node local work", measured on one agent at that size.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _harness import Comparison, parser, print_table, save
from cluster_parsers import JobInfo
from keras_distrib import contract
from keras_distrib.launcher import control
from keras_distrib.launcher import formation
from keras_distrib.launcher.agent import Agent, LaunchSpec
from keras_distrib.launcher.formation import Identity, plan_digest
from keras_distrib.launcher.messages import Stop
from keras_distrib.launcher.options import Options
from keras_distrib.plan import build_plan

ARG_MAX = os.sysconf("SC_ARG_MAX")
MAX_ARG_STRLEN = 131_072
LAYOUT = "ps-per-node"
PORT_BASE = 31000
# Simulated agents per worker process: each has 3 threads (relay, heartbeat, its own), and
# thousands of threads fighting for one GIL would measure the simulation, not the design.
AGENTS_PER_PROCESS = 100
SHARED: dict[str, Any] = {}


def job_of(nodes: int) -> JobInfo:
    # Node 0 is this machine ("localhost"), so the real client code reaches agent 0.
    names = ("localhost", *(f"sim{i:05d}" for i in range(1, nodes)))
    return JobInfo("slurm", f"bench{nodes}", names, (1,) * nodes, node_gpus=tuple(("0",) for _ in names))


class FakeChild:
    def __init__(self, started: float) -> None:
        self.started = started


def fake_spawn(proc: Any, argv: list[str], env: dict[str, str], runs_script: bool, on_exit: Any, **_: Any) -> FakeChild:
    """Check the environment would pass execve; record the time the child 'started'."""
    sizes = [len(k) + len(v) + 2 for k, v in env.items()]
    if max(sizes) > MAX_ARG_STRLEN or sum(sizes) + sum(len(a) + 1 for a in argv) > ARG_MAX:
        raise SystemExit(f"{proc.name}: environment too large for execve ({max(sizes)} bytes in one variable)")
    if not os.path.exists(env[contract.PLAN_FILE_VAR]):
        raise SystemExit(f"{proc.name}: plan file missing")
    return FakeChild(time.time())


class SimulatedAgent(Agent):
    """The real agent; only the lookup of its node's processes is precomputed (see docstring)."""

    node_processes: dict[int, list[Any]] = {}

    def my_processes(self) -> list[Any]:
        return list(self.node_processes[self.identity.agent_id])


def make_agent(agent_id: int, nodes: int, job: JobInfo, plan: Any, plan_file: Path, options: Options) -> Agent:
    identity = Identity(agent_id, nodes, job.nodes[agent_id], dict(enumerate(job.nodes)))
    job_here = JobInfo(job.scheduler, job.job_id, job.nodes, job.tasks_per_node, node_gpus=job.node_gpus,
                       node_index=agent_id)
    agent = SimulatedAgent(LaunchSpec(job_here, plan, options, script="train.py"), identity)
    # Shared by the simulated agents of one process (see the docstring).
    agent.processes.plan_file, agent.processes.cluster_json = plan_file, SHARED["cluster_json"]
    agent.processes.spawner = fake_spawn
    return agent


def shared_state(nodes: int, workdir: str) -> tuple[JobInfo, Any, Path]:
    """Plan, memoised digest and plan file shared by the simulated agents (inherited by fork)."""
    job = job_of(nodes)
    plan = build_plan(job, LAYOUT, PORT_BASE)
    digest = plan_digest(plan)
    formation.plan_digest = lambda _plan: digest  # computed once here instead of N times
    SHARED["cluster_json"] = json.dumps(plan.cluster_spec())
    SimulatedAgent.node_processes = {}
    for proc in plan.processes:
        SimulatedAgent.node_processes.setdefault(proc.node_index, []).append(proc)
    return job, plan, contract.write_plan_file(json.dumps(plan.to_json()), workdir)


def cpu_seconds() -> float:
    """CPU time of this process, all threads: unlike wall time, not inflated by the simulation."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_agent0(nodes: int, workdir: str, options: Options, out: Any) -> None:
    os.chdir(workdir)
    job, plan, plan_file = SHARED["state"]
    agent = make_agent(0, nodes, job, plan, plan_file, options)
    before = cpu_seconds()
    channel, formed_plan = agent.form()
    formed = time.time()
    formation_cpu = cpu_seconds() - before
    print(f"  agent 0: {nodes} agents formed the job", file=sys.stderr, flush=True)
    agent.begin(channel, formed_plan)
    out.put(("agent0", [c.started for c in agent.processes.children], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             formed, formation_cpu))
    time.sleep(1.0)  # let the start message drain before the stop order
    agent.channel.to_all(Stop(0))
    time.sleep(1.0)
    agent.channel.close()


def run_workers(nodes: int, ids: list[int], workdir: str, options: Options, out: Any) -> None:
    os.chdir(workdir)
    threading.stack_size(256 * 1024)
    sys.setswitchinterval(0.05)
    job, plan, plan_file = SHARED["state"]
    results: list[tuple[float, list[float]]] = []
    errors: list[str] = []

    def one(agent_id: int) -> None:
        agent = make_agent(agent_id, nodes, job, plan, plan_file, options)
        began = time.time()
        try:
            agent.begin(*agent.form())
            results.append((began, [c.started for c in agent.processes.children]))
            agent.events.get(timeout=240)  # the stop order
        except Exception as exc:  # reported, the bench fails
            errors.append(f"agent {agent_id}: {exc!r}")
        finally:
            agent.channel.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    out.put(("workers", results, errors))


def local_work(nodes: int, workdir: str) -> float:
    """What every node does for itself: build the plan, its digest, write the plan file."""
    started = time.perf_counter()
    plan = build_plan(job_of(nodes), LAYOUT, PORT_BASE)
    plan_digest(plan)
    path = contract.write_plan_file(json.dumps(plan.to_json()), workdir)
    elapsed = time.perf_counter() - started
    contract.remove_plan_file(path)
    return elapsed


def free_port_base() -> int:
    """A port base whose block (chief, ps, worker, control port on node 0) is free now."""
    from keras_distrib.launcher.prestart import taken_port

    while True:
        with socket.socket() as sock:
            sock.bind(("", 0))
            base = sock.getsockname()[1] - 3
        if base > 1024 and not any(taken_port(base + i) for i in range(4)):
            return base


def measure(nodes: int, relaxed: bool) -> dict[str, float]:
    global PORT_BASE
    PORT_BASE = free_port_base()  # the forked agents inherit it
    ctx = mp.get_context("fork")
    options = Options()  # the launcher's defaults: start-up 180 s, heartbeat 30 s
    if relaxed:
        # N agents share this machine's cores, so one may wait far longer for a time slice
        # than a real node would: the authentication and heartbeat deadlines are relaxed.
        control.HANDSHAKE_TIMEOUT = 300.0
        options = Options(startup_timeout=300.0, heartbeat_timeout=300.0)
    with tempfile.TemporaryDirectory() as workdir:
        # Computed once here; every forked process (agent 0 included) inherits it.
        SHARED["state"] = shared_state(nodes, workdir)
        out = ctx.Queue()
        agent0 = ctx.Process(target=run_agent0, args=(nodes, workdir, options, out), daemon=True)
        agent0.start()
        others = list(range(1, nodes))
        count = max(1, len(others) // AGENTS_PER_PROCESS)
        groups = [others[i::count] for i in range(count)]
        workers = [ctx.Process(target=run_workers, args=(nodes, g, workdir, options, out), daemon=True) for g in groups if g]
        for w in workers:
            w.start()
        began: list[float] = []
        children: list[float] = []
        rss = formed = formation_cpu = 0.0
        for _ in range(1 + len(workers)):
            kind, *payload = out.get(timeout=float(os.environ.get("BENCH_WAIT", "600")))
            if kind == "agent0":
                children += payload[0]
                rss, formed, formation_cpu = payload[1], payload[2], payload[3]
            else:
                results, errors = payload
                if errors:
                    raise SystemExit(f"{len(errors)} simulated agents failed, first: {errors[0]}")
                for start, times in results:
                    began.append(start)
                    children += times
        for p in (agent0, *workers):
            p.join(timeout=60)
        expected = len(build_plan(job_of(nodes), LAYOUT, PORT_BASE).processes)
        if len(children) != expected or len(began) != nodes - 1:
            raise SystemExit(f"{nodes} agents: {len(children)} of {expected} children started, {len(began)} agents")
        return {
            "nodes": nodes,
            "children": len(children),
            "last_agent_to_all_children_s": max(children) - max(began),
            "first_agent_to_all_children_s": max(children) - min(began),
            "last_agent_to_job_formed_s": formed - max(began),
            "agent0_peak_rss_mib": rss,
            # The hub's own work to form the job; the only serial part on a real cluster.
            "agent0_formation_cpu_s": formation_cpu,
            "per_node_local_work_s": local_work(nodes, workdir),
        }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sizes", default="100,1000,5000", help="numbers of agents, smallest first")
    p.add_argument("--relaxed-deadlines", action="store_true",
                   help="300 s authentication and heartbeat deadlines instead of the defaults (10 s, 30 s), "
                        "for sizes whose simulation overloads this machine")
    p.set_defaults(rounds=1)
    args = p.parse_args()
    sizes = [20, 50] if args.smoke else [int(s) for s in args.sizes.split(",")]
    base = sizes[0]
    comparisons = {n: Comparison(f"formation {n} vs {base} agents", f"{n} agents", f"{base} agents", "s",
                                 target="< 5 s at 5,000, ~linear") for n in sizes[1:]}
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for i in range(args.rounds):
        for n in sizes:
            rows[n].append(measure(n, args.relaxed_deadlines))
            print(f"  round {i + 1}/{args.rounds}: {rows[n][-1]}", file=sys.stderr, flush=True)
        for n in sizes[1:]:
            comparisons[n].a.append(rows[n][-1]["last_agent_to_all_children_s"])
            comparisons[n].b.append(rows[base][-1]["last_agent_to_all_children_s"])
    if comparisons:
        print_table("Control plane: last agent's start -> every child started (simulated agents, real agent code)",
                    list(comparisons.values()))
    for n in sizes:
        last = rows[n][-1]
        print(f"  {n:>6} agents: {last['children']:.0f} children, last agent -> job formed "
              f"{statistics.median(r['last_agent_to_job_formed_s'] for r in rows[n]):.2f} s, -> all children "
              f"{statistics.median(r['last_agent_to_all_children_s'] for r in rows[n]):.2f} s, agent 0 peak RSS "
              f"{max(r['agent0_peak_rss_mib'] for r in rows[n]):.0f} MiB, agent 0 CPU to form the job "
              f"{statistics.median(r['agent0_formation_cpu_s'] for r in rows[n]):.2f} s, per-node local work "
              f"{statistics.median(r['per_node_local_work_s'] for r in rows[n]):.3f} s")
    extra = {"rows": {str(n): rows[n] for n in sizes}}
    if comparisons:
        save("control_plane", list(comparisons.values()), extra, args.out)
    else:  # one size (e.g. --sizes 10000): nothing to compare, the figures alone
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "control_plane.json").write_text(json.dumps({"benchmark": "control_plane", **extra}, indent=2))


if __name__ == "__main__":
    main()
