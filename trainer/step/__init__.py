"""The maths of one optimizer step.

* :mod:`~trainer.step.accumulation`: how micro-batches group into optimizer steps, and the one function that
  normalises the loss (mean over the micro-batches run, or a sum over ``num_items`` across ranks).
* :mod:`~trainer.step.precision`: autocast, gradient scaling and parameter dtype for ``32``, ``64``,
  ``bf16-mixed`` and ``16-mixed``.
* :mod:`~trainer.step.optim`: what ``configure_optimizers`` may return, scheduler stepping, manual optimization.
* :mod:`~trainer.step.nonfinite`: the NaN/inf loss guard that reads the host only on logging steps.

May import: torch, :mod:`trainer.distributed` (collectives and the strategy seam), :mod:`trainer.data.transfer`.
The core's ``trainer.py`` only as a type (under ``TYPE_CHECKING``), never at run time.
"""
