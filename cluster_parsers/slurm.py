"""SLURM: job-step variables first, job variables inside an sbatch/salloc shell."""

from __future__ import annotations

from .base import (
    ClusterConfigError,
    ClusterParser,
    JobInfo,
    Tasks,
    expand_hosts,
    expand_tasks_per_node,
    split_gpu_ids,
)
from .tasks import launched_tasks, launcher_counts


class SlurmParser(ClusterParser):
    """Reads ``srun`` step variables, or the allocation's when no step is running."""

    name = "slurm"
    detect_vars = ("SLURM_JOB_ID", "SLURM_JOBID")
    srun_agents = "srun --ntasks-per-node=1 python -m keras_distrib.slurm ..."
    agent_launch_hint = f"start one agent per node: {srun_agents}"
    join_command = "srun --jobid=$SLURM_JOB_ID -N1 -w NODE --overlap python -m keras_distrib.slurm --join ..."

    job_id_vars = ("SLURM_JOB_ID", "SLURM_JOBID")
    step_id_var = "SLURM_STEP_ID"
    requeue_command = ("scontrol", "requeue")
    # scancel JOB.STEP ends only the step: a batch script's later commands still run.
    end_command = ("scancel",)
    # (nodelist, tasks per node, task count): step first, because srun inside an
    # allocation may use fewer nodes than the job (tensorflow#36094).
    step_vars = ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS")
    job_vars = ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS")
    legacy_nodelist_var = "SLURM_NODELIST"
    # A heterogeneous job sets one copy per component, e.g. SLURM_JOB_NODELIST_HET_GROUP_0
    # (PACK_GROUP before Slurm 20.02), and SLURM_HET_SIZE (heterogeneous_jobs.html).
    het_markers = ("_HET_GROUP_", "_PACK_GROUP_")
    het_size_vars = ("SLURM_HET_SIZE", "SLURM_PACK_SIZE")
    rank_var = "SLURM_PROCID"
    local_rank_var = "SLURM_LOCALID"
    node_id_var = "SLURM_NODEID"
    node_name_var = "SLURMD_NODENAME"
    # The ids the process can open come first: under ConstrainDevices=yes Slurm renumbers
    # them from 0 in CUDA_VISIBLE_DEVICES, while SLURM_STEP_GPUS/SLURM_JOB_GPUS keep the
    # node's global ids ("not relative to any device cgroup", sbatch(1)).
    gpu_vars = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
    gpu_count_var = "SLURM_GPUS_ON_NODE"
    # srun --resv-ports (MpiParams=ports= in slurm.conf): the same ports on every node of the step.
    reserved_ports_var = "SLURM_STEP_RESV_PORTS"

    het_srun_agents = "srun --het-group=0,1 --ntasks-per-node=1 python -m keras_distrib.slurm ..."

    def parse(self) -> JobInfo:
        _, job_id = self.require(
            *self.job_id_vars,
            hint=f"run inside a Slurm allocation: {self.srun_agents}, or from an sbatch/salloc shell.",
        )
        components = self._components()
        if components is not None:
            return self._heterogeneous_job(job_id, *components)
        in_step = bool(self.env.get(self.step_vars[0]))
        nodes_var, tasks_var, ntasks_var = self.step_vars if in_step else self.job_vars
        if not self.env.get(nodes_var) and self.env.get(self.legacy_nodelist_var):
            nodes_var = self.legacy_nodelist_var
        if not self.env.get(nodes_var):
            self._refuse_heterogeneous_job(nodes_var)
        _, nodelist = self.require(
            nodes_var, hint=f"run inside a Slurm job: from an sbatch/salloc shell, or {self.srun_agents}"
        )
        nodes = expand_hosts(nodes_var, nodelist)
        raw_tasks = self.env.get(tasks_var)
        if raw_tasks:
            slots = expand_tasks_per_node(tasks_var, raw_tasks, len(nodes), nodes_var)
            source = f"{tasks_var}={raw_tasks!r}"
        else:
            slots = [1] * len(nodes)
            source = f"{nodes_var}={nodelist!r} ({tasks_var} unset: 1 task per node)"
        if self.env.get(ntasks_var):
            total = self.int_var(ntasks_var, minimum=1)
            if total != sum(slots):
                raise ClusterConfigError(
                    f"{ntasks_var}={total} but {source} adds up to {sum(slots)}.",
                    f"{ntasks_var} and {tasks_var} must describe the same step; unset stale copies.",
                )
        tasks = self._tasks(nodes, slots, source, nodes_var, in_step)
        gpus = self._gpus()
        return self.job_info(job_id, nodes, slots, tasks, gpus)

    def join_info(self) -> JobInfo:
        """A step started later on one node of the job (``srun --jobid=J -N1 -w n3 --overlap``):
        the job's node list, one agent per node as the elastic template starts them, this
        task the agent of its node (SLURMD_NODENAME)."""
        _, job_id = self.require(*self.job_id_vars, hint=f"start it inside the job: {self.join_command}")
        self.require(self.job_vars[0], self.legacy_nodelist_var, hint=f"start it inside the job: {self.join_command}")
        _, name = self.require(self.node_name_var, hint=f"start it on the node: {self.join_command}")
        # srun --jobid from outside the job sets SLURM_JOB_NODELIST to the new step's node and
        # SLURM_NODELIST to the job's (Slurm 22.05, tests/unit/fixtures/slurm_join_step.json):
        # the longer list that holds this node is the job's.
        lists = [(var, self.env[var], expand_hosts(var, self.env[var]))
                 for var in (self.job_vars[0], self.legacy_nodelist_var) if self.env.get(var)]
        nodes_var, nodelist, nodes = max(lists, key=lambda entry: (name in entry[2], len(entry[2])))
        if name not in nodes:
            raise ClusterConfigError(f"{self.node_name_var}={name!r} is not in {nodes_var}={nodelist!r}.",
                                     f"start it on one of the job's nodes: {self.join_command}")
        index = nodes.index(name)
        slots = [1] * len(nodes)
        tasks = Tasks(tuple(slots), index, 0, index, True, f"{nodes_var}={nodelist!r} (--join: one agent per node)")
        return self.job_info(job_id, nodes, slots, tasks, self._gpus())

    def _tasks(self, nodes: list[str], slots: list[int], source: str, nodes_var: str, in_step: bool) -> Tasks:
        """srun's own placement in a step; otherwise the shared rule (mpirun in an sbatch shell).

        An MPI launcher inside a step wins when it started a different number of tasks:
        Open MPI's mpirun starts its daemons with srun, one per node, so the step
        variables describe the daemons, not the ranks.
        """
        launcher = launcher_counts(self.env)
        if in_step and (launcher is None or launcher.size in (None, sum(slots))):
            rank = self.int_var(self.rank_var, default=0, minimum=0)
            if rank >= sum(slots):
                raise ClusterConfigError(
                    f"{self.rank_var}={rank} is outside the {sum(slots)} task(s) of {source}.",
                    f"the step variables come from another step; start it inside the job: {self.srun_agents}",
                )
            local_rank = self.int_var(self.local_rank_var, default=0, minimum=0)
            node_index = self._node_index(nodes, nodes_var)
            if local_rank >= slots[node_index]:
                raise ClusterConfigError(
                    f"{self.local_rank_var}={local_rank} is outside the {slots[node_index]} task(s) "
                    f"of node {nodes[node_index]} in {source}.",
                    f"the step variables come from another step; start it inside the job: {self.srun_agents}",
                )
            return Tasks(tuple(slots), rank, local_rank, node_index, True, source)
        if launcher is None:
            # An sbatch/salloc shell: the job variables count allocated slots; no task
            # launcher has started anything yet. The shell runs on the first node.
            node_index = self._node_index(nodes, nodes_var)
            return Tasks(tuple(slots), sum(slots[:node_index]), 0, node_index, False, source)
        return launched_tasks(self.env, nodes, slots, source, self.agent_launch_hint)

    def _components(self) -> tuple[list[str], list[int], str] | None:
        """A heterogeneous job's nodes in component order, each node's component, and their
        source (None: a plain job). The batch shell's SLURM_JOB_NODELIST holds only the first
        component, and a step's the union in Slurm's own order (measured with Slurm 22.05):
        each component's own list says which node is which."""
        size_var = next((v for v in self.het_size_vars if self.env.get(v)), None)
        size = 1 if size_var is None else self.int_var(size_var, minimum=1)
        if size_var is None or size == 1:
            return None
        nodes: list[str] = []
        components: list[int] = []
        for component in range(size):
            var, value = self.require(*(f"{self.job_vars[0]}{marker}{component}" for marker in self.het_markers),
                                      hint=f"{size_var}={size}: run inside the heterogeneous job's own shell or step.")
            for node in expand_hosts(var, value):
                if node in nodes:
                    raise ClusterConfigError(
                        f"{var}={value!r} holds {node}, which component {components[nodes.index(node)]} holds too.",
                        "give each component its own nodes (a partition each, or -w / --exclude per component).",
                    )
                nodes.append(node)
                components.append(component)
        return nodes, components, f"{self.job_vars[0]}_HET_GROUP_0..{size - 1}"

    def _heterogeneous_job(self, job_id: str, nodes: list[str], components: list[int], source: str) -> JobInfo:
        """The whole heterogeneous job: its nodes in component order, this task placed by name."""
        nodes_var, tasks_var, _ = self.step_vars
        if self.env.get(nodes_var):
            step_nodes = expand_hosts(nodes_var, self.env[nodes_var])
            if set(step_nodes) != set(nodes):
                raise ClusterConfigError(
                    f"{nodes_var}={self.env[nodes_var]!r} runs on {len(step_nodes)} of the {len(nodes)} nodes of "
                    f"this heterogeneous job ({source}).",
                    f"start one agent on every node of every component: {self.het_srun_agents}",
                )
            raw = self.env.get(tasks_var)
            counts = expand_tasks_per_node(tasks_var, raw, len(step_nodes), nodes_var) if raw else [1] * len(step_nodes)
            per_node = dict(zip(step_nodes, counts))
            slots = [per_node[n] for n in nodes]
            launched, where = True, f"{tasks_var}={raw!r}"
        else:  # the batch (or salloc) shell: nothing launched yet
            slots, launched, where = [1] * len(nodes), False, f"{source} (the job's shell: no task launched)"
        if launched and not self.env.get(self.node_name_var):  # SLURM_NODEID counts in the step's order, not ours
            raise ClusterConfigError(f"{self.node_name_var} is not set in a step of a heterogeneous job ({source}).",
                                     f"start the agents as Slurm's own launcher does: {self.het_srun_agents}")
        node_index = self._node_index(nodes, source) if self.env.get(self.node_name_var) else 0
        local_rank = self.int_var(self.local_rank_var, default=0, minimum=0) if launched else 0
        if local_rank >= slots[node_index]:
            raise ClusterConfigError(f"{self.local_rank_var}={local_rank} is outside the {slots[node_index]} task(s) "
                                     f"of node {nodes[node_index]} in {where}.",
                                     f"start it inside the job: {self.het_srun_agents}")
        gpus = self._gpus()  # this node's: each component's agents know their own component's GPUs only
        mine = components[node_index]
        ports, ports_source = self.reserved_ports()
        return JobInfo(
            scheduler=self.name, job_id=job_id, nodes=tuple(nodes), tasks_per_node=tuple(slots),
            rank=sum(slots[:node_index]) + local_rank, local_rank=local_rank, node_index=node_index,
            node_gpus=tuple(gpus if c == mine else () for c in components), tasks_source=where,
            tasks_launched=launched, node_components=tuple(components), components_source=source,
            reserved_ports=ports, reserved_ports_source=ports_source,
        )

    def _refuse_heterogeneous_job(self, nodes_var: str) -> None:
        """Say what is missing in a heterogeneous job's shell instead of 'not in a job'."""
        het = sorted(k for k in self.env if k.startswith("SLURM_") and any(m in k for m in self.het_markers))
        sizes = [f"{v}={self.env[v]}" for v in self.het_size_vars if self.env.get(v)]
        if het or sizes:
            shown = ", ".join(sizes + het[:4]) + (", ..." if len(het) > 4 else "")
            raise ClusterConfigError(
                f"{nodes_var} is not set, and this looks like part of a heterogeneous Slurm job ({shown}) "
                f"without its {' / '.join(self.het_size_vars)}.",
                f"run inside the job's own shell, or start the agents with {self.het_srun_agents}",
            )

    def _node_index(self, nodes: list[str], nodes_var: str) -> int:
        name = self.env.get(self.node_name_var)
        if name:
            if name in nodes:
                return nodes.index(name)
            raise ClusterConfigError(
                f"{self.node_name_var}={name!r} is not in {nodes_var} ({len(nodes)} nodes).",
                f"the node list comes from another job; start it inside the job: {self.srun_agents}",
            )
        index = self.int_var(self.node_id_var, default=0)
        self.check_index(self.node_id_var, index, len(nodes), nodes_var)
        return index

    def _gpus(self) -> tuple[str, ...]:
        for var in self.gpu_vars:
            if var in self.env:
                return split_gpu_ids(var, self.env[var])
        if self.env.get(self.gpu_count_var):
            count = self.int_var(self.gpu_count_var, minimum=0)
            if count > 1024:
                raise ClusterConfigError(f"{self.gpu_count_var}={count} is not a GPU count.", "unset it.")
            return tuple(str(i) for i in range(count))
        return ()
