"""A worker RPC broken in transit counts as that worker's failure in TensorFlow's coordinator
(`trainers/_private_apis.count_broken_worker_rpcs_as_worker_failures`): the closure runs again
after the worker is checked, where before the error failed every closure and ended the chief's
fit (CI: a healthy worker's result fetch, as a worker on another node was killed)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

#: The chief's error as CI printed it (tests/slurm/test_resilience_slurm.py, a killed worker).
SEEN = ("2 root error(s) found.\n"
        "  (0) INTERNAL: {{function_node __wrapped__Identity_device_/job:chief/replica:0/task:0/device:CPU:0}} "
        "Unable to parse request\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0/device:CPU:0 while "
        "calling /tensorflow.eager.EagerService/RunComponentFunction:\n"
        ":UNKNOWN:Error received from peer  {grpc_status:13, grpc_message:\"Unable to parse request\"}\n"
        "  (1) CANCELLED: {{function_node __wrapped__Identity_device_/job:chief/replica:0/task:0/device:CPU:0}} "
        "RecvFromRemoteAsync is cancelled.\n0 successful operations.\n0 derived errors ignored. [Op:Identity] name: ")


def test_a_broken_worker_rpc_is_a_worker_failure_and_nothing_else_changes() -> None:
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    from keras_distrib.trainers import _private_apis as private

    broken = tf.errors.InternalError(None, None, SEEN)
    upstream = cluster_coordinator._is_worker_failure
    try:
        assert not upstream(broken)  # what ended the job
        private.count_broken_worker_rpcs_as_worker_failures()
        patched = cluster_coordinator._is_worker_failure
        assert patched(broken)
        private.count_broken_worker_rpcs_as_worker_failures()
        assert cluster_coordinator._is_worker_failure is patched  # not wrapped twice
        # A model's own error, on a worker or the chief, still fails the job.
        assert not patched(tf.errors.InternalError(None, None, "/job:worker/replica:0/task:0 a bug in the model"))
        assert not patched(tf.errors.InternalError(None, None, "Unable to parse request on /job:ps/replica:0/task:0"))
        assert not patched(ValueError("Unable to parse request /job:worker"))
        # Upstream's own decisions stand.
        unavailable = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1: Socket closed")
        assert patched(unavailable) == upstream(unavailable)
    finally:
        cluster_coordinator._is_worker_failure = upstream
