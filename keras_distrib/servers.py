"""`python -m keras_distrib.servers`: the TensorFlow server of one ps or worker task.

Reads TF_CONFIG and KERAS_DISTRIB_PROTOCOL, serves until killed. The agent ends it.
"""

from __future__ import annotations

import json
import os
import re
import signal

from cluster_parsers import ClusterConfigError

PROTOCOL_VAR = "KERAS_DISTRIB_PROTOCOL"


def supported_protocols_error(protocol: str) -> str | None:
    """None when this TensorFlow build can serve ``protocol``, else TF's reason."""
    import tensorflow as tf

    spec = tf.train.ClusterSpec({"probe": ["localhost:0"]})
    try:
        tf.distribute.Server(spec, job_name="probe", task_index=0, protocol=protocol, start=False)
    except Exception as exc:  # TF raises several types (NotFoundError, InvalidArgumentError)
        return str(exc).strip().splitlines()[0]
    return None


def require_protocol(protocol: str) -> None:
    """Fail before anything starts when the TensorFlow build lacks ``protocol``."""
    if protocol == "grpc":
        return
    reason = supported_protocols_error(protocol)
    if reason is None:
        return
    factories = re.search(r"available server factories are: \[([^\]]*)\]", reason)
    available = factories.group(1).strip() if factories else reason
    raise ClusterConfigError(
        f"--protocol {protocol!r} is not supported by this TensorFlow build (available server factories: {available}).",
        "stock TensorFlow only has grpc; for RDMA use --layout allreduce, whose NCCL collectives use "
        "InfiniBand/RoCE when present (tune with NCCL_IB_HCA, NCCL_SOCKET_IFNAME).",
    )


def main() -> None:
    # The agent forwards SIGUSR1 to every child so scripts can checkpoint on it; a server
    # must survive it (its default action would kill the process).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    config = json.loads(os.environ["TF_CONFIG"])
    job, index = config["task"]["type"], int(config["task"]["index"])
    protocol = os.environ.get(PROTOCOL_VAR, "grpc")

    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(config["cluster"]), job_name=job, task_index=index, protocol=protocol, start=True
    )
    gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
    address = config["cluster"][job][index]
    print(f"serving {job}:{index} at {address} over {protocol}; GPUs visible: {gpus or 'none'}", flush=True)
    server.join()


if __name__ == "__main__":
    main()
