"""Will it fit? The memory planner: what one rank holds at the peak of a step, estimated on fake tensors.

* :mod:`~trainer.memory.fake`: a training step's memory measured under torch's fake tensors, in a fake process
  group of any world size (nothing is allocated, on any device);
* :mod:`~trainer.memory.estimate`: the task built on the meta device with a strategy applied, two steps measured,
  the bytes by category (:class:`MemoryEstimate`);
* :mod:`~trainer.memory.plan`: the public face, :func:`estimate_memory` and :func:`plan_memory` (DDP, FSDP,
  recompute, tensor parallelism, HSDP and offload at several world sizes, the cheapest that fits), and
  ``python -m trainer.memory`` (``__main__``);
* :mod:`~trainer.memory.callback`: :class:`MemoryPlan`, the plan of a run logged at its first batch
  (``Trainer(memory_plan=True)``).

The public face builds a Trainer to host the task's hooks (``self.trainer.max_steps``, ``self.log``), so this package
sits above the loop: ``trainer.py`` imports only :mod:`~trainer.memory.callback`, when ``memory_plan`` is on.

May import: torch (``torch.distributed`` for the fake process group), :mod:`trainer.distributed`,
:mod:`trainer.step`, :mod:`trainer.callback`, :mod:`trainer.doctor` (sizes on the command line) and, in
:mod:`~trainer.memory.plan` only, :mod:`trainer.trainer`.
"""

from trainer.memory.callback import MemoryPlan
from trainer.memory.estimate import MemoryEstimate, format_size
from trainer.memory.plan import estimate_memory, format_plan, plan_memory

__all__ = ["MemoryEstimate", "MemoryPlan", "estimate_memory", "format_plan", "format_size", "plan_memory"]
