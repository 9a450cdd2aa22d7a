"""Port fallback: forming a job whose job-id port block another job holds, against a free block.

    python bench/port_fallback.py [--smoke] [--rounds 5] [--forms 20]

Two agents on this machine (agent 0 and one other, each in its own thread) run the real
start-up path of a job without --port-base: each checks which of the plan's blocks are free
for its processes and agent 0 claims them (`portblocks.claim_blocks`: a bind probe per port
and block, and a claim socket per free block), then the real
`form_job` (secret, hello, plan digest, start message). A: another job's agent 0 listens on
the block's control port and a socket holds one of its TF ports, so agent 0 claims the
first fallback and the other agent is greeted by the other job's agent 0 first, tells it so,
and goes on to the fallback; B: the block is free. The other agent starts once agent 0
listens (0.3 s later, not timed), so the figure is the work of finding the block, not the
agents' 0.2 s retry. Reported: the median over ``--forms`` formations of the slower agent's
port checks plus the other agent's formation (its hello to the plan in hand), ms.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import threading
import time
from typing import Any

from _harness import Comparison, alternate, parser, print_table, save
from cluster_parsers import JobInfo
from keras_distrib.launcher import control, portblocks
from keras_distrib.launcher.formation import Identity, form_job
from keras_distrib.launcher.options import Options
from keras_distrib.plan import build_plan

OPTIONS = Options(startup_timeout=30.0, heartbeat_timeout=30.0)
START_GAP_S = 0.3


class Quiet:
    def info(self, _line: str) -> None: ...

    warning = error = info


def free_job_id() -> JobInfo:
    """A two-node job (both 'nodes' this machine) whose blocks are all free here."""
    for number in range(101, 600):
        job = JobInfo("slurm", str(number), ("localhost", "n2"), (1, 1))
        plan = build_plan(job, "ps-per-node")
        if len(portblocks.claim_blocks(plan, range(plan.processes[0].port, plan.control_port() + 2), claim=False).free) == 8:
            return job
    raise SystemExit("no job id with free port blocks on this machine")


def form_once(job: JobInfo) -> float:
    """Seconds of the slower agent's port checks, plus the other agent's formation (from its
    hello to the plan in hand)."""
    plan = build_plan(job, "ps-per-node")
    mine = [{p.port for p in plan.processes if p.node == node} for node in job.nodes]
    mine[0].add(plan.control_port())
    # Both 'nodes' are this machine: the other agent checks first, then agent 0 claims (a
    # claim hides a block from every other agent on the node, the other 'node' included).
    began = time.perf_counter()
    others = portblocks.claim_blocks(plan, mine[1], claim=False)
    checks = [0.0, time.perf_counter() - began]
    results: list[Any] = [None, None]

    def agent(i: int, claims: portblocks.BlockClaims) -> None:
        identity = Identity(i, 2, job.nodes[i], dict(enumerate(job.nodes)))
        results[i] = (*form_job(identity, job, plan, OPTIONS, lambda _e: None, Quiet(), claims), claims)

    def lead() -> None:
        began = time.perf_counter()
        claims = portblocks.claim_blocks(plan, mine[0])
        checks[0] = time.perf_counter() - began
        agent(0, claims)

    leader = threading.Thread(target=lead)
    leader.start()
    time.sleep(START_GAP_S)
    began = time.perf_counter()
    agent(1, others)
    formed = time.perf_counter() - began
    leader.join()
    for channel, _plan, claims in results:
        channel.close()
        claims.close()
    assert results[0][1].cluster_spec() == results[1][1].cluster_spec()
    return max(checks) + formed


def median_ms(job: JobInfo, forms: int, taken: bool) -> float:
    plan = build_plan(job, "ps-per-node")
    holders: list[Any] = []
    if taken:  # the other job: its agent 0 on our control port, one of its TF servers on our ps:1 port
        holders = [control.ControlServer(plan.control_port(), 1, b"theirs", log=lambda _l: None,
                                         job=f"slurm-{int(job.job_id) + 500}"),
                   socket.create_server(("", plan.find("ps", 1).port))]
    try:
        times = [form_once(job) for _ in range(forms)]
    finally:
        for holder in holders:
            holder.close()
    return statistics.median(times) * 1000


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--forms", type=int, default=20, help="formations per round and side (default 20)")
    args = p.parse_args()
    rounds, forms = (1, 2) if args.smoke else (args.rounds, args.forms)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the job secret file goes here
        job = free_job_id()
        comparison = alternate(
            rounds, lambda: median_ms(job, forms, True), lambda: median_ms(job, forms, False),
            Comparison("job formation, 2 agents", "job-id block taken (moves)", "job-id block free", "ms",
                       target="reported"),
        )
    print_table("Port fallback: forming a job whose port block another job holds", [comparison])
    save("port_fallback", [comparison], {"forms": forms, "start_gap_s": START_GAP_S}, out=args.out)


if __name__ == "__main__":
    main()
