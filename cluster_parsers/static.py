"""A YAML host file for machines with no scheduler (and for tests).

Example::

    job_id: demo          # optional; seeds the port range
    gpus: [0, 1]          # optional default for every host
    hosts:
      - node-a            # uses the default gpus
      - {name: node-b, gpus: [2, 3]}
"""

from __future__ import annotations

from typing import Any

import yaml

from ._slots import local_host_index
from .base import ClusterConfigError, ClusterParser, JobInfo, mpi_rank, node_of_rank


class StaticParser(ClusterParser):
    """Hosts from the YAML file named by KERAS_DISTRIB_HOSTS_FILE."""

    name = "static"
    detect_vars = ("KERAS_DISTRIB_HOSTS_FILE",)
    agent_launch_hint = "start one agent per host (tasks_per_node: 1 in the hosts file)."

    hosts_file_var = "KERAS_DISTRIB_HOSTS_FILE"
    rank_var = "KERAS_DISTRIB_RANK"
    allowed_keys = ("job_id", "gpus", "hosts", "tasks_per_node")

    def parse(self) -> JobInfo:
        var, path = self.require(self.hosts_file_var, hint="set KERAS_DISTRIB_HOSTS_FILE=hosts.yaml.")
        data = self._load(var, path)
        default_gpus = self._gpu_list(data.get("gpus", []), var, path)
        nodes: list[str] = []
        node_gpus: list[tuple[str, ...]] = []
        for entry in data["hosts"]:
            if isinstance(entry, str):
                nodes.append(entry)
                node_gpus.append(default_gpus)
            elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
                nodes.append(entry["name"])
                node_gpus.append(self._gpu_list(entry.get("gpus", default_gpus), var, path))
            else:
                raise ClusterConfigError(
                    f"{var}={path!r}: host entry {entry!r} is neither a name nor {{name: ..., gpus: [...]}}.",
                    "list hosts as '- node1' or '- {name: node1, gpus: [0, 1]}'.",
                )
        per_node = int(data.get("tasks_per_node", 1))
        tasks = tuple(per_node for _ in nodes)
        if self.env.get(self.rank_var):
            rank = self.int_var(self.rank_var)
            node_index, local_rank = node_of_rank(rank, tasks)
        elif (mpi := mpi_rank(self.env)) is not None:
            rank = mpi[0]
            node_index, local_rank = node_of_rank(rank, tasks)
        else:
            node_index = local_host_index(nodes, self.env) or 0
            rank, local_rank = node_index * per_node, 0
        return JobInfo(
            scheduler=self.name,
            job_id=str(data.get("job_id", "static")),
            nodes=tuple(nodes),
            tasks_per_node=tasks,
            rank=rank,
            local_rank=local_rank,
            node_index=node_index,
            tasks_source=f"{var}={path!r} tasks_per_node={per_node}",
            node_gpus=tuple(node_gpus),
        )

    def _load(self, var: str, path: str) -> dict[str, Any]:
        try:
            with open(path) as fh:
                data = yaml.safe_load(fh)
        except OSError as exc:
            raise ClusterConfigError(f"{var}={path!r} cannot be read ({exc.strerror}).", "check the path.") from None
        except yaml.YAMLError as exc:
            raise ClusterConfigError(f"{var}={path!r} is not valid YAML ({exc}).", "fix the file's syntax.") from None
        if not isinstance(data, dict) or not data.get("hosts"):
            raise ClusterConfigError(f"{var}={path!r} has no 'hosts' list.", "add 'hosts: [node1, node2]'.")
        unknown = sorted(set(data) - set(self.allowed_keys))
        if unknown:
            raise ClusterConfigError(
                f"{var}={path!r} has unknown key(s) {', '.join(unknown)}.",
                f"valid keys are {', '.join(self.allowed_keys)}.",
            )
        return data

    @staticmethod
    def _gpu_list(value: Any, var: str, path: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise ClusterConfigError(f"{var}={path!r}: gpus {value!r} is not a list.", "write gpus: [0, 1].")
        return tuple(str(g) for g in value)
