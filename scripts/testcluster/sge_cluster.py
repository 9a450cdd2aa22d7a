#!/usr/bin/env python3
"""A real multi-host Son of Grid Engine cluster on one Linux machine, for tests and CI.

The same namespace layout as the Slurm harness (slurm_cluster.py, whose plumbing this
class inherits): each host runs in its own network + UTS + mount namespace, joined by a
bridge inside the head namespace, on the private network 10.201.0.0/24 (head .1, nI
.10+I). Namespaces are ``kds-head``, ``kds-n1`` ... so a Slurm test cluster (``kdt-*``,
10.200.0.0/24) can run at the same time. sge_qmaster runs in the head namespace
(hostname ``head``), one sge_execd in each node namespace.

Nothing of Debian's default cell (/var/lib/gridengine/default) is used: every start()
builds a private SGE_ROOT in the work directory (links to the installed binaries, a cell
``default`` with classic flat-file spooling) and configures it from scratch: root may
submit (min_uid 0), the scheduler runs every second, queue ``all.q`` on all hosts with
``slots`` per host, no load thresholds (the machine is shared and busy), one tmpdir per
host (a shared /tmp breaks qrsh_starter), and a parallel environment ``mpi``
(``$round_robin``, ``control_slaves TRUE`` for ``qrsh -inherit``).

Requirements: root, Debian's ``gridengine-master gridengine-exec gridengine-client``
(installed on demand, with the debconf answer the master package needs), iproute2 and
util-linux. No systemd. Pure standard library.

Use from Python::

    with SgeTestCluster(Path("/tmp/kds-cluster")) as c:
        job = c.qsub(Path("job.sh"), "-pe", "mpi", "3", cwd=work)
        print(c.wait_job(job))   # SgeJobResult(exit_status=0, failed='0')

Use from a shell (the cluster stays up between ``up`` and ``down``)::

    python scripts/testcluster/sge_cluster.py up /tmp/kds-cluster [--nodes 3] [--slots 2]
    python scripts/testcluster/sge_cluster.py run /tmp/kds-cluster -- qhost
    python scripts/testcluster/sge_cluster.py down /tmp/kds-cluster

Clients (qsub, qstat, qhost, qconf, qacct) run in the head namespace; ``run`` sets
SGE_ROOT/SGE_CELL for them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import slurm_cluster
from slurm_cluster import SlurmClusterError, SlurmTestCluster, _run, _tail, _which

__all__ = ["SgeTestCluster", "SgeJobResult", "SgeClusterError"]

PACKAGES = ("gridengine-master", "gridengine-exec", "gridengine-client")
# Without this answer the master package leaves act_qmaster empty (it is unused here,
# but the package's own cell must install cleanly).
DEBCONF = "gridengine-common shared/gridenginemaster string head\n"
SUBNET = "10.201.0"
QMASTER_PORT = 6444
EXECD_PORT = 6445
SGE_LIB = Path("/usr/lib/gridengine")  # the real binaries, behind Debian's wrapper scripts
SGE_SHARE = Path("/usr/share/gridengine")
PE_NAME = "mpi"
QUEUE = "all.q"
# Variables of an enclosing SGE job that would confuse clients started by the tests.
_JOB_VARS = ("JOB_ID", "JOB_NAME", "PE_HOSTFILE", "NSLOTS", "NHOSTS", "NQUEUES", "PE",
             "QUEUE", "SGE_TASK_ID", "TMPDIR", "SGE_O_WORKDIR", "SGE_JOB_SPOOL_DIR")


class SgeClusterError(SlurmClusterError):
    """The SGE cluster could not be brought up (or torn down)."""


class SgeJobResult(NamedTuple):
    """A finished job as ``qacct -j`` reports it."""

    exit_status: int  # the job script's exit code (128+N if killed by signal N)
    failed: str  # "0" or SGE's failure code and reason, e.g. "100 : assumedly after job"
    fields: dict[str, str]


class SgeTestCluster(SlurmTestCluster):
    """A real SGE cluster (qmaster on ``head``, sge_execd on n1..nN) in network namespaces."""

    subnet = SUBNET
    head_daemon, node_daemon = "sge_qmaster", "sge_execd"
    node_daemon_port = EXECD_PORT
    packages = PACKAGES
    probe_prefix = "kdsprobe"
    default_prefix = "kds"
    error = SgeClusterError
    per_node_option = ("--slots", "slots of all.q per host")

    def __init__(self, workdir: Path | str, nodes: int = 3, slots: int = 2,
                 prefix: str = "kds") -> None:
        super().__init__(workdir, nodes=nodes, cpus_per_node=slots, prefix=prefix)
        self.slots = slots
        self.sge_root = self.workdir / "sge"
        self.cell_dir = self.sge_root / "default" / "common"
        self.spool_dir = self.workdir / "spool"
        self.tmp_dir = self.workdir / "tmp"
        self.hosts_path = self.workdir / "etc" / "hosts"
        self.conf_path = self.cell_dir / "bootstrap"  # (the parent's slurm.conf slot)

    # ------------------------------------------------------------ environment
    @staticmethod
    def _broken_install() -> str:
        return ""  # no munge

    @staticmethod
    def install_packages() -> None:
        """Install Debian's gridengine packages if sge_qmaster is missing (apt-get update first)."""
        if all((SGE_LIB / p).exists() for p in ("sge_qmaster", "sge_execd", "qsub", "qrsh")):
            return
        if not _which("apt-get"):
            raise SgeClusterError("Grid Engine is not installed and apt-get is not available")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        _run(["debconf-set-selections"], input=DEBCONF, env=env)
        # Another test session may be installing Slurm at the same moment: wait for dpkg's lock.
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]
        _run([*apt, "update"], check=False, env=env)
        p = _run([*apt, "install", "-y", "--no-install-recommends", *PACKAGES], check=False, env=env)
        if p.returncode != 0:
            out = (p.stdout + p.stderr).strip().splitlines()[-10:]
            raise SgeClusterError("apt-get install failed:\n" + "\n".join(out))

    def client_settings(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.sge_env().items())

    def sge_env(self) -> dict[str, str]:
        """What every SGE client and daemon of this cluster needs."""
        return {"SGE_ROOT": str(self.sge_root), "SGE_CELL": "default",
                "SGE_QMASTER_PORT": str(QMASTER_PORT), "SGE_EXECD_PORT": str(EXECD_PORT)}

    def _client_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The parent's client environment, minus Slurm's and SGE's job variables, plus SGE_ROOT."""
        out = super()._client_env()
        out.pop("SLURM_CONF", None)
        for var in _JOB_VARS:
            out.pop(var, None)
        out.update(self.sge_env())
        if env:
            out.update(env)
        return out

    # ---------------------------------------------------------------- clients
    def qconf(self, *args: str, input: str | None = None) -> str:
        """Run ``qconf ARGS`` in the head namespace; raise with its output on failure."""
        p = self.head(["qconf", *args], timeout=120, input=input)
        if p.returncode != 0:
            raise SgeClusterError(f"qconf {' '.join(args)} failed ({p.returncode}): "
                                  f"{(p.stderr + p.stdout).strip()}")
        return p.stdout

    def qsub(self, script: Path | str, *args: str, cwd: Path | str | None = None) -> int:
        """Submit a job script (a Path, or a str with the script text); return the job id.

        Options go before the script, e.g. ``("-pe", "mpi", "3")``; script arguments
        go in ``script_args`` of :meth:`qsub_args`.
        """
        return self.qsub_args(script, list(args), [], cwd=cwd)

    def qsub_args(self, script: Path | str, options: Sequence[str], script_args: Sequence[str],
                  cwd: Path | str | None = None) -> int:
        """``qsub -terse OPTIONS SCRIPT SCRIPT_ARGS``; returns the job id."""
        if isinstance(script, Path):
            p = self.head(["qsub", "-terse", *options, str(script), *script_args], cwd=cwd)
        else:
            p = self.head(["qsub", "-terse", *options], cwd=cwd, input=script)
        if p.returncode != 0:
            raise SgeClusterError(f"qsub failed ({p.returncode}): {(p.stderr + p.stdout).strip()}")
        return int(p.stdout.strip().split(".")[0])

    def job_running(self, job_id: int) -> bool:
        """True while qmaster knows the job (pending, running or being torn down)."""
        return self.head(["qstat", "-j", str(job_id)], timeout=60).returncode == 0

    def wait_job(self, job_id: int | str, timeout: float = 60) -> SgeJobResult:
        """Wait until the job has left qstat and its accounting record exists; return it.

        Raises TimeoutError (with ``qstat -j``'s view) if the job is not done in time.
        """
        deadline = time.monotonic() + timeout
        while self.job_running(int(job_id)):
            if time.monotonic() > deadline:
                state = self.head(["qstat", "-j", str(job_id)], timeout=30).stdout
                raise TimeoutError(f"job {job_id} still known to qstat after {timeout} s:\n{state}")
            time.sleep(0.2)
        # The accounting record follows the job's end within accounting_flush_time (0 here).
        while True:
            p = self.head(["qacct", "-j", str(job_id)], timeout=60)
            fields = dict(line.split(None, 1) for line in p.stdout.splitlines()
                          if len(line.split(None, 1)) == 2)
            if p.returncode == 0 and "exit_status" in fields:
                return SgeJobResult(int(fields["exit_status"].split()[0]),
                                    fields.get("failed", "0").strip(), fields)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no accounting record for job {job_id}: {p.stderr.strip()}")
            time.sleep(0.2)

    def exec_hosts(self) -> dict[str, str]:
        """``qhost``'s hosts and their load average ("-" until the host's execd reports)."""
        p = self.head(["qhost"], timeout=60)
        hosts = {}
        for line in p.stdout.splitlines()[3:]:  # header, dashes, "global"
            fields = line.split()
            if len(fields) >= 4:
                hosts[fields[0]] = fields[3]
        return hosts

    def queue_states(self) -> dict[str, str]:
        """Each queue instance of all.q and its state letters ("" when usable)."""
        p = self.head(["qstat", "-f", "-q", QUEUE], timeout=60)
        states = {}
        for line in p.stdout.splitlines():
            fields = line.split()
            if fields and fields[0].startswith(f"{QUEUE}@"):
                states[fields[0].split("@", 1)[1]] = fields[5] if len(fields) > 5 else ""
        return states

    # ------------------------------------------------------------- lifecycle
    def _write_files(self) -> None:
        for d in ("sge", "spool", "tmp", "log"):
            subprocess.run(["rm", "-rf", str(self.workdir / d)], check=False)
        for d in (self.cell_dir, self.spool_dir / "qmaster", self.spool_dir / "execd",
                  self.workdir / "etc", self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        for node in self.node_names:
            (self.tmp_dir / node).mkdir(parents=True, exist_ok=True)
        hosts = ["127.0.0.1 localhost"] + [f"{ns.ip} {ns.host}" for ns in self._all_ns()]
        self.hosts_path.write_text("\n".join(hosts) + "\n")
        # A private SGE_ROOT: the installed binaries, utilities and libraries, our own cell.
        for name in ("bin", "lib", "utilbin"):
            (self.sge_root / name).symlink_to(Path("/var/lib/gridengine") / name)
        (self.sge_root / "util").symlink_to(SGE_SHARE / "util")
        (self.cell_dir / "act_qmaster").write_text("head\n")
        # Classic spooling: plain files under the work directory, nothing shared with Debian's cell.
        (self.cell_dir / "bootstrap").write_text(f"""\
# Generated by scripts/testcluster/sge_cluster.py
admin_user              none
default_domain          none
ignore_fqdn             true
spooling_method         classic
spooling_lib            libspoolc
spooling_params         {self.cell_dir};{self.spool_dir / 'qmaster'}
binary_path             /usr/sbin
qmaster_spool_dir       {self.spool_dir / 'qmaster'}
security_mode           none
listener_threads        2
worker_threads          2
scheduler_threads       1
""")
        (self.workdir / "cluster.json").write_text(json.dumps(
            {"nodes": self.nodes, "slots": self.slots, "prefix": self.prefix}))

    def _global_config(self) -> str:
        """Debian's default global configuration, changed for a fast, root-run test cluster."""
        changes = {
            "execd_spool_dir": str(self.spool_dir / "execd"),
            "mailer": "/bin/true",
            "min_uid": "0",  # tests submit as root
            "min_gid": "0",
            "load_report_time": "00:00:05",
            # Accounting records at once, so qacct can tell the exit status right after the job.
            "reporting_params": "accounting=true reporting=false flush_time=00:00:01 "
                                "joblog=false sharelog=00:00:00 accounting_flush_time=00:00:00",
            "loglevel": "log_info",
        }
        lines = []
        for line in (SGE_SHARE / "default-configuration").read_text().splitlines():
            key = line.split(None, 1)[0] if line.strip() and not line.startswith("#") else ""
            lines.append(f"{key:<22} {changes[key]}" if key in changes else line)
        return "\n".join(lines) + "\n"

    def _init_spool(self) -> None:
        env = dict(self.sge_env(), PATH="/usr/sbin:/usr/bin:/sbin:/bin")
        params = f"{self.cell_dir};{self.spool_dir / 'qmaster'}"
        _run([str(SGE_LIB / "spoolinit"), "classic", "libspoolc", params, "init"], env=env)
        conf = self.workdir / "etc" / "global-configuration"
        conf.write_text(self._global_config())
        defaults = str(SGE_LIB / "spooldefaults")
        _run([defaults, "configuration", str(conf)], env=env)
        _run([defaults, "complexes", str(SGE_SHARE / "util/resources/centry")], env=env)
        _run([defaults, "usersets", str(SGE_SHARE / "util/resources/usersets")], env=env)
        _run([defaults, "managers", "root"], env=env)

    def _configure(self) -> None:
        """Hosts, scheduler, parallel environment and queue, through qconf as an admin would."""
        hosts = " ".join(self.node_names)
        for flag in ("-ah", "-as"):  # every host may administer and submit (qrsh -inherit)
            self.qconf(flag, ",".join(["head", *self.node_names]))
        sched = self.qconf("-ssconf")
        sched = re.sub(r"(?m)^schedule_interval\s+\S+", "schedule_interval 0:0:1", sched)
        sched = re.sub(r"(?m)^job_load_adjustments\s+\S+", "job_load_adjustments NONE", sched)
        sched = re.sub(r"(?m)^load_adjustment_decay_time\s+\S+",
                       "load_adjustment_decay_time 0:0:0", sched)
        sched = re.sub(r"(?m)^flush_submit_sec\s+\S+", "flush_submit_sec 1", sched)
        sched = re.sub(r"(?m)^flush_finish_sec\s+\S+", "flush_finish_sec 1", sched)
        self._qconf_file("-Msconf", "sched", sched)
        self._qconf_file("-Ahgrp", "allhosts", f"group_name @allhosts\nhostlist {hosts}\n")
        self._qconf_file("-Ap", PE_NAME, f"""\
pe_name            {PE_NAME}
slots              9999
user_lists         NONE
xuser_lists        NONE
start_proc_args    NONE
stop_proc_args     NONE
allocation_rule    $round_robin
control_slaves     TRUE
job_is_first_task  FALSE
urgency_slots      min
accounting_summary FALSE
qsort_args         NONE
""")
        tmpdirs = ",".join(f"[{n}={self.tmp_dir / n}]" for n in self.node_names)
        self._qconf_file("-Aq", QUEUE, f"""\
qname                 {QUEUE}
hostlist              @allhosts
seq_no                0
load_thresholds       NONE
suspend_thresholds    NONE
nsuspend              1
suspend_interval      00:05:00
priority              0
min_cpu_interval      00:05:00
processors            UNDEFINED
qtype                 BATCH INTERACTIVE
ckpt_list             NONE
pe_list               {PE_NAME}
rerun                 FALSE
slots                 {self.slots}
tmpdir                /tmp,{tmpdirs}
shell                 /bin/sh
prolog                NONE
epilog                NONE
shell_start_mode      posix_compliant
starter_method        NONE
suspend_method        NONE
resume_method         NONE
terminate_method      NONE
notify                00:00:60
owner_list            NONE
user_lists            NONE
xuser_lists           NONE
subordinate_list      NONE
complex_values        NONE
projects              NONE
xprojects             NONE
calendar              NONE
initial_state         default
s_rt                  INFINITY
h_rt                  INFINITY
s_cpu                 INFINITY
h_cpu                 INFINITY
s_fsize               INFINITY
h_fsize               INFINITY
s_data                INFINITY
h_data                INFINITY
s_stack               INFINITY
h_stack               INFINITY
s_core                INFINITY
h_core                INFINITY
s_rss                 INFINITY
h_rss                 INFINITY
s_vmem                INFINITY
h_vmem                INFINITY
""")

    def _qconf_file(self, flag: str, name: str, text: str) -> None:
        path = self.workdir / "etc" / f"{name}.conf"
        path.write_text(text)
        self.qconf(flag, str(path))

    def _start_sge_daemon(self, node: str, daemon: str) -> None:
        ns = self._node_ns(node)
        env = dict(self.sge_env(), PATH="/usr/sbin:/usr/bin:/sbin:/bin", LANG="C.UTF-8")
        # The daemons fork into the background: their output goes to a file, not a pipe.
        with open(self.log_dir / f"{daemon}-{node}.stdout", "ab") as out:
            p = subprocess.run(self._enter(ns, [str(SGE_LIB / daemon)]), env=env,
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        if p.returncode != 0:
            raise SgeClusterError(f"{daemon} on {node} exited with {p.returncode}:\n"
                                  f"{_tail(self.log_dir / f'{daemon}-{node}.stdout')}")

    def _logs(self) -> str:
        parts = [f"  {self.spool_dir / 'qmaster/messages'}:\n"
                 f"{_tail(self.spool_dir / 'qmaster/messages')}"]
        for n in self.node_names:
            path = self.spool_dir / "execd" / n / "messages"
            parts.append(f"  {path}:\n{_tail(path, 8)}")
        return "\n".join(parts)

    def start(self, timeout: float = 300, lock_timeout: float = 600) -> None:
        """Bring the cluster up; wait until qhost reports every host and all.q is usable.

        Leftovers of a crashed run with the same prefix are removed first. On failure the
        cluster is torn down and SgeClusterError carries the tail of the daemons' logs.
        The timeout is a hang bound: it takes 1-6 s on an idle 2-core machine, but SGE's
        clients take 10-20 s each when the machine is overloaded (load average 1000+).
        """
        t0 = time.monotonic()
        self._acquire_lock(lock_timeout)
        try:
            self.install_packages()
            self.timings["install"] = time.monotonic() - t0
            self._teardown()
            self._write_files()
            self._init_spool()
            self._create_network()
            self._start_sge_daemon("head", "sge_qmaster")
            self._wait_for(lambda: self.head(["qconf", "-sh"], timeout=60).returncode == 0,
                           t0 + timeout, "sge_qmaster to answer")
            self._configure()
            for node in self.node_names:
                self._start_sge_daemon(node, "sge_execd")
            self._wait_for(lambda: self._ready(), t0 + timeout,
                           f"qhost to report {self.nodes} hosts and all.q to be usable")
        except BaseException as e:
            self._abort_start(e, f"qhost: {self.exec_hosts()!r}" if isinstance(e, SlurmClusterError) else "")
            raise
        self.timings["start"] = time.monotonic() - t0

    def _ready(self) -> bool:
        try:
            hosts, states = self.exec_hosts(), self.queue_states()
        except (subprocess.TimeoutExpired, OSError):
            return False
        return (sorted(hosts) == sorted(self.node_names) and "-" not in hosts.values()
                and states == {n: "" for n in self.node_names})

    def _stop_munged_if_ours(self) -> None:
        """SGE does not use munge."""


def main(argv: list[str] | None = None) -> int:
    return slurm_cluster.main(argv, SgeTestCluster, __doc__)


if __name__ == "__main__":
    sys.exit(main())
