"""The launcher on a real 3-node Slurm cluster (scripts/testcluster/slurm_cluster.py).

Every job runs through srun (or sbatch with the templates in scripts/sbatch) in the head
namespace, exactly as a user would. TensorFlow takes seconds to import per process on a
small machine, so each test starts as few jobs as it can and the timeouts are generous;
the only timed assertion is the fault-detection bound.

Processes are found and killed by pid inside this cluster's namespaces only, never by
name (``pkill`` would reach processes of other test sessions on the same machine).
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import threading
import time
from pathlib import Path
from typing import Self

import pytest
from slurm_cluster import SlurmTestCluster

from keras_distrib.plan import PORT_BLOCK, derive_port_base, fallback_bases

REPO = Path(__file__).resolve().parents[2]
PS_PER_NODE = REPO / "scripts" / "sbatch" / "ps-per-node.sbatch"
NODES = ["n1", "n2", "n3"]
LAUNCH = ["python", "-m", "keras_distrib.slurm"]
SRUN3 = ["srun", "-N3", "--ntasks-per-node=1"]
TIMEOUT = 300  # per job: seven TensorFlow processes share two cores
# TensorFlow's C++ start-up chatter, prefixed by the launcher.
NOISE = re.compile(r"^\[[^\]]+\] ([IWE]\d{4} |WARNING: All log messages)")

TRAIN = '''
"""Parameter-server training: a Keras 3 model, STEPS steps through a ClusterCoordinator."""
import os, sys, time
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras
import tensorflow as tf
import keras_distrib

steps, pause = int(sys.argv[1]), float(sys.argv[2])
info = keras_distrib.cluster()
print(f"role {info.job}:{info.index} workers {info.num_workers} ps {info.num_ps}", flush=True)
strategy = keras_distrib.strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

@tf.function
def train_step():
    def replica_fn():
        x = tf.random.normal([16, 4])
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        for var, grad in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            var.assign_sub(0.01 * grad)
        return loss
    return strategy.run(replica_fn)

for step in range(steps):
    loss = coordinator.schedule(train_step)
    if step == 0:
        print("training", flush=True)
    time.sleep(pause)
coordinator.join()
print(f"trained {steps} steps, last loss {float(loss.fetch()):.4f}", flush=True)
with open(sys.argv[3], "w") as fh:  # when the chief ends, for the shutdown measurement
    fh.write(repr(time.time()))
'''

EXIT = '''
import sys, time
import keras_distrib
info = keras_distrib.cluster()
print(f"role {info.job}:{info.index} on {info.plan.scheduler} job {info.plan.job_id}", flush=True)
with open(sys.argv[2], "w") as fh:
    fh.write(repr(time.time()))
sys.exit(int(sys.argv[1]))
'''

MWMS = '''
"""All-reduce: every worker runs this with MultiWorkerMirroredStrategy."""
import os
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras
import tensorflow as tf
import keras_distrib

info = keras_distrib.cluster()
strategy = keras_distrib.strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

@tf.function
def total():
    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)

mwms = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
print(f"{info.job}:{info.index} mwms={mwms} replicas {strategy.num_replicas_in_sync} sum {float(total()):.0f} "
      f"workers {','.join(info.plan.cluster_spec()['worker'])} nccl_if {os.environ.get('NCCL_SOCKET_IFNAME')}", flush=True)
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scripts shared by the tests; the filesystem is shared by all nodes."""
    path = tmp_path_factory.mktemp("launcher-slurm")
    for name, text in (("train.py", TRAIN), ("exit.py", EXIT), ("mwms.py", MWMS), ("x.py", "print('x')\n")):
        (path / name).write_text(textwrap.dedent(text).lstrip())
    return path


def meaningful(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip() and not NOISE.match(line)]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "keras_distrib: error:" in line]


def job_ports(job_id: int | str) -> range:
    base = derive_port_base(str(job_id))
    return range(base, base + PORT_BLOCK)


