"""Son of Grid Engine / Univa Grid Engine: PE_HOSTFILE lines are ``host slots queue procs``."""

from __future__ import annotations

from ._slots import local_host_index, read_host_file
from .base import ClusterConfigError, ClusterParser, JobInfo, mpi_rank, node_of_rank, split_gpu_ids


class SgeParser(ClusterParser):
    """Nodes and slots from PE_HOSTFILE; rank from an MPI launcher or the host name."""

    name = "sge"
    detect_vars = ("PE_HOSTFILE", "SGE_ROOT")
    agent_launch_hint = "start one agent per host: qrsh -inherit HOST python -m keras_distrib.sge ... (or mpirun --map-by ppr:1:node)"

    job_id_var = "JOB_ID"
    hostfile_var = "PE_HOSTFILE"
    slots_var = "NSLOTS"
    gpu_vars = ("CUDA_VISIBLE_DEVICES", "SGE_HGR_gpu")

    def is_present(self) -> bool:
        # SGE_ROOT alone is set on submit hosts outside jobs; a job also has JOB_ID.
        return bool(self.env.get(self.hostfile_var)) or (
            "SGE_ROOT" in self.env and self.job_id_var in self.env
        )

    def parse(self) -> JobInfo:
        _, job_id = self.require(self.job_id_var, hint="submit with qsub -pe <pe> N.")
        _, path = self.require(
            self.hostfile_var,
            hint="request a parallel environment: qsub -pe <pe> N (PE_HOSTFILE is only set for PE jobs).",
        )
        lines = read_host_file(self.hostfile_var, path, hint="run inside the SGE job that owns this file.")
        nodes, counts = [], []
        for line in lines:
            fields = line.split()
            if len(fields) < 2 or not fields[1].isdigit() or int(fields[1]) < 1:
                raise ClusterConfigError(
                    f"{self.hostfile_var}={path!r} has a malformed line {line!r}.",
                    "expected 'host slots queue processors' per line, as SGE writes it.",
                )
            nodes.append(fields[0])
            counts.append(int(fields[1]))
        if self.env.get(self.slots_var) and self.int_var(self.slots_var) != sum(counts):
            raise ClusterConfigError(
                f"{self.slots_var}={self.env[self.slots_var]} but {self.hostfile_var} lists {sum(counts)} slot(s).",
                "NSLOTS and PE_HOSTFILE must come from the same job.",
            )
        if (mpi := mpi_rank(self.env)) is not None:
            rank = mpi[0]
            node_index, local_rank = node_of_rank(rank, counts)
        else:
            node_index = local_host_index(nodes, self.env) or 0
            rank, local_rank = sum(counts[:node_index]), 0
        gpus = ()
        for var in self.gpu_vars:
            if var in self.env:
                gpus = split_gpu_ids(var, self.env[var].replace(" ", ","))
                break
        return JobInfo(
            scheduler=self.name,
            job_id=job_id,
            nodes=tuple(nodes),
            tasks_per_node=tuple(counts),
            rank=rank,
            local_rank=local_rank,
            node_index=node_index,
            tasks_source=f"{self.hostfile_var}={path!r}",
            tasks_launched=mpi_rank(self.env) is not None,
            node_gpus=tuple(gpus for _ in nodes),
        )
