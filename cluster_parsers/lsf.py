"""IBM Spectrum LSF: LSB_DJOB_HOSTFILE or LSB_MCPU_HOSTS; ranks from jsrun or MPI."""

from __future__ import annotations

from ._slots import group_slots, local_host_index, place_rank, read_host_file
from .base import ClusterConfigError, ClusterParser, JobInfo, mpi_rank, split_gpu_ids


class LsfParser(ClusterParser):
    """Nodes and slots from LSF's host file or host string."""

    name = "lsf"
    detect_vars = ("LSB_JOBID",)
    agent_launch_hint = "start one agent per host: jsrun -r1 -a1 python -m keras_distrib.lsf ... (or blaunch)"

    job_id_var = "LSB_JOBID"
    hostfile_var = "LSB_DJOB_HOSTFILE"
    mcpu_hosts_var = "LSB_MCPU_HOSTS"
    # jsrun (Summit/Sierra-style) sets these for each task.
    jsm_rank_var = "JSM_NAMESPACE_RANK"
    jsm_size_var = "JSM_NAMESPACE_SIZE"
    jsm_local_rank_var = "JSM_NAMESPACE_LOCAL_RANK"
    gpu_vars = ("CUDA_VISIBLE_DEVICES",)

    def parse(self) -> JobInfo:
        _, job_id = self.require(self.job_id_var, hint="submit with bsub -n N ...")
        slots, source = self._slot_hosts()
        nodes, counts = group_slots(slots)
        if self.env.get(self.jsm_rank_var):
            rank = self.int_var(self.jsm_rank_var)
            size = self.int_var(self.jsm_size_var, default=len(slots))
            if size != len(slots):
                raise ClusterConfigError(
                    f"{self.jsm_size_var}={size} but {source} lists {len(slots)} slot(s).",
                    "launch one task per slot (jsrun -r1 ...) or use the agent mode with one task per node.",
                )
            node_index, local_rank = place_rank(rank, slots, nodes, source)
        elif (mpi := mpi_rank(self.env)) is not None:
            rank = mpi[0]
            node_index, local_rank = place_rank(rank, slots, nodes, source)
        else:
            node_index = local_host_index(nodes, self.env) or 0
            rank, local_rank = slots.index(nodes[node_index]), 0
        gpus = split_gpu_ids(self.gpu_vars[0], self.env.get(self.gpu_vars[0], ""))
        return JobInfo(
            scheduler=self.name,
            job_id=job_id,
            nodes=tuple(nodes),
            tasks_per_node=tuple(counts),
            rank=rank,
            local_rank=local_rank,
            node_index=node_index,
            tasks_source=source,
            tasks_launched=bool(self.env.get(self.jsm_rank_var)) or mpi_rank(self.env) is not None,
            node_gpus=tuple(gpus for _ in nodes),
        )

    def _slot_hosts(self) -> tuple[list[str], str]:
        """One host name per slot, and the variable it came from."""
        if self.env.get(self.hostfile_var):
            path = self.env[self.hostfile_var]
            return read_host_file(self.hostfile_var, path, hint="run inside the LSF job that owns it."), self.hostfile_var
        _, value = self.require(
            self.mcpu_hosts_var, self.hostfile_var, hint="LSF sets these inside a job; submit with bsub."
        )
        fields = value.split()
        if len(fields) % 2 or not all(f.isdigit() for f in fields[1::2]):
            raise ClusterConfigError(
                f"{self.mcpu_hosts_var}={value!r} is malformed.",
                "expected 'hostA 4 hostB 4' (host, slot count pairs).",
            )
        slots = [host for host, n in zip(fields[::2], fields[1::2]) for _ in range(int(n))]
        return slots, self.mcpu_hosts_var
