"""Weight averaging: ``WeightAveraging`` (any average, after every optimizer step by default),
``EMAWeightAveraging`` (an exponential moving average) and ``StochasticWeightAveraging`` (SWA: an equal average of
the weights at the start of the last epochs, under a constant or annealed learning rate).

Lightning 2.6.6's callbacks of the same names and arguments, with the same arithmetic (``WeightAveraging`` updates
as ``torch.optim.swa_utils.AveragedModel.update_parameters`` does). The average is kept as copies of this rank's
weights: under DDP every rank holds the same average, under FSDP each rank averages its own shard of every
parameter, so nothing is gathered and the average of 2 ranks is the one process's. It is saved with the run and
restored with it: ``WeightAveraging`` saves the averaged weights as the checkpoint's weights (``state_dict``, what
``load_from_checkpoint`` and ``validate(ckpt_path=...)`` read) and the training weights as ``current_model_state``,
as Lightning does; ``StochasticWeightAveraging`` saves its average as ``averaged_model_state``. Both are written by
DCP beside the model, each rank its shard. Where keel differs from Lightning is in docs/porting.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, get_ema_avg_fn, get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from trainer.callback import Callback
from trainer.checkpoint.files import K_AVERAGED_MODEL, K_CURRENT_MODEL, K_OPTIMIZERS, K_STATE_DICT
from trainer.data.transfer import move_to_device
from trainer.distributed import comm
from trainer.step.optim import SchedulerConfig

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

_AVG_FN = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_MULTI_AVG_FN = Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor], None]
# What AveragedModel takes besides model, device and use_buffers.
_AVERAGED_MODEL_KWARGS = ("avg_fn", "multi_avg_fn")
_CPU = torch.device("cpu")  # StochasticWeightAveraging's default device (Lightning's)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor (FSDP), else the tensor; detached."""
    tensor = tensor.detach()
    return cast(torch.Tensor, tensor.to_local()) if hasattr(tensor, "to_local") else tensor


