"""The validation curve: the validation split's loss and accuracy on the weights of every
`eval_every`-th step (and the last), computed as the final validation is
(engine.runner.final_metrics): `evaluate` in evaluation mode with the job's kernels. The
reference trainer (phalanx.train_local) and the cluster's step commit call the same two
functions on the same weights, so their curves are equal bit for bit (DESIGN.md invariant 1).

A point belongs to the step whose update made the weights: the weights after `n` applied steps
are step `n - 1`'s point, stored on that step's row of the job's curve (`step_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kernels import kernels_for
from engine.runner import JobModel
from engine.spec import TrainSpec
from engine.step import TrainState, evaluate


@dataclass(frozen=True)
class ValidationPoint:
    step: int  # the step whose update made the weights (its row of the curve)
    val_loss: float
    val_accuracy: float


def validation_due(spec: TrainSpec, steps_done: int) -> bool:
    """Whether the weights after `steps_done` applied steps get a point: every `eval_every`
    steps, and the last step's (never with `eval_every` 0: the final metrics have those)."""
    every = spec.eval_every
    return every > 0 and steps_done > 0 and (steps_done % every == 0
                                             or steps_done == spec.total_steps)


def validate(job: JobModel, state: TrainState, x_val: np.ndarray, y_val: np.ndarray
             ) -> ValidationPoint | None:
    """The point of `state`'s weights (`state.step` steps applied); None without a validation
    split."""
    if not len(y_val):
        return None
    ev = evaluate(job.model, state.params, state.buffers, x_val, y_val,
                  kernels=kernels_for(job.spec.exactness))
    return ValidationPoint(state.step - 1, ev.loss, ev.accuracy)
