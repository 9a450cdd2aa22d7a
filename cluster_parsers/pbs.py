"""PBS Pro / OpenPBS / Torque: PBS_NODEFILE lists one line per slot."""

from __future__ import annotations

from ._slots import group_slots, local_host_index, read_host_file
from .base import ClusterParser, JobInfo, check_host_names, split_gpu_ids
from .tasks import launched_tasks


class PbsParser(ClusterParser):
    """Nodes and slots from PBS_NODEFILE; tasks from an MPI launcher (see ``tasks.py``)."""

    name = "pbs"
    detect_vars = ("PBS_JOBID",)
    agent_launch_hint = "start one agent per node: pbsdsh -u python -m keras_distrib.pbs ... (or mpiexec --map-by ppr:1:node)"

    job_id_vars = ("PBS_JOBID",)
    requeue_command = ("qrerun",)
    end_command = ("qdel",)
    nodefile_var = "PBS_NODEFILE"
    # PBS_VNODENUM is the 0-based slot of a pbsdsh task; PBS_TASKNUM is 1-based.
    slot_rank_var = "PBS_VNODENUM"
    task_num_var = "PBS_TASKNUM"
    node_num_var = "PBS_NODENUM"
    gpu_vars = ("CUDA_VISIBLE_DEVICES",)

    def parse(self) -> JobInfo:
        _, job_id = self.require(*self.job_id_vars, hint="submit with qsub, or set PBS_JOBID.")
        _, path = self.require(
            self.nodefile_var, hint="PBS sets PBS_NODEFILE inside a job; submit with qsub -l select=..."
        )
        slot_hosts = read_host_file(
            self.nodefile_var, path, hint="run inside the PBS job that owns this node file."
        )
        check_host_names(f"{self.nodefile_var}={path!r}", slot_hosts)
        nodes, slots = group_slots(slot_hosts)
        # Torque sets PBS_VNODENUM/PBS_TASKNUM in the job script and under pbsdsh -u too:
        # they place this task on a slot but do not say how many tasks were started.
        tasks = launched_tasks(
            self.env,
            nodes,
            slots,
            f"{self.nodefile_var}={path!r}",
            self.agent_launch_hint,
            slot_hosts=slot_hosts,
            this_node=self._this_node(nodes),
            slot_rank=self._slot_rank(),
        )
        gpus = split_gpu_ids(self.gpu_vars[0], self.env.get(self.gpu_vars[0], ""))
        return self.job_info(job_id, nodes, slots, tasks, gpus)

    def _slot_rank(self) -> int | None:
        if self.env.get(self.slot_rank_var):
            return self.int_var(self.slot_rank_var, minimum=0)
        if self.env.get(self.task_num_var):
            return self.int_var(self.task_num_var, minimum=1) - 1
        return None

    def _this_node(self, nodes: list[str]) -> int | None:
        """PBS_NODENUM, else the host name (the job script runs on the first node)."""
        if self.env.get(self.node_num_var):
            index = self.int_var(self.node_num_var, minimum=0)
            self.check_index(self.node_num_var, index, len(nodes), self.nodefile_var)
            return index
        return local_host_index(nodes, self.env)
