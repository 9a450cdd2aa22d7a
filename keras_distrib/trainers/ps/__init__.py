"""Asynchronous parameter-server training (`ParameterServerTrainer`): the trainer, its
closure compiler, the hand-out of an epoch's examples and the batch readers."""

from .trainer import ParameterServerTrainer

__all__ = ["ParameterServerTrainer"]
