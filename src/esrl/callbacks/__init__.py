"""Callbacks shared by ES and GRPO."""

from esrl.callbacks.evaluation import Evaluation
from esrl.callbacks.failure import FailureCheckpoint
from esrl.callbacks.interruption import Interruption
from esrl.callbacks.progress import StepProgressBar

__all__ = ["Evaluation", "FailureCheckpoint", "Interruption", "StepProgressBar"]
