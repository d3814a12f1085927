"""Everything that talks to other processes: the only package besides :mod:`trainer.checkpoint` (and the memory
planner's fake process group, :mod:`trainer.memory.fake`, which talks to nobody) that imports ``torch.distributed``.

* :mod:`~trainer.distributed.launcher`: where this process sits in the job, read from the launcher's environment
  (torchrun / TorchElastic, SLURM ``srun``, one plain process); talks to nobody.
* :mod:`~trainer.distributed.comm`: process-group setup and teardown, device selection and the handful of
  collectives keel uses; each is a no-op in one process.
* :mod:`~trainer.distributed.strategy`: the seam between the loop and the wrapper: single device, DDP; FSDP2 in
  :mod:`~trainer.distributed.fsdp`; :mod:`~trainer.distributed.selection` turns the ``strategy`` option into one.
* :mod:`~trainer.distributed.preemption`: signals set a flag; the ranks agree at a step boundary.
* :mod:`~trainer.distributed.watchdog`: a rank that stops making progress dumps its stacks and exits.

May import: torch, :mod:`trainer.options` and :mod:`trainer.compat` (the strategy reads the options), nothing
else of keel at run time; the core's ``trainer.py`` only as a type (under ``TYPE_CHECKING``).
"""
