"""Asynchronous parameter servers for Keras 3 on JAX: the ps layouts under ``KERAS_BACKEND=jax``.

``store``: the variables on the ps tasks (TensorFlow's gRPC runtime, shared by name);
``handout``: the epoch's parts and the workers' reports (TensorFlow queues on the ps);
``steps``: a worker's compiled steps (the model's own JAX ``train_step``);
``trainer``: the chief's and the workers' loops.
"""

from .trainer import AsyncJaxTrainer

__all__ = ["AsyncJaxTrainer"]