class _Average:
    """Copies of the task's parameters (and buffers) in ``named_parameters()`` / ``named_buffers()`` order: this
    rank's shard of each DTensor, on ``device`` (None: where each weight is). ``n_averaged`` counts the updates.
    The task's tensors are read again at each use: loading a checkpoint may give a sharded parameter new storage."""

    def __init__(self, task: nn.Module, device: torch.device | int | str | None, *, buffers: bool) -> None:
        self.buffers = buffers
        named = self._named(task)
        self.num_params = sum(1 for _ in task.parameters())
        self.names = [name for name, _ in named]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.tensors = [_local(t).to(device if device is not None else t.device, copy=True) for _, t in named]
        first = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.n_averaged = torch.tensor(0, dtype=torch.long, device=device if device is not None else first)

    def _named(self, task: nn.Module) -> list[tuple[str, torch.Tensor]]:
        named: list[tuple[str, torch.Tensor]] = list(task.named_parameters())
        return named + list(task.named_buffers()) if self.buffers else named

    def live(self, task: nn.Module) -> list[torch.Tensor]:
        """The task's tensors (this rank's shards) that the copies are of, in their order: writing to them writes
        the task's weights."""
        live = [_local(t) for _, t in self._named(task)]
        if len(live) != len(self.tensors):
            raise RuntimeError(
                f"The task has {len(live)} parameters and buffers, the weight average {len(self.tensors)}: the "
                "task's layers changed after fit started. Build every layer in __init__ or configure_model."
            )
        return live

    def update(
        self, task: nn.Module, avg_fn: _AVG_FN | None, multi_avg_fn: _MULTI_AVG_FN | None, *, use_buffers: bool
    ) -> None:
        """``AveragedModel.update_parameters``: the first update copies; later ones average with ``multi_avg_fn``
        (per device and dtype), else ``avg_fn`` (per tensor), else the equal (SWA) average; buffers are averaged
        with ``use_buffers``, else copied."""
        live = self.live(task)
        end = len(self.tensors) if use_buffers else self.num_params
        mine = self.tensors[:end]
        current = [t.to(a.device) for a, t in zip(mine, live[:end])]
        if bool(self.n_averaged == 0):
            for averaged, value in zip(mine, current):
                averaged.copy_(value)
        elif multi_avg_fn is not None or avg_fn is None:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for averaged, value in zip(mine, current):
                group = groups.setdefault((averaged.device, averaged.dtype), ([], []))
                group[0].append(averaged)
                group[1].append(value)
            for (device, _), (averaged_list, current_list) in groups.items():
                n = self.n_averaged.to(device)
                if multi_avg_fn is not None:
                    multi_avg_fn(averaged_list, current_list, n)
                elif device.type in _get_foreach_kernels_supported_devices():  # as AveragedModel: not the CPU
                    get_swa_multi_avg_fn()(averaged_list, current_list, n)
                else:
                    swa = get_swa_avg_fn()
                    for averaged, value in zip(averaged_list, current_list):
                        averaged.copy_(swa(averaged, value, n))
        else:
            for averaged, value in zip(mine, current):
                averaged.copy_(avg_fn(averaged, value, self.n_averaged.to(averaged.device)))
        if not use_buffers:
            for averaged, value in zip(self.tensors[self.num_params :], live[self.num_params :]):
                averaged.copy_(value)
        self.n_averaged += 1

    def copy_to(self, task: nn.Module, *, parameters_only: bool = False) -> None:
        end = self.num_params if parameters_only else len(self.tensors)
        for averaged, live in zip(self.tensors[:end], self.live(task)[:end]):
            live.copy_(averaged)

    def swap(self, task: nn.Module) -> None:
        """Exchange the averaged values and the task's."""
        for averaged, live in zip(self.tensors, self.live(task)):
            kept = averaged.clone()
            averaged.copy_(live)
            live.copy_(kept)

    def state_like(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The average keyed as ``model_state`` (the task's checkpoint weights), each entry in its form: a DTensor
        with the same mesh and placements where the model's is one. Entries it does not hold are left out."""
        out: dict[str, Any] = {}
        for key, value in model_state.items():
            i = self.index.get(key)
            if i is None or not isinstance(value, torch.Tensor):
                continue
            averaged = self.tensors[i]
            out[key] = comm.sharded_like(averaged, value) if comm.is_sharded(value) else averaged
        return out

    def load(self, task: nn.Module, state: dict[str, Any]) -> None:
        """Read the entries of ``state`` (keyed as the task's checkpoint weights) into the average: a DTensor's
        shard as it is, a whole tensor split into this rank's shard where the task's weight is sharded."""
        own = dict(self._named(task))
        for key, value in state.items():
            i = self.index.get(key)
            if i is None or not isinstance(value, torch.Tensor):
                continue
            mine = own[key]
            if comm.is_sharded(mine) and not comm.is_sharded(value):
                value = comm.shard_like(value, mine)
            self.tensors[i].copy_(_local(value))


class WeightAveraging(Callback):
    """Keeps an average of the weights and trains on: Lightning's ``WeightAveraging``.

    After each optimizer step for which :meth:`should_update` says so (every one, by default; it is asked once per
    epoch end too, with ``epoch_idx``), the average is updated as ``torch.optim.swa_utils.AveragedModel`` does, with
    ``avg_fn`` or ``multi_avg_fn`` (keyword arguments, as AveragedModel takes them; none: the equal average). During
    every validation run the averaged weights are swapped into the task (and back after it); when training ends
    they are copied into the task. A checkpoint holds the averaged weights as its ``state_dict`` (so
    ``load_from_checkpoint`` and ``validate(ckpt_path=...)`` get them) and the training weights as
    ``current_model_state``; resuming a fit restores both.

    Args:
        device: where the average is kept; None: beside each weight. ``"cpu"`` saves accelerator memory.
        use_buffers: average the buffers (BatchNorm statistics) too; False copies them at each update.
        kwargs: ``avg_fn`` (averaged, current, n_averaged) -> new average, or ``multi_avg_fn`` (lists, updated in
            place), as ``AveragedModel`` takes them.

    Raises:
        TypeError: a keyword ``AveragedModel`` does not take.
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_AVERAGED_MODEL_KWARGS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unknown keyword argument(s) {unknown}; besides device and use_buffers "
                f"it takes what torch.optim.swa_utils.AveragedModel takes: {list(_AVERAGED_MODEL_KWARGS)}."
            )
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average: _Average | None = None
        # The optimizer steps taken when the average was last updated (0: should_update is first asked after the
        # first step), and the epoch after which it last was (-1: none yet).
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update the average after the optimizer step ``step_idx`` (0-based) or at the end of epoch
        ``epoch_idx`` (one of them is given). Default: after every optimizer step. Override to choose."""
        return step_idx is not None

    # ------------------------------------------------------------------ building the average
    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        if stage == "fit":
            self._average = None  # built over the task as the strategy makes it (sharded), before it is restored

    def _built(self, task: TaskModule) -> _Average:
        """The fit's average: at first use (a checkpoint's restore, else fit start) a copy of the current weights."""
        if self._average is None:
            self._average = _Average(task, self._device, buffers=True)
        return self._average

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._built(task)

    def _update(self, task: TaskModule) -> None:
        kwargs = self._kwargs
        self._built(task).update(task, kwargs.get("avg_fn"), kwargs.get("multi_avg_fn"), use_buffers=self._use_buffers)

    # ------------------------------------------------------------------ training
    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps (1 after the first): step_idx is 0-based, like epoch_idx.
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._update(task)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._update(task)
            self._latest_update_epoch = trainer.current_epoch

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._built(task).copy_to(task)

    # ------------------------------------------------------------------ validation on the averaged weights
    def on_validation_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        if self._average is not None:
            self._average.swap(task)

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if self._average is not None:
            self._average.swap(task)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._latest_update_step = state["latest_update_step"]
        self._latest_update_epoch = state.get("latest_update_epoch", -1)  # Lightning's state has no epoch

    def on_save_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        """The averaged weights become the checkpoint's ``state_dict``; the training weights move to
        ``current_model_state``, ``n_averaged`` to ``averaging_state`` (Lightning's layout). A weights-only save
        keeps the training weights, as Lightning's (which calls no callback's hook for one)."""
        if K_OPTIMIZERS not in checkpoint:
            return
        if self._average is None:
            if trainer.is_global_zero:
                log.info(
                    "WeightAveraging: saving a checkpoint outside fit; the callback's average is not saved (after "
                    "fit the task already holds the averaged weights)."
                )
            return
        current = checkpoint[K_STATE_DICT]
        checkpoint[K_CURRENT_MODEL] = current
        checkpoint[K_STATE_DICT] = {**current, **self._average.state_like(current)}
        checkpoint["averaging_state"] = {"n_averaged": self._average.n_averaged.detach().cpu().clone()}

    def on_load_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        """Restore the average from the checkpoint's ``state_dict`` and hand the task the training weights
        (``current_model_state``); a checkpoint saved without the callback starts both from its weights."""
        if self._average is None and trainer.state_stage != "fit":
            if trainer.is_global_zero:
                log.warning(
                    "WeightAveraging: loading a checkpoint outside fit; the average is not restored (the task gets "
                    "the checkpoint's weights, the averaged ones when the callback saved them). Remove the callback "
                    "to silence this."
                )
            return
        average = self._built(task)
        if K_CURRENT_MODEL in checkpoint and "averaging_state" in checkpoint:
            average.load(task, checkpoint[K_STATE_DICT])
            average.n_averaged.fill_(int(checkpoint["averaging_state"]["n_averaged"]))
            checkpoint[K_STATE_DICT] = checkpoint[K_CURRENT_MODEL]  # what the task loads once the hooks have run
        else:
            if trainer.is_global_zero:
                log.warning(
                    "WeightAveraging: the checkpoint was not saved with WeightAveraging; the average starts from its "
                    "weights."
                )
            average.load(task, checkpoint[K_STATE_DICT])


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights (Lightning's ``EMAWeightAveraging``): after optimizer step
    ``step_idx`` when ``step_idx % update_every_n_steps == 0`` and ``step_idx >= update_starting_at_step`` (if
    given), and at the end of each epoch from ``update_starting_at_epoch`` on (if given), the average becomes
    ``decay * average + (1 - decay) * weights`` (the first update copies the weights)."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay))
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return (
            epoch_idx is not None
            and self.update_starting_at_epoch is not None
            and epoch_idx >= self.update_starting_at_epoch
        )


class StochasticWeightAveraging(Callback):
    """Stochastic Weight Averaging (Izmailov et al., 2018): Lightning's ``StochasticWeightAveraging``.

    From epoch ``swa_epoch_start`` (1-based; a float is that fraction of ``max_epochs``) the learning rate is
    annealed to ``swa_lrs`` over ``annealing_epochs`` epochs (``torch.optim.swa_utils.SWALR``, which replaces the
    task's scheduler) and, at the start of each epoch from then to the last, the weights are added to an equal
    average (``avg_fn`` for another). When ``max_epochs`` epochs are done the averaged parameters are copied into
    the task and, if it has BatchNorm layers, their statistics are recomputed with one pass of ``training_step``
    over the training data (no backward, no optimizer step). The average is kept on ``device`` (None: beside the
    weights). One optimizer and at most one scheduler.

    Raises:
        ValueError: an invalid argument, or (at fit start) several optimizers or schedulers, or a fractional
            ``swa_epoch_start`` without ``max_epochs``.
    """

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: Literal["cos", "linear"] = "cos",
        avg_fn: _AVG_FN | None = None,
        device: torch.device | str | None = _CPU,
    ) -> None:
        if (isinstance(swa_epoch_start, int) and swa_epoch_start < 1) or (
            isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1
        ):
            raise ValueError(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start!r}): expected an integer >= 1 (the "
                "epoch, 1-based) or a float between 0 and 1 (that fraction of max_epochs)."
            )
        bad_list = isinstance(swa_lrs, list) and not all(isinstance(lr, float) and lr > 0 for lr in swa_lrs)
        if not isinstance(swa_lrs, (float, list)) or (isinstance(swa_lrs, float) and swa_lrs <= 0) or bad_list:
            raise ValueError(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}): expected a positive float, or a list of positive "
                "floats (one per parameter group)."
            )
        if avg_fn is not None and not callable(avg_fn):
            raise ValueError(f"StochasticWeightAveraging(avg_fn={avg_fn!r}): expected a callable.")
        if device is not None and not isinstance(device, (torch.device, str)):
            raise ValueError(f"StochasticWeightAveraging(device={device!r}): expected a torch.device, a str or None.")
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}): expected 'cos' or 'linear'."
            )
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._average: _Average | None = None
        self._initialized = False
        self._swa_scheduler: Any = None
        self._scheduler_state: dict[str, Any] | None = None
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self._max_epochs = -1
        self.n_averaged: torch.Tensor | None = None
        self.momenta: dict[nn.modules.batchnorm._BatchNorm, float | None] = {}

    @property
    def swa_start(self) -> int:
        """The first epoch (0-based) whose start is averaged."""
        assert isinstance(self._swa_epoch_start, int)
        return max(self._swa_epoch_start - 1, 0)

    @property
    def swa_end(self) -> int | float:
        """The last epoch (0-based) whose start is averaged: the last epoch (inf without ``max_epochs``)."""
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def pl_module_contains_batch_norm(task: nn.Module) -> bool:
        return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in task.modules())

    @staticmethod
    def avg_fn(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
        """The equal average (Lightning's default)."""
        return averaged + (current - averaged) / (num_averaged + 1)

    # ------------------------------------------------------------------ fit
    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"StochasticWeightAveraging works with one optimizer; configure_optimizers returned "
                f"{len(trainer.optimizers)}."
            )
        if len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(
                f"StochasticWeightAveraging replaces one learning-rate scheduler; configure_optimizers returned "
                f"{len(trainer.lr_scheduler_configs)}."
            )
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        if isinstance(self._swa_epoch_start, float):
            if max_epochs == -1:
                raise ValueError(
                    "StochasticWeightAveraging(swa_epoch_start=<float>) is a fraction of max_epochs, and this fit has "
                    "no max_epochs: give swa_epoch_start as an integer epoch, or set max_epochs."
                )
            self._swa_epoch_start = int(max_epochs * self._swa_epoch_start)
        self._max_epochs = max_epochs
        self._built(task)
        if self._scheduler_state is not None:
            # Resumed after SWA began: its own scheduler is rebuilt (and its state restored) at the next epoch
            # start; the task's, restored from the checkpoint, is dropped.
            trainer.lr_scheduler_configs.clear()

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        if stage == "fit":
            self._average = None  # built over the task as the strategy makes it (sharded), before it is restored

    def _built(self, task: TaskModule) -> _Average:
        """The fit's average of the parameters: at first use (a restore, else fit start) a copy of the current ones."""
        if self._average is None:
            device = torch.device(self._device) if isinstance(self._device, str) else self._device
            self._average = _Average(task, device, buffers=False)
        return self._average

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        epoch = trainer.current_epoch
        if not self._initialized and self.swa_start <= epoch <= self.swa_end:
            self._initialized = True
            self._start_swa(trainer)
        if self.swa_start <= epoch <= self.swa_end and epoch > self._latest_update_epoch:
            assert self.n_averaged is not None
            self.update_parameters(self._built(task), task, self.n_averaged, self._avg_fn)
            self._latest_update_epoch = epoch

    def _start_swa(self, trainer: Trainer) -> None:
        """SWALR in place of the task's scheduler (epoch interval), and the count of averaged epochs."""
        optimizer = trainer.optimizers[0]
        if isinstance(self._swa_lrs, float):
            self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(self._swa_lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(
            optimizer,
            swa_lr=self._swa_lrs,  # type: ignore[arg-type]  # SWALR takes one float or one per group
            anneal_epochs=self._annealing_epochs,
            anneal_strategy=self._annealing_strategy,
            last_epoch=self._max_epochs if self._annealing_strategy == "cos" else -1,
        )
        if self._scheduler_state is not None:
            self._swa_scheduler.load_state_dict(self._scheduler_state)
        elif trainer.current_epoch != self.swa_start and trainer.is_global_zero:
            log.warning(
                "StochasticWeightAveraging starts after swa_start (epoch %d) without its state from a checkpoint: "
                "the average begins here.",
                self.swa_start,
            )
        config = SchedulerConfig(self._swa_scheduler)  # every epoch
        if trainer.lr_scheduler_configs:
            replaced = trainer.lr_scheduler_configs[0]
            if (replaced.interval != "epoch" or replaced.frequency != 1) and trainer.is_global_zero:
                log.warning("StochasticWeightAveraging steps its scheduler every epoch; the task's was %s.", replaced)
            if trainer.is_global_zero:
                log.info("Swapping scheduler `%s` for `SWALR`.", type(replaced.scheduler).__name__)
            trainer.lr_scheduler_configs[0] = config
        else:
            trainer.lr_scheduler_configs.append(config)
        if self.n_averaged is None:
            assert self._average is not None
            device = self._average.n_averaged.device
            self.n_averaged = torch.tensor(self._init_n_averaged, dtype=torch.long, device=device)

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After the last epoch (``max_epochs`` done): the averaged parameters into the task, then the BatchNorm
        statistics recomputed. Training that stopped earlier (max_steps, should_stop) keeps its weights, as in
        Lightning; without max_epochs the average is copied in whenever training ends."""
        finished = self._max_epochs != -1 and trainer.current_epoch - 1 == self.swa_end
        if not (finished or self._max_epochs == -1) or self._average is None or not self._count():
            return
        self.transfer_weights(self._average, task)
        if finished and self.pl_module_contains_batch_norm(task):
            self._update_batch_norm(trainer, task)

    # ------------------------------------------------------------------ the BatchNorm pass
    def _update_batch_norm(self, trainer: Trainer, task: TaskModule) -> None:
        """One pass of ``training_step`` over this rank's training data, in training mode without gradients,
        with every BatchNorm layer's statistics reset and averaged over the batches (momentum None). Under
        ``sync_batchnorm`` (SyncBatchNorm) each batch's statistics are those of the global batch, so every rank
        ends with the one process's; plain BatchNorm layers under DDP end with rank 0's, as DDP keeps them."""
        loader = trainer.train_dataloader
        if loader is None:
            return
        self.reset_batch_norm_and_save_state(task)
        sampler = getattr(loader, "sampler", None)
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", sampler)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(trainer.current_epoch)  # the epoch Lightning's extra BatchNorm epoch would be
        limit = trainer.num_training_batches
        dtype = torch.float64 if trainer.precision == "64" else None
        was_training = task.training
        task.train()
        try:
            with torch.no_grad(), _autocast(trainer):
                for batch_idx, batch in enumerate(cast("Iterator[Any]", loader)):
                    if limit is not None and batch_idx >= limit:
                        break
                    batch = move_to_device(batch, trainer.device, float_dtype=dtype)
                    task.training_step(batch, batch_idx)
        finally:
            task.train(was_training)
            self.reset_momenta()
        if trainer.world_size > 1:
            _broadcast_plain_batch_norm(task)

    def reset_batch_norm_and_save_state(self, task: nn.Module) -> None:
        """Zero every BatchNorm layer's statistics and make it average over batches (``momentum=None``)."""
        self.momenta = {}
        for module in task.modules():
            if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
                continue
            assert module.running_var is not None and module.num_batches_tracked is not None
            module.running_mean.zero_()
            module.running_var.fill_(1)
            module.num_batches_tracked.zero_()
            self.momenta[module] = module.momentum
            module.momentum = None

    def reset_momenta(self) -> None:
        for module, momentum in self.momenta.items():
            module.momentum = momentum

    # ------------------------------------------------------------------ the average
    @staticmethod
    def update_parameters(average: _Average, task: nn.Module, n_averaged: torch.Tensor, avg_fn: _AVG_FN) -> None:
        """Add the task's parameters (this rank's shards) to the average: the first copies them."""
        for averaged, live in zip(average.tensors, average.live(task)):
            current = live.to(averaged.device)
            averaged.copy_(current if n_averaged == 0 else avg_fn(averaged, current, n_averaged.to(averaged.device)))
        n_averaged += 1

    @staticmethod
    def transfer_weights(average: _Average, task: nn.Module) -> None:
        average.copy_to(task, parameters_only=True)

    def _count(self) -> int:
        """Epochs averaged so far (restored from a checkpoint until SWA starts again at an epoch start)."""
        return self._init_n_averaged if self.n_averaged is None else int(self.n_averaged.item())

    def state_dict(self) -> dict[str, Any]:
        scheduler = self._swa_scheduler
        return {
            "n_averaged": self._count(),
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": self._scheduler_state if scheduler is None else scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._init_n_averaged = state["n_averaged"]
        self._latest_update_epoch = state["latest_update_epoch"]
        self._scheduler_state = state["scheduler_state"]
        self.n_averaged = None  # rebuilt from _init_n_averaged when SWA starts again

    def on_save_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        """The average, keyed and sharded as the task's weights, as ``averaged_model_state`` (Lightning keeps it
        in the callback's state, which keel writes from rank 0 only)."""
        if K_OPTIMIZERS in checkpoint and self._average is not None and self._count():
            checkpoint[K_AVERAGED_MODEL] = self._average.state_like(checkpoint[K_STATE_DICT])

    def on_load_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        if K_AVERAGED_MODEL in checkpoint and trainer.state_stage == "fit":
            self._built(task).load(task, checkpoint[K_AVERAGED_MODEL])


@contextmanager
def _autocast(trainer: Trainer) -> Iterator[None]:
    """The forward's autocast under a mixed precision, as the training loop runs it."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(trainer.precision)
    if dtype is None:
        yield
        return
    with torch.autocast(trainer.device.type, dtype=dtype):
        yield


def _broadcast_plain_batch_norm(task: nn.Module) -> None:
    """Rank 0's statistics into every plain (not Sync) BatchNorm layer: what DDP's forward keeps on every rank."""
    from trainer.distributed import comm

    for module in task.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked):
                if buffer is not None:
                    comm.broadcast(buffer, src=0)
