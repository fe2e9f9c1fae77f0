"""When a run first validates, and the warning for a `trainer.max_steps` that ends training before it.

Lightning validates every `val_check_interval` training batches (an epoch's worth by default), and a
run stopped by `max_steps` in between is not validated at its end: nothing is scored, no best
checkpoint is kept, and the test scores the last weights. Lightning users expect that rule, so it stays;
the run says so when it starts, with the setting that validates at its last step.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["max_steps_before_validation"]


def max_steps_before_validation(trainer: Any) -> str | None:
    """The warning for a fresh run whose `max_steps` ends training before its first validation, or
    None. Read at `on_train_start`, once Lightning knows the batches of an epoch (`num_training_batches`)
    and between validations (`val_check_batch`)."""
    max_steps = trainer.max_steps
    if max_steps is None or max_steps < 0 or trainer.global_step > 0 or trainer.limit_val_batches == 0:
        return None
    per_epoch, every = trainer.num_training_batches, trainer.val_check_batch
    if every is None or not math.isfinite(every) or not math.isfinite(per_epoch):
        return None  # time-based validation, or an epoch of unknown length: no batch to name
    epochs = trainer.check_val_every_n_epoch
    first = every if epochs is None else (epochs - 1) * per_epoch + every  # the batch that validates first
    batches = max_steps * trainer.accumulate_grad_batches
    if batches >= first:
        return None
    fix = (
        f"to validate at the last step, add trainer.val_check_interval={batches}"
        if batches <= per_epoch
        else "to validate at each epoch's end, add trainer.check_val_every_n_epoch=1 "
        "trainer.val_check_interval=1.0"
    )
    return (
        f"trainer.max_steps={max_steps} ends training after {batches} batch{'es' if batches > 1 else ''}, "
        f"before the first validation (at batch {first}; an epoch has {per_epoch}): nothing will be "
        f"validated or kept as the best checkpoint, and a test after it scores the last weights; {fix}"
    )
