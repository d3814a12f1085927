"""Checkpoints: what a save holds, how it is written and committed, how a run is restored.

* :mod:`~trainer.checkpoint.files`: the file layer: top-level keys, errors, atomic one-file writes, safe loading
  (``weights_only=True``), the ``last`` pointer.
* :mod:`~trainer.checkpoint.state`: what a save holds (model, optimizers, loop state, RNG, callbacks) and
  restoring it, including at another world size.
* :mod:`~trainer.checkpoint.sharded`: one folder per save under FSDP, every rank writing its shards (DCP).
* :mod:`~trainer.checkpoint.async_save`: stage at a step boundary, write and commit in the background.
* :mod:`~trainer.checkpoint.model_checkpoint`: the ``ModelCheckpoint`` callback: when to save, what to keep.

May import: torch (``torch.distributed.checkpoint`` included), :mod:`trainer.distributed`, :mod:`trainer.data`,
:mod:`trainer.callback`. The Trainer is passed in as an argument and only named under ``TYPE_CHECKING``.
"""
