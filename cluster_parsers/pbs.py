"""PBS Pro / OpenPBS / Torque: PBS_NODEFILE lists one line per slot."""

from __future__ import annotations

from ._slots import group_slots, local_host_index, place_rank, read_host_file
from .base import ClusterParser, JobInfo, mpi_rank, split_gpu_ids


class PbsParser(ClusterParser):
    """Nodes and slots from PBS_NODEFILE; rank from PBS_VNODENUM or an MPI launcher."""

    name = "pbs"
    detect_vars = ("PBS_JOBID",)
    agent_launch_hint = "start one agent per node: pbsdsh -u python -m keras_distrib.pbs ... (or mpiexec --map-by ppr:1:node)"

    job_id_var = "PBS_JOBID"
    nodefile_var = "PBS_NODEFILE"
    # PBS_VNODENUM is the 0-based slot of a pbsdsh task; PBS_TASKNUM is 1-based.
    slot_rank_var = "PBS_VNODENUM"
    task_num_var = "PBS_TASKNUM"
    node_num_var = "PBS_NODENUM"
    gpu_vars = ("CUDA_VISIBLE_DEVICES",)

    def parse(self) -> JobInfo:
        _, job_id = self.require(self.job_id_var, hint="submit with qsub, or set PBS_JOBID.")
        _, path = self.require(
            self.nodefile_var, hint="PBS sets PBS_NODEFILE inside a job; submit with qsub -l select=..."
        )
        slots = read_host_file(
            self.nodefile_var, path, hint="run inside the PBS job that owns this node file."
        )
        nodes, counts = group_slots(slots)
        rank, node_index, local_rank = self._place(slots, nodes)
        # Torque sets PBS_VNODENUM/PBS_TASKNUM in the job script and under pbsdsh -u too,
        # so only an MPI launcher tells us that one task per slot was started.
        launched = mpi_rank(self.env) is not None
        gpus = split_gpu_ids(self.gpu_vars[0], self.env.get(self.gpu_vars[0], ""))
        return JobInfo(
            scheduler=self.name,
            job_id=job_id,
            nodes=tuple(nodes),
            tasks_per_node=tuple(counts),
            rank=rank,
            local_rank=local_rank,
            node_index=node_index,
            tasks_source=f"{self.nodefile_var}={path!r}",
            tasks_launched=launched,
            node_gpus=tuple(gpus for _ in nodes),
        )

    def _place(self, slots: list[str], nodes: list[str]) -> tuple[int, int, int]:
        if self.env.get(self.slot_rank_var):
            rank = self.int_var(self.slot_rank_var)
        elif (mpi := mpi_rank(self.env)) is not None:
            rank = mpi[0]
        elif self.env.get(self.task_num_var):
            rank = self.int_var(self.task_num_var) - 1
        else:
            # The job script itself (no task launcher): it runs on the first node,
            # unless PBS_NODENUM or the host name says otherwise.
            index = (
                self.int_var(self.node_num_var)
                if self.env.get(self.node_num_var)
                else local_host_index(nodes, self.env) or 0
            )
            return slots.index(nodes[index]), index, 0
        node_index, local_rank = place_rank(rank, slots, nodes, self.nodefile_var)
        return rank, node_index, local_rank
