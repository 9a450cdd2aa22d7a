"""IBM Spectrum LSF: LSB_DJOB_HOSTFILE or LSB_MCPU_HOSTS; tasks from jsrun or MPI."""

from __future__ import annotations

from ._slots import group_slots, read_host_file
from .base import ClusterConfigError, ClusterParser, JobInfo, check_host_names, split_gpu_ids
from .tasks import launched_tasks, launcher_counts

#: Host name parts of the launch (batch) and login hosts that jsrun systems list first
#: with one slot each (RADICAL-Pilot's LSF resource manager filters the same names).
LAUNCH_HOST_MARKS = ("batch", "login")
#: At most this many leading one-slot hosts are launch/login hosts (batch, then login).
MAX_LAUNCH_HOSTS = 2


class LsfParser(ClusterParser):
    """Nodes and slots from LSF's host file or host string, without its launch hosts."""

    name = "lsf"
    detect_vars = ("LSB_JOBID",)
    agent_launch_hint = "start one agent per host: jsrun -r1 -a1 python -m keras_distrib.lsf ..."

    job_id_vars = ("LSB_JOBID",)
    requeue_command = ("brequeue",)
    end_command = ("bkill",)
    hostfile_var = "LSB_DJOB_HOSTFILE"
    mcpu_hosts_var = "LSB_MCPU_HOSTS"
    gpu_vars = ("CUDA_VISIBLE_DEVICES",)

    def parse(self) -> JobInfo:
        _, job_id = self.require(*self.job_id_vars, hint="submit with bsub -n N ...")
        slot_hosts, source = self._slot_hosts()
        check_host_names(source, slot_hosts)
        nodes, slots = group_slots(slot_hosts)
        launch = self._launch_hosts(nodes, slots)
        nodes, slots = nodes[launch:], slots[launch:]
        dropped = set(group_slots(slot_hosts)[0][:launch])
        compute_slot_hosts = [h for h in slot_hosts if h not in dropped]
        if launch:
            source += f" without launch host(s) {', '.join(sorted(dropped))}"
        tasks = launched_tasks(
            self.env, nodes, slots, source, self.agent_launch_hint, slot_hosts=compute_slot_hosts
        )
        gpus = split_gpu_ids(self.gpu_vars[0], self.env.get(self.gpu_vars[0], ""))
        return self.job_info(job_id, nodes, slots, tasks, gpus)

    def _launch_hosts(self, nodes: list[str], slots: list[int]) -> int:
        """How many leading hosts are launch/login hosts rather than compute nodes.

        On jsrun systems LSF lists the batch host (and sometimes a login host) first,
        one slot each. They are recognised by name, by being followed by hosts with more
        slots (Summit/Lassen list every core of a compute node), or by the launcher's
        task count fitting only the hosts after them.
        """
        leading = 0
        while leading < min(MAX_LAUNCH_HOSTS, len(nodes) - 1) and slots[leading] == 1:
            leading += 1
        launcher = launcher_counts(self.env)
        if launcher is not None and launcher.size is not None:
            for drop in range(leading + 1):
                rest = slots[drop:]
                if launcher.size in (sum(rest), len(rest)) or (
                    launcher.local_size is not None and launcher.size == launcher.local_size * len(rest)
                ):
                    return drop
            return 0
        if leading and any(count > 1 for count in slots[leading:]):
            return leading
        named = 0
        while named < leading and any(mark in nodes[named].lower() for mark in LAUNCH_HOST_MARKS):
            named += 1
        return named

    def _slot_hosts(self) -> tuple[list[str], str]:
        """One host name per slot, and the variable it came from."""
        if self.env.get(self.hostfile_var):
            path = self.env[self.hostfile_var]
            lines = read_host_file(self.hostfile_var, path, hint="run inside the LSF job that owns it.")
            return lines, f"{self.hostfile_var}={path!r}"
        _, value = self.require(
            self.mcpu_hosts_var, self.hostfile_var, hint="LSF sets these inside a job; submit with bsub."
        )
        fields = value.split()
        if len(fields) % 2 or not all(f.isascii() and f.isdigit() and int(f) > 0 for f in fields[1::2]):
            raise ClusterConfigError(
                f"{self.mcpu_hosts_var}={value!r} is malformed.",
                "expected 'hostA 4 hostB 4' (host, slot count pairs).",
            )
        if sum(int(n) for n in fields[1::2]) > 1_000_000:
            raise ClusterConfigError(f"{self.mcpu_hosts_var}={value!r} lists over a million slots.", "check the variable.")
        slots = [host for host, n in zip(fields[::2], fields[1::2]) for _ in range(int(n))]
        return slots, self.mcpu_hosts_var
