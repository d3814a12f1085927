"""Data: samplers, loader adaptation, batch transfer and the global batch.

* :mod:`~trainer.data.loaders`: the resumable distributed sampler (a global cursor of consumed samples), the
  padding-free evaluation sampler, adapting a user's ``DataLoader`` or saying exactly why it cannot be adapted.
* :mod:`~trainer.data.streams`: training loaders that carry their own position (torchdata, Hugging Face streaming
  datasets, LitData, any stateful loader): sharded once per rank, their position saved per rank and resumed exactly.
* :mod:`~trainer.data.transfer`: moving batches to the device, reading their size without a host sync, and reading
  many small tensors back to the host in one transfer.
* :mod:`~trainer.data.global_batch`: the global batch as a property of the run, re-derived into accumulation at
  every (re)start.

May import: torch, :mod:`trainer.distributed.comm`, :mod:`trainer.step.accumulation`, :mod:`trainer.options`.
The core's ``trainer.py`` only as a type (under ``TYPE_CHECKING``), never at run time.
"""
