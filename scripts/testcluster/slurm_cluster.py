#!/usr/bin/env python3
"""A real multi-node Slurm cluster on one Linux machine, for tests and CI.

Each emulated node runs in its own network namespace (own IP address, own port space)
plus a private UTS namespace (own ``hostname``) and a private mount namespace in which a
shared hosts file is bind-mounted over ``/etc/hosts``. A bridge inside the head namespace
joins one veth pair per node on the private network 10.200.0.0/24 (head .1, nI .10+I).
The root namespace gets no address on that network, so nothing can leave the machine.
slurmctld runs in the head namespace (hostname ``head``), one ``slurmd -N nI`` in each
node namespace; munged runs in the root namespace (its unix socket is shared through the
filesystem). The filesystem is shared too, so a virtualenv made outside works in jobs.

Requirements: root, Debian's ``slurmd slurmctld slurm-client munge`` packages (installed
on demand), iproute2 and util-linux (``ip``, ``ss``, ``nsenter``, ``unshare``). No systemd.
Pure standard library.

Use from Python::

    with SlurmTestCluster(Path("/tmp/kdt-cluster")) as c:
        print(c.head(["srun", "-N3", "hostname"]).stdout)

Use from a shell (the cluster stays up between ``up`` and ``down``)::

    python scripts/testcluster/slurm_cluster.py up /tmp/kdt-cluster [--nodes 3] [--cpus-per-node 2]
    python scripts/testcluster/slurm_cluster.py run /tmp/kdt-cluster -- srun -N3 hostname
    python scripts/testcluster/slurm_cluster.py run /tmp/kdt-cluster --node n2 -- ss -ltnp
    python scripts/testcluster/slurm_cluster.py down /tmp/kdt-cluster

Namespace names are fixed (``kdt-head``, ``kdt-n1``, ...; the prefix is a constructor
argument) so leftovers of a crashed run are found and removed by the next ``start()``.
Because of that, two clusters with the same prefix cannot coexist: ``start()`` takes an
exclusive lock (``/run/kdt-testcluster/<prefix>.lock``) held until ``stop()``, so
concurrent test sessions on one machine queue up instead of destroying each other's
cluster. A cluster brought up with the ``up`` command holds no lock: the next ``start()``
with the same prefix tears it down.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, Mapping, NamedTuple, Self, Sequence

__all__ = ["SlurmTestCluster", "JobResult", "SlurmClusterError"]

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
SUBNET = "10.200.0"
HEAD_IP = f"{SUBNET}.1"
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
STATE_DIR = Path("/run/kdt-testcluster")  # locks and the munged ownership marker
MUNGE_PIDFILE = Path("/run/munge/munged.pid")
# A minimal, predictable environment for the daemons (jobs get srun's environment instead).
DAEMON_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# Job states from which a job can still move on (see `scontrol show job`).
ACTIVE_JOB_STATES = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING",
    "SIGNALING", "STAGE_OUT", "SUSPENDED",
}
# Variables that would make srun/sbatch think they run inside another allocation.
_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")

# Entered through `nsenter --net=NS unshare --mount --uts -- sh -c ENTER sh HOSTS NAME cmd...`.
# `ip netns exec` cannot be used: it remounts /sys, which hides the cgroup mount that
# slurmd 22.05 insists on. unshare makes the new mount namespace private, so the bind
# mount of the hosts file does not leak into the root namespace.
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


class SlurmClusterError(RuntimeError):
    """The cluster could not be brought up (or torn down)."""


class JobResult(str):
    """A finished job's JobState (the string value) plus its parsed ExitCode.

    Compares equal to the state, e.g. ``c.wait_job(j) == "COMPLETED"``; ``exit_code`` and
    ``signal`` come from ``ExitCode=a:b``; ``fields`` holds all of ``scontrol show job``.
    """

    state: str
    exit_code: int
    signal: int
    fields: dict[str, str]

    def __new__(cls, state: str, exit_code: int, sig: int, fields: dict[str, str]) -> "JobResult":
        obj = super().__new__(cls, state)
        obj.state, obj.exit_code, obj.signal, obj.fields = state, exit_code, sig, fields
        return obj

    @property
    def exit(self) -> str:
        """ExitCode as Slurm prints it, e.g. ``"0:0"``."""
        return f"{self.exit_code}:{self.signal}"

    def __repr__(self) -> str:
        return f"JobResult(state={self.state!r}, exit={self.exit!r})"


class _Netns(NamedTuple):
    name: str  # network namespace, e.g. kdt-n1
    host: str  # hostname inside, e.g. n1
    ip: str


def _run(cmd: Sequence[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a setup command, capturing output; raise with its stderr on failure."""
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    p = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise SlurmClusterError(
            f"{shlex.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (zombies still answer kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait until the pids are gone; return the ones still alive after timeout."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


def _tail(path: Path, lines: int = 15) -> str:
    """Last lines of a log, minus the PMIx noise that every Debian Slurm daemon prints."""
    try:
        text = [line for line in path.read_text(errors="replace").splitlines()
                if "pmix" not in line and "MPI: Cannot create context" not in line][-lines:]
    except OSError as e:
        return f"    ({e.strerror})"
    return "\n".join("    " + line for line in text) or "    (empty)"


def _which(prog: str) -> str | None:
    # Root's PATH normally has the sbin dirs, but a minimal CI environment may not.
    return shutil.which(prog) or shutil.which(prog, path="/usr/sbin:/sbin:/usr/bin:/bin")


class SlurmTestCluster:
    """A real Slurm cluster (1 head + N nodes) in network namespaces on this machine."""

    _held: set[str] = set()  # prefixes whose lock this process holds
    # What a subclass for another scheduler (scripts/testcluster/sge_cluster.py) changes.
    subnet = SUBNET  # the private /24 network, first three octets
    head_daemon, node_daemon = "slurmctld", "slurmd"  # stopped gently (nodes first)
    node_daemon_port = SLURMD_PORT
    packages = PACKAGES  # Debian packages install_packages() installs
    probe_prefix = "kdtprobe"  # available()'s throwaway namespace; never a cluster's prefix
    default_prefix = "kdt"
    error = SlurmClusterError  # what a failed start() raises
    per_node_option = ("--cpus-per-node", "CPUs of each node")  # `up`'s flag for cpus_per_node

    def __init__(self, workdir: Path | str, nodes: int = 3, cpus_per_node: int = 2,
                 prefix: str = "kdt") -> None:
        if not 1 <= nodes <= 200:
            raise ValueError("nodes must be between 1 and 200")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ValueError("prefix must be 1-8 lowercase letters/digits")
        self.workdir = Path(workdir).resolve()
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.prefix = prefix
        self.conf_path = self.workdir / "etc" / "slurm.conf"
        self.hosts_path = self.workdir / "etc" / "hosts"
        self.log_dir = self.workdir / "log"
        self.run_dir = self.workdir / "run"
        self.timings: dict[str, float] = {}  # seconds taken by the last start()/stop()
        self._lock: IO[str] | None = None

    # ----------------------------------------------------------------- names
    @property
    def node_names(self) -> list[str]:
        """Slurm node names / hostnames: n1 .. nN."""
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    def _head_ns(self) -> _Netns:
        return _Netns(f"{self.prefix}-head", "head", f"{self.subnet}.1")

    def _node_ns(self, name: str) -> _Netns:
        if name == "head":
            return self._head_ns()
        if name not in self.node_names:
            raise ValueError(f"unknown node {name!r}; expected head or one of {self.node_names}")
        i = int(name[1:])
        return _Netns(f"{self.prefix}-{name}", name, f"{self.subnet}.{10 + i}")

    def _all_ns(self) -> list[_Netns]:
        return [self._head_ns()] + [self._node_ns(n) for n in self.node_names]

    # ------------------------------------------------------------ environment
    @staticmethod
    def install_packages() -> None:
        """Install the Debian Slurm and munge packages if slurmctld is missing.

        Runs ``apt-get update`` only if the first install attempt fails (stale lists).
        Raises SlurmClusterError with apt's output on failure.
        """
        if _which("slurmctld") and _which("slurmd") and _which("srun") and _which("munged"):
            return
        if not _which("apt-get"):
            raise SlurmClusterError("Slurm is not installed and apt-get is not available")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
        p = _run(install, check=False, env=env)
        if p.returncode != 0:
            _run(["apt-get", "update"], check=False, env=env)
            p = _run(install, check=False, env=env)
        if p.returncode != 0:
            out = (p.stdout + p.stderr).strip().splitlines()[-10:]
            raise SlurmClusterError("apt-get install failed:\n" + "\n".join(out))

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(True, "") if a cluster can be started here, else (False, reason).

        Installs the packages if needed, and proves that network namespaces can be made.
        """
        if sys.platform != "linux":
            return False, "needs Linux network namespaces"
        if os.geteuid() != 0:
            return False, f"needs root (network namespaces, bind mounts, {cls.node_daemon})"
        missing = [p for p in ("ip", "ss", "nsenter", "unshare", "mount", "hostname")
                   if not _which(p)]
        if missing:
            return False, f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
        try:
            cls.install_packages()
        except (SlurmClusterError, OSError) as e:
            return False, f"cannot install {' '.join(cls.packages)}: {e}"
        broken = cls._broken_install()
        if broken:
            return False, broken
        probe = f"{cls.probe_prefix}{os.getpid()}"
        p = _run(["ip", "netns", "add", probe], check=False)
        if p.returncode != 0:
            return False, f"cannot create network namespaces: {p.stderr.strip()}"
        _run(["ip", "netns", "del", probe], check=False)
        return True, ""

    def client_settings(self) -> str:
        """What a client outside the harness needs to reach this cluster."""
        return f"SLURM_CONF={self.conf_path}"

    @staticmethod
    def _broken_install() -> str:
        """Why the installed packages cannot work, or ""."""
        if not Path("/etc/munge/munge.key").exists():
            return "/etc/munge/munge.key is missing (munge package broken?)"
        return ""

    def _client_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment for clients/jobs, minus Slurm job variables.

        The directory of the running interpreter is put first on PATH (and VIRTUAL_ENV
        set when it is a venv) so that ``srun python ...`` runs this same interpreter.
        """
        out = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        bindir = os.path.dirname(sys.executable)
        path = out.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
        if bindir and bindir not in path:
            path.insert(0, bindir)
        for d in ("/usr/sbin", "/sbin"):  # ip, ss and the Slurm daemons live there
            if d not in path:
                path.append(d)
        out["PATH"] = os.pathsep.join(path)
        if sys.prefix != sys.base_prefix:
            out.setdefault("VIRTUAL_ENV", sys.prefix)
        out["SLURM_CONF"] = str(self.conf_path)
        if env:
            out.update(env)
        return out

    # ---------------------------------------------------------- running things
    def _enter(self, ns: _Netns, cmd: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{ns.name}", "--", "unshare", "--mount", "--uts",
                "--", "sh", "-c", _ENTER, "sh", str(self.hosts_path), ns.host, *cmd]

    @staticmethod
    def _argv(cmd: Sequence[str] | str) -> list[str]:
        return ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)

    def _exec(self, ns: _Netns, cmd: Sequence[str] | str, env: Mapping[str, str] | None,
              timeout: float | None, check: bool, cwd: Path | str | None,
              capture: bool, input: str | None) -> subprocess.CompletedProcess:
        argv = self._argv(cmd)
        pipe = subprocess.PIPE if capture else None
        # A session of its own so a timeout kills the whole command tree, not just nsenter.
        with subprocess.Popen(self._enter(ns, argv), env=self._client_env(env), cwd=cwd,
                              stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                              stdout=pipe, stderr=pipe, text=True,
                              start_new_session=True) as p:
            try:
                out, err = p.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                out, err = p.communicate()
                raise subprocess.TimeoutExpired(argv, timeout or 0, out, err) from None
        if check and p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, argv, out, err)
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def head(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None,
             timeout: float | None = 120, check: bool = False, cwd: Path | str | None = None,
             capture: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        """Run cmd (argv list, or a string for ``bash -c``) in the head namespace.

        Use it for clients: srun, sbatch, squeue, scontrol, sinfo (no sacct: no accounting).
        Output is captured as text unless capture=False. env is added to the caller's
        environment (see _client_env); SLURM_CONF points at this cluster's slurm.conf.
        """
        return self._exec(self._head_ns(), cmd, env, timeout, check, cwd, capture, input)

    def on_node(self, name: str, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None,
                timeout: float | None = 120, check: bool = False, cwd: Path | str | None = None,
                capture: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        """Like head(), but inside node `name` (n1..nN, or "head")."""
        return self._exec(self._node_ns(name), cmd, env, timeout, check, cwd, capture, input)

    def popen(self, name: str, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start cmd in the background inside node `name` (or "head"); Popen kwargs pass on.

        Whatever is left running is killed by stop().
        """
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self._enter(self._node_ns(name), self._argv(cmd)),
                                env=self._client_env(env), **kwargs)

    def sbatch(self, script: str | Path, *args: str, cwd: Path | str | None = None) -> int:
        """Submit a batch script (a Path to a file, or a str with the script text).

        Returns the job id; extra sbatch options go in args, e.g. ("-N2", "-o", "out.txt").
        """
        if isinstance(script, Path):
            p = self.head(["sbatch", "--parsable", *args, str(script)], cwd=cwd, check=True)
        else:
            p = self.head(["sbatch", "--parsable", *args], cwd=cwd, check=True, input=script)
        return int(p.stdout.strip().split(";")[0])

    def wait_job(self, job_id: int | str, timeout: float = 60) -> JobResult:
        """Poll ``scontrol show job`` until the job is no longer PENDING/RUNNING/COMPLETING.

        Returns a JobResult: equal to the JobState string (e.g. "COMPLETED", "FAILED"), with
        .exit_code and .signal parsed from ExitCode=a:b. Raises TimeoutError on timeout.
        """
        deadline = time.monotonic() + timeout
        while True:
            p = self.head(["scontrol", "-o", "show", "job", str(job_id)], timeout=30)
            if p.returncode != 0:
                raise SlurmClusterError(f"scontrol show job {job_id}: {p.stderr.strip()}")
            fields = dict(re.findall(r"(\w+)=(\S*)", p.stdout))
            state = fields.get("JobState", "")
            if state and state not in ACTIVE_JOB_STATES:
                code, _, sig = fields.get("ExitCode", "0:0").partition(":")
                return JobResult(state, int(code or 0), int(sig or 0), fields)
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state or '?'} after {timeout} s")
            time.sleep(0.2)

    def set_link(self, node: str, up: bool) -> None:
        """Bring node's link to the cluster network up or down: down is a dead node to its peers
        (no socket is closed, nothing answers), while its processes keep running."""
        _run(["ip", "-n", self._head_ns().name, "link", "set", f"v{node}", "up" if up else "down"])

    def listening_ports(self, node: str) -> list[int]:
        """TCP ports listening inside node's network namespace (``ss -ltnH``)."""
        p = _run(["nsenter", f"--net=/run/netns/{self._node_ns(node).name}", "ss", "-ltnH"])
        ports = {int(line.split()[3].rsplit(":", 1)[1]) for line in p.stdout.splitlines()
                 if len(line.split()) >= 4}
        return sorted(ports)

    def leftovers(self, pattern: str, wait: float) -> tuple[list[str], dict[str, list[int]]]:
        """Processes matching ``pattern`` (see processes_matching) and, per node, the ports
        listening there but the node daemon's; waits up to ``wait`` seconds for both to be
        gone (the scheduler may still be reaping a job's tasks for a moment after its end)."""
        deadline = time.monotonic() + wait
        while True:
            procs = self.processes_matching(pattern)
            ports = {n: [p for p in self.listening_ports(n) if p != self.node_daemon_port] for n in self.node_names}
            if not procs and not any(ports.values()) or time.monotonic() > deadline:
                return procs, ports
            time.sleep(0.2)

    def _netns_inodes(self) -> set[int]:
        inodes = set()
        for ns in self._all_ns():
            try:
                inodes.add(os.stat(f"/run/netns/{ns.name}").st_ino)
            except OSError:
                pass
        return inodes

    def processes_matching(self, pattern: str, in_cluster: bool = True) -> list[str]:
        """``"PID cmdline"`` of processes whose command line matches the regex `pattern`.

        By default only processes inside this cluster's namespaces count (so the test's
        own command line cannot match); in_cluster=False searches the whole machine.
        """
        rx = re.compile(pattern)
        inodes = self._netns_inodes() if in_cluster else set()
        me = os.getpid()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            pid = int(entry)
            if in_cluster:
                try:
                    if os.stat(f"/proc/{pid}/ns/net").st_ino not in inodes:
                        continue
                except OSError:
                    continue
            cmd = _cmdline(pid)
            if cmd and rx.search(cmd) and _alive(pid):
                found.append(f"{pid} {cmd}")
        return found

    # ------------------------------------------------------------- lifecycle
    def _acquire_lock(self, timeout: float) -> None:
        if self._lock is not None:
            return
        if self.prefix in SlurmTestCluster._held:
            # flock would block on ourselves until the timeout: fail at once instead.
            raise SlurmClusterError(
                f"a cluster with prefix {self.prefix!r} is already running in this process; "
                "give the second one another prefix")
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        f = open(STATE_DIR / f"{self.prefix}.lock", "a+")
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and timeout > 0:
                    f.seek(0)
                    print(f"slurm_cluster: waiting for {f.name} ({f.read().strip()})",
                          file=sys.stderr)
                    told = True
                if time.monotonic() > deadline:
                    f.seek(0)
                    holder = f.read().strip()
                    f.close()
                    raise SlurmClusterError(
                        f"another test cluster with prefix {self.prefix!r} is in use "
                        f"({holder}); waited {timeout:.0f} s") from None
                time.sleep(0.5)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}, workdir {self.workdir}\n")
        f.flush()
        self._lock = f
        SlurmTestCluster._held.add(self.prefix)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None
            SlurmTestCluster._held.discard(self.prefix)

    def _write_files(self) -> None:
        # Start from scratch: no jobs recovered from an older run, no stale lines in the logs.
        for d in ("state", "log", "run"):
            shutil.rmtree(self.workdir / d, ignore_errors=True)
        for d in ("etc", "log", "run", "state/ctld", *(f"state/{n}" for n in self.node_names)):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        hosts = ["127.0.0.1 localhost", f"{HEAD_IP} head"]
        hosts += [f"{ns.ip} {ns.host}" for ns in self._all_ns()[1:]]
        self.hosts_path.write_text("\n".join(hosts) + "\n")
        # Every slurmd sees the whole machine; SlurmdParameters=config_overrides makes the
        # configured CPUs/memory authoritative so nodes are never drained for "low" resources.
        mem_mb = max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                     // 2**20 // (self.nodes + 1))
        w = self.workdir
        conf = f"""\
# Generated by scripts/testcluster/slurm_cluster.py
ClusterName={self.prefix}
SlurmctldHost=head({HEAD_IP})
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={w}/state/ctld
SlurmdSpoolDir={w}/state/%n
SlurmctldPidFile={w}/run/slurmctld.pid
SlurmdPidFile={w}/run/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
# Ports Slurm reserves for a step that asks (srun --resv-ports): SLURM_STEP_RESV_PORTS.
MpiParams=ports=12000-12999
MailProg=/bin/true
ReturnToService=2
KillWait=5
# Schedule batch jobs at once (default: up to 3 s later), and look at pending jobs every
# second (sched_interval, bf_interval: default 60 s and 30 s); tests submit few jobs. A job
# that becomes eligible by time alone (a requeued one, below) otherwise waits for those loops.
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
# A requeued job waits out the job credential's lifetime before it runs again (slurm.conf(5),
# AuthInfo cred_expire: default 120 s, least 5); the requeue tests waited 2 min each for it.
AuthInfo=cred_expire=10
"""
        for ns in self._all_ns()[1:]:
            conf += (f"NodeName={ns.host} NodeAddr={ns.ip} CPUs={self.cpus_per_node} "
                     f"RealMemory={mem_mb} State=UNKNOWN\n")
        conf += "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        self.conf_path.write_text(conf)
        (w / "cluster.json").write_text(json.dumps(
            {"nodes": self.nodes, "cpus_per_node": self.cpus_per_node, "prefix": self.prefix}))

    def _create_network(self) -> None:
        head = self._head_ns().name
        ip = ["ip", "-n", head]
        _run(["ip", "netns", "add", head])
        _run([*ip, "link", "set", "lo", "up"])
        _run([*ip, "link", "add", "br0", "type", "bridge"])
        _run([*ip, "addr", "add", f"{self._head_ns().ip}/24", "dev", "br0"])
        _run([*ip, "link", "set", "br0", "up"])
        for node in self.node_names:
            ns = self._node_ns(node)
            _run(["ip", "netns", "add", ns.name])
            _run(["ip", "-n", ns.name, "link", "set", "lo", "up"])
            # Create the pair inside the head namespace, so the root namespace never sees it.
            _run([*ip, "link", "add", f"v{node}", "type", "veth",
                  "peer", "name", "eth0", "netns", ns.name])
            _run([*ip, "link", "set", f"v{node}", "master", "br0", "up"])
            _run(["ip", "-n", ns.name, "addr", "add", f"{ns.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns.name, "link", "set", "eth0", "up"])

    @staticmethod
    def _munged_pids() -> list[int]:
        return [int(d) for d in os.listdir("/proc")
                if d.isdigit() and _comm(int(d)) == "munged" and _alive(int(d))]

    def _ensure_munged(self) -> None:
        """Start munged unless it runs; remember (across processes) that we started it."""
        owner = STATE_DIR / "munged.owner"
        if self._munged_pids():
            return
        # Debian's postinst does not leave a runtime dir behind without systemd.
        _run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "755", "/run/munge"])
        _run(["runuser", "-u", "munge", "--", _which("munged") or "/usr/sbin/munged"],
             env=DAEMON_ENV)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        owner.write_text(self.prefix + "\n")
        deadline = time.monotonic() + 10
        while True:
            enc = _run(["munge", "-n"], check=False)
            if enc.returncode == 0 and _run(["unmunge"], check=False,
                                           input=enc.stdout).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"munged does not work: {enc.stderr.strip()}")
            time.sleep(0.1)

    def _other_clusters_running(self) -> list[str]:
        """The prefixes of the other test clusters whose lock is held now (any process, this one too)."""
        held = []
        for path in sorted(STATE_DIR.glob("*.lock")):
            if path.stem == self.prefix:
                continue
            with open(path, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held.append(path.stem)
        return held

    def _stop_munged_if_ours(self) -> None:
        owner = STATE_DIR / "munged.owner"
        try:
            ours = owner.read_text().strip() == self.prefix
        except OSError:
            return
        if not ours:
            return
        if others := self._other_clusters_running():
            # They use this munged too: stopping it would fail every Slurm RPC of theirs.
            print(f"slurm_cluster: munged keeps running for the clusters {', '.join(others)}", file=sys.stderr)
            return
        pids = self._munged_pids()
        _kill(pids, signal.SIGTERM)
        _kill(_wait_gone(pids, 5), signal.SIGKILL)
        owner.unlink(missing_ok=True)

    def _start_daemon(self, ns: _Netns, argv: list[str]) -> None:
        # The daemons fork into the background; their stdout/stderr go to a file, not to a
        # pipe, or run() would wait for the daemon to close it.
        with open(self.log_dir / f"{argv[0]}-{ns.host}.stdout", "ab") as out:
            p = subprocess.run(self._enter(ns, [_which(argv[0]) or argv[0], *argv[1:]]),
                               env=DAEMON_ENV, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        if p.returncode != 0:
            raise SlurmClusterError(f"{argv[0]} on {ns.host} exited with {p.returncode}")

    def _logs(self) -> str:
        parts = [f"  {self.log_dir / 'slurmctld.log'}:\n{_tail(self.log_dir / 'slurmctld.log')}"]
        for n in self.node_names:
            path = self.log_dir / f"slurmd-{n}.log"
            parts.append(f"  {path}:\n{_tail(path, 8)}")
        return "\n".join(parts)

    def start(self, timeout: float = 30, lock_timeout: float = 600) -> None:
        """Bring the cluster up and wait until all nodes are idle.

        Leftovers of a crashed run with the same prefix are removed first. On failure
        the cluster is torn down and SlurmClusterError carries the tail of the logs.
        """
        t0 = time.monotonic()
        self._acquire_lock(lock_timeout)
        try:
            self.install_packages()
            self._teardown()
            self._write_files()
            self._ensure_munged()
            self._create_network()
            self._start_daemon(self._head_ns(), ["slurmctld", "-f", str(self.conf_path)])
            self._wait_for(lambda: SLURMCTLD_PORT in self.listening_ports("head"),
                           t0 + timeout, "slurmctld to listen")
            for node in self.node_names:
                self._start_daemon(self._node_ns(node),
                                   ["slurmd", "-f", str(self.conf_path), "-N", node])
            want = f"idle {self.nodes}"
            self._wait_for(lambda: self._sinfo() == want, t0 + timeout,
                           f"sinfo to print {want!r}")
        except BaseException as e:
            self._abort_start(e, f"last sinfo: {self._sinfo()!r}" if isinstance(e, SlurmClusterError) else "")
            raise
        self.timings["start"] = time.monotonic() - t0

    def _abort_start(self, error: BaseException, state: str) -> None:
        """Tear down after a failed start(); a harness error is raised again as ``self.error``
        with ``state`` and the tail of the daemons' logs."""
        msg = f"{error}\n{state}\nlogs:\n{self._logs()}" if isinstance(error, SlurmClusterError) else None
        self.stop()
        if msg:
            raise self.error(msg) from None

    def _sinfo(self) -> str:
        try:
            p = self.head(["sinfo", "-h", "-o", "%T %D"], timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            return ""
        return p.stdout.strip()

    @staticmethod
    def _wait_for(pred: Callable[[], bool], deadline: float, what: str) -> None:
        while not pred():
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def _existing_ns(self) -> list[str]:
        """Our namespaces that exist, including nodes beyond self.nodes from older runs."""
        try:
            names = os.listdir("/run/netns")
        except OSError:
            return []
        rx = re.compile(rf"{re.escape(self.prefix)}-(head|n\d+)")
        # Nodes first, head last: slurmd must go before slurmctld.
        return sorted((n for n in names if rx.fullmatch(n)), key=lambda n: n.endswith("-head"))

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        p = _run(["ip", "netns", "pids", ns], check=False)
        return [int(x) for x in p.stdout.split() if x.isdigit()]

    def _teardown(self, grace: float = 5) -> None:
        names = self._existing_ns()
        nodes = [n for n in names if not n.endswith("-head")]
        heads = [n for n in names if n.endswith("-head")]
        # slurmd first (a slurmd without its controller may ignore SIGTERM), then slurmctld.
        for group, daemon in ((nodes, self.node_daemon), (heads, self.head_daemon)):
            pids = [p for ns in group for p in self._ns_pids(ns) if _comm(p) == daemon]
            _kill(pids, signal.SIGTERM)
            _kill(_wait_gone(pids, grace), signal.SIGKILL)
        # Then whatever is left: slurmstepd, job tasks, background processes of tests.
        for _ in range(3):
            pids = [p for ns in names for p in self._ns_pids(ns)]
            if not pids:
                break
            _kill(pids, signal.SIGKILL)
            _wait_gone(pids, grace)
        for ns in names:
            # Deleting the head namespace also deletes the bridge and all veth pairs.
            _run(["ip", "netns", "del", ns], check=False)
        left = self._existing_ns()
        if left:
            raise SlurmClusterError(f"could not delete network namespaces: {left}")

    def stop(self) -> None:
        """Stop all daemons and processes of the cluster and delete its namespaces.

        Idempotent; safe after a failed start() and from another process (same workdir).
        munged is stopped only if this harness (same prefix) started it and no other test
        cluster runs (they share it; it is then left running). A cluster with
        the same prefix that someone else holds the lock for is left alone (with a warning).
        """
        t0 = time.monotonic()
        if self._lock is None:
            try:
                self._acquire_lock(0)
            except SlurmClusterError as e:
                print(f"slurm_cluster: stop() leaves the cluster alone: {e}", file=sys.stderr)
                return
        try:
            self._teardown()
            self._stop_munged_if_ours()
        finally:
            self._release_lock()
        self.timings["stop"] = time.monotonic() - t0

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @classmethod
    def from_workdir(cls, workdir: Path | str) -> Self:
        """The cluster described by workdir/cluster.json (written by start())."""
        try:
            cfg = json.loads((Path(workdir) / "cluster.json").read_text())
        except OSError:
            cfg = {}
        return cls(workdir, **cfg)


def main(argv: list[str] | None = None, cls: type[SlurmTestCluster] = SlurmTestCluster,
         doc: str = __doc__) -> int:
    """The command line of ``cls`` (see the module docstring); sge_cluster.py runs it too."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster, leave it running")
    up.add_argument("workdir", type=Path)
    up.add_argument("--nodes", type=int, default=3)
    flag, help = cls.per_node_option
    up.add_argument(flag, dest="per_node", metavar="N", type=int, default=2, help=help)
    up.add_argument("--prefix", default=cls.default_prefix)
    down = sub.add_parser("down", help="stop the cluster started in workdir")
    down.add_argument("workdir", type=Path)
    run = sub.add_parser("run", help="run the command after -- in the head (or --node) namespace")
    run.add_argument("workdir", type=Path)
    run.add_argument("--node", default="head", help="head (default) or n1..nN")
    argv = sys.argv[1:] if argv is None else argv
    # Split at "--" ourselves: argparse.REMAINDER would also swallow options like --node.
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)

    if args.cmd == "up":
        ok, why = cls.available()
        if not ok:
            print(f"cannot start a cluster: {why}", file=sys.stderr)
            return 1
        c = cls(args.workdir, args.nodes, args.per_node, args.prefix)
        c.start()
        print(f"cluster up in {c.timings['start']:.2f} s; {c.client_settings()}")
        return 0
    c = cls.from_workdir(args.workdir)
    if args.cmd == "down":
        c.stop()
        if "stop" not in c.timings:  # someone else's cluster: stop() said why on stderr
            return 1
        print(f"cluster down in {c.timings['stop']:.2f} s")
        return 0
    if not cmd:
        ap.error("run needs a command after --")
    return c.on_node(args.node, cmd, timeout=None, capture=False).returncode


if __name__ == "__main__":
    sys.exit(main())
