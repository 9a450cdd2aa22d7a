"""SLURM: job-step variables first, job variables inside an sbatch/salloc shell."""

from __future__ import annotations

from .base import (
    ClusterConfigError,
    ClusterParser,
    JobInfo,
    expand_hosts,
    expand_tasks_per_node,
    split_gpu_ids,
)


class SlurmParser(ClusterParser):
    """Reads ``srun`` step variables, or the allocation's when no step is running."""

    name = "slurm"
    detect_vars = ("SLURM_JOB_ID", "SLURM_JOBID")
    agent_launch_hint = "start one agent per node: srun --ntasks-per-node=1 python -m keras_distrib.slurm ..."

    job_id_vars = ("SLURM_JOB_ID", "SLURM_JOBID")
    # (nodelist, tasks per node, task count): step first, because srun inside an
    # allocation may use fewer nodes than the job (tensorflow#36094).
    step_vars = ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS")
    job_vars = ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS")
    legacy_nodelist_var = "SLURM_NODELIST"
    rank_var = "SLURM_PROCID"
    local_rank_var = "SLURM_LOCALID"
    node_id_var = "SLURM_NODEID"
    node_name_var = "SLURMD_NODENAME"
    # Most specific first; ids are kept exactly as Slurm gives them.
    gpu_vars = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")
    gpu_count_var = "SLURM_GPUS_ON_NODE"

    def parse(self) -> JobInfo:
        _, job_id = self.require(
            *self.job_id_vars,
            hint="run inside a Slurm allocation: srun --ntasks-per-node=1 python -m "
            "keras_distrib.slurm ..., or from an sbatch/salloc shell.",
        )
        nodes_var, tasks_var, ntasks_var = (
            self.step_vars if self.env.get(self.step_vars[0]) else self.job_vars
        )
        if not self.env.get(nodes_var) and self.env.get(self.legacy_nodelist_var):
            nodes_var = self.legacy_nodelist_var
        _, nodelist = self.require(
            nodes_var, hint="run inside a Slurm job or step (srun/sbatch/salloc)."
        )
        nodes = expand_hosts(nodes_var, nodelist)
        raw_tasks = self.env.get(tasks_var)
        if raw_tasks:
            tasks = expand_tasks_per_node(tasks_var, raw_tasks, len(nodes), nodes_var)
        else:
            tasks = [1] * len(nodes)
        if self.env.get(ntasks_var):
            total = self.int_var(ntasks_var)
            if total != sum(tasks):
                raise ClusterConfigError(
                    f"{ntasks_var}={total} but {tasks_var}={raw_tasks!r} adds up to {sum(tasks)}.",
                    f"{ntasks_var} and {tasks_var} must describe the same step; unset stale copies.",
                )
        rank = self.int_var(self.rank_var, default=0)
        local_rank = self.int_var(self.local_rank_var, default=0)
        node_index = self._node_index(nodes, nodes_var)
        gpus = self._gpus()
        return JobInfo(
            scheduler=self.name,
            job_id=job_id,
            nodes=tuple(nodes),
            tasks_per_node=tuple(tasks),
            rank=rank,
            local_rank=local_rank,
            node_index=node_index,
            tasks_source=f"{tasks_var}={raw_tasks!r}" if raw_tasks else "",
            # Outside a step (an sbatch/salloc shell) the job variables count allocated
            # slots; no srun has started tasks yet.
            tasks_launched=nodes_var == self.step_vars[0],
            node_gpus=tuple(gpus for _ in nodes),
        )

    def _node_index(self, nodes: list[str], nodes_var: str) -> int:
        name = self.env.get(self.node_name_var)
        if name:
            if name in nodes:
                return nodes.index(name)
            raise ClusterConfigError(
                f"{self.node_name_var}={name!r} is not in {nodes_var} ({len(nodes)} nodes).",
                "the node list comes from another job; start this command with srun inside the job.",
            )
        index = self.int_var(self.node_id_var, default=0)
        if not 0 <= index < len(nodes):
            raise ClusterConfigError(
                f"{self.node_id_var}={index} is outside {nodes_var} ({len(nodes)} nodes).",
                "the node list comes from another job; start this command with srun inside the job.",
            )
        return index

    def _gpus(self) -> tuple[str, ...]:
        for var in self.gpu_vars:
            if var in self.env:
                return split_gpu_ids(var, self.env[var])
        if self.env.get(self.gpu_count_var):
            return tuple(str(i) for i in range(self.int_var(self.gpu_count_var)))
        return ()