def assert_nothing_left(cluster: SlurmTestCluster, job_id: int | str | None = None, wait: float = 10) -> None:
    """No process of the launcher and no listening port but slurmd's on any node.

    Slurm may still be reaping the step for a moment after the job's end: wait up to
    ``wait`` seconds before failing.
    """
    procs, ports = cluster.leftovers(r"keras_distrib|train\.py|exit\.py|mwms\.py", wait)
    assert procs == [], f"processes left behind: {procs}"
    assert ports == {n: [] for n in NODES}, "listening ports left behind"
    if job_id is not None:
        in_range = {n: [p for p in cluster.listening_ports(n) if p in job_ports(job_id)] for n in NODES}
        assert in_range == {n: [] for n in NODES}


class ServerWatch:
    """Records every keras_distrib.servers process seen in the cluster while active."""

    def __init__(self, cluster: SlurmTestCluster) -> None:
        self.cluster, self.seen, self._stop = cluster, set(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.seen.update(self.cluster.processes_matching(r"-m keras_distrib\.servers"))
            time.sleep(0.05)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def check_rows(output: str) -> list[list[str]]:
    """The check table's rows below its NODE ... STATUS header."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[n1 chief:0] NODE"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("[n1 chief:0] n"):
            break
        rows.append(line.split("] ", 1)[1].split())
    return rows


def pid_of(cluster: SlurmTestCluster, node: str, task: str, timeout: float = 120,
           command: str = r"-m keras_distrib\.servers") -> int:
    """The pid of process ``task`` (e.g. worker:1) on ``node``: by network namespace and env,
    among the processes whose command line matches ``command`` (a TF server by default)."""
    netns = os.stat(f"/run/netns/{cluster.prefix}-{node}").st_ino
    needle = f"KERAS_DISTRIB_TASK={task}".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in cluster.processes_matching(command):
            pid = int(entry.split()[0])
            try:
                if os.stat(f"/proc/{pid}/ns/net").st_ino == netns and needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no {task} server on {node}")


def sbatch_template(cluster: SlurmTestCluster, template: Path, options: list[str], args: list[str], cwd: Path) -> int:
    """``sbatch OPTIONS TEMPLATE ARGS`` as a user types it; returns the job id."""
    p = cluster.head(["sbatch", "--parsable", *options, str(template), *args], cwd=cwd, check=True, timeout=60)
    return int(p.stdout.strip().split(";")[0])


def wait_for_text(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


# -- a: the cluster check ------------------------------------------------------------------------


def test_cluster_check_srun(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    started = time.monotonic()
    p = slurm_cluster.head([*SRUN3, *LAUNCH, "--check"], cwd=work, timeout=TIMEOUT)
    took = time.monotonic() - started
    out = p.stdout + p.stderr
    print(f"\ncluster check: {took:.1f} s")
    assert p.returncode == 0, out
    rows = check_rows(p.stdout)
    # ps-per-node on 3 nodes: a ps and a worker per node, each reached from the chief.
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        [(n, f"ps:{i}") for i, n in enumerate(NODES)] + [(n, f"worker:{i}") for i, n in enumerate(NODES)]
    ), p.stdout
    for node, role, address, planned, seen, rtt, status in rows:
        assert address.startswith(f"{node}:"), address  # hostnames by default
        assert (planned, seen, status) == ("-", "0", "OK")
        assert float(rtt) > 0
    assert "[n1 chief:0] 6 OK, 0 FAILED" in p.stdout
    assert error_lines(out) == []
    assert_nothing_left(slurm_cluster)


# -- b: a training job through the sbatch template: tests/slurm/test_examples_slurm.py -----------


# -- c: exit code propagation (and the shutdown time) --------------------------------------------


def test_exit_code_reaches_the_step(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    ended = work / "exit.ended"
    p = slurm_cluster.head([*SRUN3, *LAUNCH, "exit.py", "3", str(ended)], cwd=work, timeout=TIMEOUT)
    step_end = time.time()
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    job_id = re.search(r"\[n1 chief:0\] role chief:0 on slurm job (\d+)", p.stdout)
    assert job_id, out
    assert "[n1 agent] keras_distrib: chief:0 on n1 finished with exit code 3" in out
    assert error_lines(out) == []
    print(f"\nchief exit to srun step end: {step_end - float(ended.read_text()):.2f} s")
    assert_nothing_left(slurm_cluster, job_id.group(1))


def test_one_task_per_process_mode(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    """Three tasks on one node = the three processes of ps-per-node there, in SLURM_LOCALID order."""
    ended = work / "per-role.ended"
    p = slurm_cluster.head(["srun", "-N1", "-n3", "--overcommit", *LAUNCH, "train.py", "5", "0", str(ended)],
                           cwd=work, timeout=TIMEOUT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    lines = meaningful(out)
    assert "[n1 chief:0] role chief:0 workers 1 ps 1" in lines, out
    assert any(line.startswith("[n1 chief:0] trained 5 steps") for line in lines), out
    for role in ("ps:0", "worker:0"):
        assert sum(line.startswith(f"[n1 {role}] serving {role}") for line in lines) == 1, out
    assert error_lines(out) == []
    assert_nothing_left(slurm_cluster)


# -- d: a worker killed during training ------------------------------------------------------------


def test_killed_worker_fails_the_job_fast(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    out, ended = work / "train-kill.out", work / "train-kill.ended"
    # 300 steps of >= 0.5 s: the script would run for minutes if nothing stopped it.
    job = sbatch_template(slurm_cluster, PS_PER_NODE, ["-N3", "--cpus-per-task=2", "-o", str(out)],
                          ["--max-restarts", "0", "train.py", "300", "0.5", str(ended)], work)
    try:
        assert wait_for_text(out, "[n1 chief:0] training", TIMEOUT), out.read_text(errors="replace") if out.exists() else "no output"
        victim = pid_of(slurm_cluster, "n2", "worker:1")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        result = slurm_cluster.wait_job(job, timeout=120)
        took = time.monotonic() - killed_at
    finally:
        slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    print(f"\nSIGKILL of worker:1 to job end: {took:.2f} s")
    assert result == "FAILED" and result.exit_code != 0, (result, text)
    assert not ended.exists(), "the script ran to its end"
    assert error_lines(text) == [
        "[n2 agent] keras_distrib: error: worker:1 on n2 exited unexpectedly with signal 9 (SIGKILL); stopping the job."
    ], text
    assert took < 60, f"the job took {took:.1f} s to stop after the kill"
    assert_nothing_left(slurm_cluster, job)


# -- e: bad input fails before anything starts ---------------------------------------------------


def test_two_tasks_per_node_is_refused(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    with ServerWatch(slurm_cluster) as watch:
        p = slurm_cluster.head(
            ["srun", "-N3", "--ntasks-per-node=2", *LAUNCH, "--layout", "ps-per-node", "x.py"], cwd=work, timeout=120
        )
    assert p.returncode == 2, p.stdout + p.stderr
    hints = [line for line in p.stderr.splitlines() if "HINT:" in line]
    assert len(hints) == 1, p.stderr  # task 0 reports it once for all six tasks
    (hint,) = hints
    assert hint.startswith("keras_distrib: error: ") and "--ntasks-per-node=1" in hint.split("HINT:")[1]
    assert watch.seen == set()
    assert_nothing_left(slurm_cluster)


def test_unsupported_protocol_is_refused(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    with ServerWatch(slurm_cluster) as watch:
        p = slurm_cluster.head([*SRUN3, *LAUNCH, "--protocol", "grpc+verbs", "x.py"], cwd=work, timeout=TIMEOUT)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = {line for line in p.stderr.splitlines() if line.startswith("keras_distrib: error:")}
    assert len(errors) == 1, p.stderr
    (error,) = errors
    assert "grpc+verbs" in error and "GRPC_SERVER" in error
    assert "--layout allreduce" in error and "NCCL" in error
    assert watch.seen == set()
    assert_nothing_left(slurm_cluster)


# -- f: --interface --------------------------------------------------------------------------------


def node_interfaces(cluster: SlurmTestCluster, node: str) -> dict[str, str]:
    """{interface: IPv4 address} inside ``node`` (``ip -4 -o addr``)."""
    p = cluster.on_node(node, ["ip", "-4", "-o", "addr"], check=True, timeout=30)
    return {f[1]: f[3].split("/")[0] for f in (line.split() for line in p.stdout.splitlines())}


def cluster_interface(cluster: SlurmTestCluster) -> str:
    """The nodes' interface on the cluster network 10.200.0.0/24 (eth0 in the harness)."""
    return next(name for name, ip in node_interfaces(cluster, "n1").items() if ip.startswith("10.200.0."))


def test_interface_puts_its_addresses_in_the_plan(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    addresses = {n: node_interfaces(slurm_cluster, n) for n in NODES}
    iface = cluster_interface(slurm_cluster)
    p = slurm_cluster.head([*SRUN3, *LAUNCH, "--check", "--interface", iface], cwd=work, timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = check_rows(p.stdout)
    assert len(rows) == 6
    for node, role, address, *_, status in rows:
        assert address.rsplit(":", 1)[0] == addresses[node][iface], (node, role, address)
        assert status == "OK"
    assert_nothing_left(slurm_cluster)


def test_missing_interface_lists_the_nodes_interfaces(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    have = sorted(node_interfaces(slurm_cluster, "n1"))
    with ServerWatch(slurm_cluster) as watch:
        p = slurm_cluster.head([*SRUN3, *LAUNCH, "--interface", "nosuch0", "x.py"], cwd=work, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("keras_distrib: error:")]
    assert len(errors) == 3, p.stderr  # one per node, each naming its node
    for node in NODES:
        (line,) = [e for e in errors if f"on {node}." in e]
        assert "'nosuch0' does not exist" in line
        assert all(name in line.split("HINT:")[1] for name in have), line
    assert watch.seen == set()


# -- g: the allreduce layout ------------------------------------------------------------------------


def test_allreduce_layout(slurm_cluster: SlurmTestCluster, work: Path) -> None:
    # With --interface too: the workers' addresses are IPs and NCCL is pointed at the interface.
    iface = cluster_interface(slurm_cluster)
    ips = [node_interfaces(slurm_cluster, n)[iface] for n in NODES[:2]]
    p = slurm_cluster.head(
        # --verbose: worker 1 is quiet by default, and its line is checked.
        ["srun", "-N2", "--ntasks-per-node=1", *LAUNCH, "--layout", "allreduce", "--verbose", "--interface", iface, "mwms.py"],
        cwd=work, timeout=TIMEOUT,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    lines = meaningful(p.stdout)
    for i, node in enumerate(NODES[:2]):
        (line,) = [line for line in lines if line.startswith(f"[{node} worker:{i}] worker:{i} ")]
        assert line.startswith(f"[{node} worker:{i}] worker:{i} mwms=True replicas 2 sum 2 workers "), out
        assert re.fullmatch(rf"{re.escape(ips[0])}:\d+,{re.escape(ips[1])}:\d+", line.split(" workers ")[1].split()[0]), line
        assert line.endswith(f" nccl_if {iface}"), line
    assert error_lines(out) == []
    assert_nothing_left(slurm_cluster)


# -- f: a heterogeneous job: the workers on two nodes, the parameter server alone on a third -------


def node_of_each_task(cluster: SlurmTestCluster, seen: set[str]) -> dict[str, set[str]]:
    """The nodes each task (``ps:0``) of the ``seen`` server processes ran on (by network namespace)."""
    nodes = {os.stat(f"/run/netns/{cluster.prefix}-{n}").st_ino: n for n in NODES}
    tasks: dict[str, set[str]] = {}
    for entry in seen:
        pid = int(entry.split()[0])
        try:
            node = nodes.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        task = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"KERAS_DISTRIB_TASK=")), None)
        if node and task:
            tasks.setdefault(task, set()).add(node)
    return tasks


class TaskWatch(ServerWatch):
    """Also records where each server process ran, while it runs."""

    def __init__(self, cluster: SlurmTestCluster) -> None:
        super().__init__(cluster)
        self.where: dict[str, set[str]] = {}

    def _poll(self) -> None:
        while not self._stop.is_set():
            for task, nodes in node_of_each_task(self.cluster, set(
                    self.cluster.processes_matching(r"-m keras_distrib\.servers"))).items():
                self.where.setdefault(task, set()).update(nodes)
            time.sleep(0.05)


HETEROGENEOUS = REPO / "scripts" / "sbatch" / "ps-on-cpu-nodes.sbatch"


def test_a_heterogeneous_job_puts_the_parameter_server_alone_on_its_component(slurm_cluster: SlurmTestCluster,
                                                                              work: Path) -> None:
    """`sbatch -c2 -N2 : -c1 -N1 ps-on-cpu-nodes.sbatch train.py`: the chief and the two workers
    on n1, n2 and ps:0 alone on n3; training to the end, exit 0, nothing left."""
    out, ended = work / "het.out", work / "het.ended"
    with TaskWatch(slurm_cluster) as watch:
        # The command line's components override the template's (2 CPUs per node on this cluster).
        job = sbatch_template(slurm_cluster, HETEROGENEOUS, ["-o", str(out), "--cpus-per-task=2", "--nodes=2", ":",
                                                             "--cpus-per-task=1", "--nodes=1"],
                              ["train.py", "30", "0.05", str(ended)], work)
        try:
            result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
        finally:
            slurm_cluster.head(["scancel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED" and result.exit_code == 0, (result, text)
    assert "[n1 chief:0] role chief:0 workers 2 ps 1" in text and "[n1 chief:0] trained 30 steps" in text, text
    assert watch.where == {"ps:0": {"n3"}, "worker:0": {"n1"}, "worker:1": {"n2"}}, (watch.where, text)
    assert error_lines(text) == [], text
    assert_nothing_left(slurm_cluster, job)


# -- g: two jobs on one node at once, with the ports Slurm reserves and without ----------------------

BOTH_UP = '''
"""Wait until every TF server of this job answers, say so, then until the other job did too."""
import socket, sys, time
from pathlib import Path
import keras_distrib

me, other = Path(sys.argv[1]), Path(sys.argv[2])
plan = keras_distrib.cluster().plan
addresses = [p.address for p in plan.processes if p.job != "chief"]
deadline = time.monotonic() + 240
for address in addresses:
    host, port = address.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"{address} never answered"
            time.sleep(0.2)
me.write_text(" ".join(addresses))
while not other.exists():
    assert time.monotonic() < deadline, "the other job never came up"
    time.sleep(0.2)
print(f"up {plan.job_id} {' '.join(addresses)}", flush=True)
'''


@pytest.mark.parametrize("reserve", [True, False], ids=["resv-ports", "job-id-block"])
def test_two_jobs_on_one_node_at_once_never_share_a_port(slurm_cluster: SlurmTestCluster, work: Path,
                                                         reserve: bool) -> None:
    """Two one-node jobs on n1 at the same time, both with every server up before either
    ends: with `srun --resv-ports` each plan takes Slurm's reserved ports (MpiParams=ports on
    the test cluster); without, each takes the block of its job id."""
    (work / "both_up.py").write_text(textwrap.dedent(BOTH_UP).lstrip())
    tag = "resv" if reserve else "block"
    flags = "--resv-ports=6 " if reserve else ""
    jobs = []
    for me, other in (("a", "b"), ("b", "a")):
        up, out = work / f"{tag}-{me}.up", work / f"{tag}-{me}.out"
        up.unlink(missing_ok=True)
        script = (f"#!/bin/bash\nsrun -N1 --ntasks-per-node=1 {flags}python -m keras_distrib.slurm both_up.py {up} "
                  f"{work / f'{tag}-{other}.up'}\n")
        jobs.append((slurm_cluster.sbatch(script, "-N1", "-w", "n1", "-c1", "-o", str(out), cwd=work), out))
    try:
        results = [slurm_cluster.wait_job(job, timeout=TIMEOUT) for job, _ in jobs]
    finally:
        for job, _ in jobs:
            slurm_cluster.head(["scancel", str(job)], timeout=30)
    texts = [out.read_text(errors="replace") for _, out in jobs]
    assert all(r == "COMPLETED" and r.exit_code == 0 for r in results), (results, texts)
    ports = [set(int(a.rsplit(":", 1)[1]) for a in (work / f"{tag}-{me}.up").read_text().split()) for me in "ab"]
    assert len(ports[0]) == len(ports[1]) == 2 and not ports[0] & ports[1], ports
    in_resv = [all(12000 <= p <= 12999 for p in job_ports) for job_ports in ports]
    assert in_resv == [reserve, reserve], (ports, texts)
    assert_nothing_left(slurm_cluster)


def test_a_job_whose_port_block_another_job_holds_moves_to_a_fallback(slurm_cluster: SlurmTestCluster,
                                                                      work: Path) -> None:
    """Two jobs whose ids are equal modulo 500 want the same block on the same two nodes. The
    first is emulated by a job given that block (--port-base), up before the second starts
    (submitted held, released once the first is up): the second's agents find the block
    taken, agree on the first fallback, and both jobs run to the end with disjoint ports."""
    (work / "both_up.py").write_text(textwrap.dedent(BOTH_UP).lstrip())
    up = {me: work / f"collide-{me}.up" for me in "ab"}
    out = {me: work / f"collide-{me}.out" for me in "ab"}
    for path in up.values():
        path.unlink(missing_ok=True)

    def script(me: str, other: str, flags: str = "") -> str:
        return (f"#!/bin/bash\nsrun -N2 --ntasks-per-node=1 python -m keras_distrib.slurm {flags}both_up.py "
                f"{up[me]} {up[other]}\n")

    args = ("-N2", "-w", "n1,n2", "-c1")
    second = slurm_cluster.sbatch(script("b", "a"), *args, "--hold", "-o", str(out["b"]), cwd=work)
    block = derive_port_base(str(second))
    first = slurm_cluster.sbatch(script("a", "b", f"--port-base {block} "), *args, "-o", str(out["a"]), cwd=work)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not up["a"].exists():
            assert time.monotonic() < deadline, out["a"].read_text(errors="replace") if out["a"].exists() else ""
            time.sleep(0.5)
        slurm_cluster.head(["scontrol", "release", str(second)], timeout=30)
        results = {me: slurm_cluster.wait_job(job, timeout=TIMEOUT) for me, job in (("a", first), ("b", second))}
    finally:
        for job in (first, second):
            slurm_cluster.head(["scancel", str(job)], timeout=30)
    texts = {me: out[me].read_text(errors="replace") for me in "ab"}
    assert all(r == "COMPLETED" and r.exit_code == 0 for r in results.values()), (results, texts)
    ports = {me: [int(a.rsplit(":", 1)[1]) for a in up[me].read_text().split()] for me in "ab"}
    moved_to = fallback_bases(block)[0]
    assert all(block <= p < block + PORT_BLOCK for p in ports["a"]), (ports, texts)
    assert all(moved_to <= p < moved_to + PORT_BLOCK for p in ports["b"]), (ports, texts)
    assert f"the job uses {moved_to}-{moved_to + PORT_BLOCK - 1} instead" in texts["b"], texts["b"]
    assert error_lines(texts["a"]) == error_lines(texts["b"]) == [], texts
    assert_nothing_left(slurm_cluster)
