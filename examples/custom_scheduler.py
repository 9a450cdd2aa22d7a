"""Adding a scheduler: subclass ClusterParser, then register it under the ``cluster_parsers`` entry point.

The fictional "Acme" scheduler starts one task per node and sets, for example:
    ACME_JOB_ID=42  ACME_NODES=gpu[01-04]  ACME_NODE_RANK=2  ACME_GPUS=0,1

Register the class in your package's pyproject.toml, then ``pip install`` the package:
    [project.entry-points.cluster_parsers]
    acme = "custom_scheduler:AcmeParser"
``python -m keras_distrib --plan`` now detects Acme jobs (or force it: KERAS_DISTRIB_SCHEDULER=acme).
"""

from cluster_parsers import ClusterParser, JobInfo
from cluster_parsers import expand_hosts, node_of_rank, split_gpu_ids


class AcmeParser(ClusterParser):
    name = "acme"  # the registry name
    detect_vars = ("ACME_JOB_ID",)  # any of these set means "Acme launched us"
    agent_launch_hint = "start one task per node: acme-run --per-node python -m keras_distrib ..."

    # The scheduler's variable names, kept as data.
    job_id_var, nodes_var, rank_var, gpus_var = "ACME_JOB_ID", "ACME_NODES", "ACME_NODE_RANK", "ACME_GPUS"

    def parse(self) -> JobInfo:
        _, job_id = self.require(self.job_id_var, hint="run inside an Acme job: acme-run ...")
        _, nodelist = self.require(self.nodes_var, hint="run inside an Acme job: acme-run ...")
        nodes = expand_hosts(self.nodes_var, nodelist)  # Slurm-style hostlist, order kept
        tasks = (1,) * len(nodes)
        rank = self.int_var(self.rank_var, default=0)
        node_index, local_rank = node_of_rank(rank, tasks)  # errors if rank is past the last node
        gpus = split_gpu_ids(self.gpus_var, self.env.get(self.gpus_var, ""))  # ids kept verbatim
        return JobInfo(
            scheduler=self.name, job_id=job_id, nodes=tuple(nodes), tasks_per_node=tasks,
            rank=rank, local_rank=local_rank, node_index=node_index,
            node_gpus=tuple(gpus for _ in nodes),  # every Acme node has the same GPUs
        )
