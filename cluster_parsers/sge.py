"""Son of Grid Engine / Univa Grid Engine: PE_HOSTFILE lines are ``host slots queue procs``."""

from __future__ import annotations

from ._slots import read_host_file
from .base import ClusterConfigError, ClusterParser, JobInfo, check_host_names, split_gpu_ids
from .tasks import launched_tasks


class SgeParser(ClusterParser):
    """Nodes and slots from PE_HOSTFILE; tasks from an MPI launcher (see ``tasks.py``)."""

    name = "sge"
    detect_vars = ("PE_HOSTFILE", "SGE_ROOT")
    agent_launch_hint = "start one agent per host: qrsh -inherit HOST python -m keras_distrib.sge ... (or mpirun --map-by ppr:1:node)"

    job_id_vars = ("JOB_ID",)
    reschedule_exit_code = 99  # a job script exiting with 99 is rescheduled (qsub -r y)
    end_command = ("qdel",)
    hostfile_var = "PE_HOSTFILE"
    slots_var = "NSLOTS"
    hosts_var = "NHOSTS"
    gpu_vars = ("CUDA_VISIBLE_DEVICES", "SGE_HGR_gpu")

    def is_present(self) -> bool:
        # SGE_ROOT alone is set on submit hosts outside jobs; a job also has JOB_ID.
        return bool(self.env.get(self.hostfile_var)) or (
            "SGE_ROOT" in self.env and self.job_id_vars[0] in self.env
        )

    def parse(self) -> JobInfo:
        _, job_id = self.require(*self.job_id_vars, hint="submit with qsub -pe <pe> N.")
        _, path = self.require(
            self.hostfile_var,
            hint="request a parallel environment: qsub -pe <pe> N (PE_HOSTFILE is only set for PE jobs).",
        )
        source = f"{self.hostfile_var}={path!r}"
        slots_of = self._host_slots(path, source)
        nodes, slots = list(slots_of), list(slots_of.values())
        if self.env.get(self.slots_var) and not self._slots_agree(self.int_var(self.slots_var), slots):
            raise ClusterConfigError(
                f"{self.slots_var}={self.env[self.slots_var]} but {self.hostfile_var} lists {sum(slots)} slot(s).",
                "NSLOTS and PE_HOSTFILE must come from the same job.",
            )
        tasks = launched_tasks(self.env, nodes, slots, source, self.agent_launch_hint)
        gpus: tuple[str, ...] = ()
        for var in self.gpu_vars:
            if var in self.env:
                gpus = split_gpu_ids(var, self.env[var].replace(" ", ","))
                break
        return self.job_info(job_id, nodes, slots, tasks, gpus)

    def _slots_agree(self, nslots: int, slots: list[int]) -> bool:
        """NSLOTS is the job's total, except in a task started by ``qrsh -inherit HOST``:
        there SGE sets NSLOTS and NHOSTS=1 for that host alone, while the inherited
        PE_HOSTFILE still lists the whole job (seen on Son of Grid Engine 8.1.9)."""
        if nslots == sum(slots):
            return True
        return self.env.get(self.hosts_var) == "1" and nslots in slots

    def _host_slots(self, path: str, source: str) -> dict[str, int]:
        """Slots per host in file order; a host in several queues is one node (sge_pe(5))."""
        lines = read_host_file(self.hostfile_var, path, hint="run inside the SGE job that owns this file.")
        slots_of: dict[str, int] = {}
        for line in lines:
            fields = line.split()
            if len(fields) < 2 or not fields[1].isascii() or not fields[1].isdigit() or int(fields[1]) < 1:
                raise ClusterConfigError(
                    f"{source} has a malformed line {line!r}.",
                    "expected 'host slots queue processors' per line, as SGE writes it.",
                )
            check_host_names(source, fields[:1])
            slots_of[fields[0]] = slots_of.get(fields[0], 0) + int(fields[1])
        return slots_of
