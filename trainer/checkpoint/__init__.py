"""Checkpoints: one folder per save for every strategy, verified before it is loaded (docs/design.md section 8).

* :mod:`~trainer.checkpoint.checkpointer`: the ``Checkpointer`` the Trainer owns: what a save holds, ``save``
  and ``load`` (resolving ``last`` / ``best``).
* :mod:`~trainer.checkpoint.files`: keys, errors, plain files written atomically and loaded with
  ``weights_only=True``, the ``last`` pointer.
* :mod:`~trainer.checkpoint.stateful`: the objects a save holds (model, optimizers, schedulers, RNG, callbacks).
* :mod:`~trainer.checkpoint.store`: writing and committing a save (DCP data files from every rank, then
  ``keel.pt`` and the manifest from rank 0, then the rename), synchronous or in the background.
* :mod:`~trainer.checkpoint.reader`: resolving ``last`` / ``best``, verifying a save and loading it.
* :mod:`~trainer.checkpoint.hf`: Hugging Face safetensors in and out (``open_weights``, ``write_safetensors``,
  ``export_weights``), tensor by tensor.
* :mod:`~trainer.checkpoint.async_save`: the background writer.
* :mod:`~trainer.checkpoint.dcp_io`: keel's pieces of DCP (safe reader and planners, hashing writer, CPU staging of
  async saves), imported on the first save or load.
* :mod:`~trainer.checkpoint.model_checkpoint`: the ``ModelCheckpoint`` callback: when to save, what to keep.

May import: torch (``torch.distributed.checkpoint`` included), :mod:`trainer.distributed`, :mod:`trainer.data`,
:mod:`trainer.callback`, :mod:`trainer.storage`, :mod:`trainer.options`, :mod:`trainer.state`; safetensors (the
``hf`` extra), when a safetensors file is read. The Trainer is never imported or read: it hands its objects to the
``Checkpointer``.
"""
