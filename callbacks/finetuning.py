"""Lightning's finetuning callbacks: freeze modules before training, unfreeze them later into a new param group.

:class:`BaseFinetuning` calls :meth:`~BaseFinetuning.freeze_before_training` in ``setup`` (before
``configure_optimizers`` builds the optimizers, so that ``filter(lambda p: p.requires_grad, self.parameters())``
leaves the frozen parameters out) and :meth:`~BaseFinetuning.finetune_function` at the start of every training
epoch, where :meth:`~BaseFinetuning.unfreeze_and_add_param_group` makes modules trainable again and adds their
parameters to the optimizer as a new param group with its own learning rate. :class:`BackboneFinetuning` does
that for ``task.backbone`` on a learning-rate schedule. Both are Lightning's (``lightning.pytorch.callbacks``),
hook for hook, with three differences, each for exactness (docs/porting.md):

- Resume is exact. The callback's state (saved in every checkpoint) holds the param groups it added, which
  parameters were trainable and which BatchNorm layers tracked statistics; keel restores callback states before
  the optimizers' (trainer/checkpoint/reader.py), so the groups are rebuilt and the saved optimizer state (Adam's
  moments of the unfrozen parameters included) loads into them. A fit resumed after the unfreeze epoch trains the
  unfrozen modules exactly as the uninterrupted fit (Lightning 2.6.6 resumes with them frozen again), and a resume
  into the middle of an epoch does not run that epoch's ``finetune_function`` a second time.
- :meth:`~BaseFinetuning.filter_on_optimizer` compares parameters by identity; Lightning compares their values, so
  a parameter equal to one already in the optimizer (a fresh LayerNorm's ones and zeros) was left out of the new
  group and never trained.
- Under ``strategy="ddp"`` on several ranks, unfreezing during the fit raises: DDP synchronises only the parameters
  that were trainable when it wrapped the task, so the unfrozen ones would train apart on each rank.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm

from trainer.callback import Callback
from trainer.observability.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

Modules = Module | Iterable[Module | Iterable[Any]]
"""A module, or an iterable (possibly nested) of modules, as Lightning's helpers take them."""


def multiplicative(epoch: int) -> float:
    """:class:`BackboneFinetuning`'s default ``lambda_func``: the backbone's learning rate doubles every epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Base of finetuning callbacks (Lightning's ``BaseFinetuning``): override :meth:`freeze_before_training`
    and :meth:`finetune_function`.

    Example::

        class FeatureExtractorFreezeUnfreeze(BaseFinetuning):
            def __init__(self, unfreeze_at_epoch: int = 10) -> None:
                super().__init__()
                self._unfreeze_at_epoch = unfreeze_at_epoch

            def freeze_before_training(self, pl_module):
                self.freeze(pl_module.feature_extractor)

            def finetune_function(self, pl_module, current_epoch, optimizer):
                if current_epoch == self._unfreeze_at_epoch:
                    self.unfreeze_and_add_param_group(pl_module.feature_extractor, optimizer, train_bn=True)

    The task's ``configure_optimizers`` must leave the frozen parameters out, e.g.
    ``Adam(filter(lambda p: p.requires_grad, self.parameters()))``.
    """

    def __init__(self) -> None:
        # optimizer index -> its param groups, parameters by name ("params": [names]), as Lightning saves them
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False
        self._trainer: Trainer | None = None
        self._task: TaskModule | None = None
        self._finetuned_epoch: int | None = None  # the epoch whose finetune_function ran last
        self._trainable_at_setup: set[str] = set()
        self._saved_flags: dict[str, list[str]] | None = None  # trainable parameters, frozen BatchNorms (resume)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        # a copy: a save written in the background must not see the groups a later epoch adds
        state: dict[str, Any] = {"internal_optimizer_metadata": copy.deepcopy(self._internal_optimizer_metadata)}
        if self._task is not None:
            state["trainable"] = [n for n, p in self._task.named_parameters() if p.requires_grad]
            state["frozen_batchnorm"] = [
                n for n, m in self._task.named_modules() if isinstance(m, _BatchNorm) and not m.track_running_stats
            ]
        if self._finetuned_epoch is not None:
            state["finetuned_epoch"] = self._finetuned_epoch
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the saved param groups and, when the optimizers exist already (keel loads callback states right
        after building them, before their own state), rebuild the groups now."""
        self._restarting = True
        # a checkpoint written before Lightning's PR #11887 holds the metadata itself
        self._internal_optimizer_metadata = dict(state.get("internal_optimizer_metadata", state))
        self._finetuned_epoch = state.get("finetuned_epoch")
        if "trainable" in state:
            self._saved_flags = {"trainable": list(state["trainable"]), "frozen_batchnorm": []}
            self._saved_flags["frozen_batchnorm"] = list(state.get("frozen_batchnorm", []))
        if self._trainer is not None and self._task is not None and self._trainer.optimizers:
            self._restore(self._trainer, self._task)

    def _restore(self, trainer: Trainer, task: TaskModule) -> None:
        """The saved run's trainable flags and param groups, applied to this run's task and optimizers."""
        if self._saved_flags is not None:
            trainable = set(self._saved_flags["trainable"])
            for name, param in task.named_parameters():
                param.requires_grad = name in trainable
            frozen = set(self._saved_flags["frozen_batchnorm"])
            for name, module in task.named_modules():
                if isinstance(module, _BatchNorm):
                    module.track_running_stats = name not in frozen
        if self._internal_optimizer_metadata:
            named_parameters = dict(task.named_parameters())
            for opt_idx, optimizer in enumerate(trainer.optimizers):
                if opt_idx in self._internal_optimizer_metadata:
                    groups = self._internal_optimizer_metadata[opt_idx]
                    optimizer.param_groups = self._apply_mapping_to_param_groups(groups, named_parameters)
        self._restarting = False
        self._check_strategy(trainer, task)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._trainer, self._task = trainer, task
        if stage == "fit":  # a new fit starts clean; a resume loads the saved state after this (as in Lightning)
            self._internal_optimizer_metadata, self._finetuned_epoch, self._saved_flags = {}, None, None
            self._restarting = False
        self.freeze_before_training(task)
        self._trainable_at_setup = {n for n, p in task.named_parameters() if p.requires_grad}

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        if self._restarting:  # loaded before the optimizers existed: rebuild the groups now
            self._restore(trainer, task)

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        epoch = trainer.current_epoch
        if epoch == self._finetuned_epoch:
            return  # resumed inside this epoch: its finetune_function ran before the save
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(task, epoch, optimizer)
            self._store(task, opt_idx, num_param_groups, optimizer.param_groups)
        self._finetuned_epoch = epoch
        self._check_strategy(trainer, task)

    def _store(
        self, task: TaskModule, opt_idx: int, num_param_groups: int, current_param_groups: list[dict[str, Any]]
    ) -> None:
        mapping = {p: n for n, p in task.named_parameters()}
        if opt_idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[opt_idx] = self._apply_mapping_to_param_groups(
                current_param_groups, mapping
            )
        elif num_param_groups != len(current_param_groups):  # groups added since: the user's own, or unfrozen
            self._internal_optimizer_metadata[opt_idx].extend(
                self._apply_mapping_to_param_groups(current_param_groups[num_param_groups:], mapping)
            )

    def _check_strategy(self, trainer: Trainer, task: TaskModule) -> None:
        """Refuse what DDP would silently get wrong: parameters unfrozen after it wrapped the task."""
        if trainer.world_size <= 1 or getattr(trainer.strategy, "ddp", None) is None:
            return
        unfrozen = sorted(
            n for n, p in task.named_parameters() if p.requires_grad and n not in self._trainable_at_setup
        )
        if unfrozen:
            listed = ", ".join(unfrozen[:5]) + (", ..." if len(unfrozen) > 5 else "")
            raise RuntimeError(
                f"{type(self).__name__} unfroze {listed} under strategy='ddp' on {trainer.world_size} ranks: DDP "
                "synchronises only the parameters that were trainable when it wrapped the task, so these would "
                "train apart on each rank. Run the frozen phase and the finetuning phase as two fits (the second "
                "from the first's weights, with nothing frozen), or finetune on one device."
            )

    # ------------------------------------------------------------------ to override
    def finetune_function(self, pl_module: TaskModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Called at the start of every training epoch, per optimizer: unfreeze here
        (:meth:`unfreeze_and_add_param_group`)."""
        raise NotImplementedError

    def freeze_before_training(self, pl_module: TaskModule) -> None:
        """Called in ``setup``, before the optimizers are built: freeze here (:meth:`freeze`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Lightning's static helpers
    @staticmethod
    def _apply_mapping_to_param_groups(
        param_groups: list[dict[str, Any]], mapping: dict[Any, Any]
    ) -> list[dict[str, Any]]:
        output = []
        for group in param_groups:
            group_state = {k: v for k, v in group.items() if k != "params"}
            group_state["params"] = [mapping[p] for p in group["params"]]
            output.append(group_state)
        return output

    @staticmethod
    def flatten_modules(modules: Modules) -> list[Module]:
        """The leaf modules of ``modules`` (and the parents that hold parameters themselves), as a list."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        found: Iterable[Module]
        if isinstance(modules, Iterable):
            found = [leaf for m in modules for leaf in BaseFinetuning.flatten_modules(m)]
        else:
            found = modules.modules()
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(
        modules: Modules, train_bn: bool = True, requires_grad: bool = True
    ) -> Iterator[torch.nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm layers' only
        with ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):  # a parent's own: recursion would repeat its children's
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze every parameter of ``modules`` (BatchNorm layers track running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        """Freeze ``module``'s own parameters (a BatchNorm layer also stops tracking running statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[Any]) -> list[Any]:
        """``params`` without those already in one of ``optimizer``'s param groups (by identity), with a warning
        when some were."""
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out_params: list[Any] = []
        removed: list[Any] = []
        for param in params:
            (removed if id(param) in present else out_params).append(param)
        if removed:
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer."
                " Those parameters will be skipped.\n"
                "HINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
            )
        return out_params

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: torch.optim.Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new param group, at ``lr`` (None:
        the first group's learning rate divided by ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        kept = BaseFinetuning.filter_on_optimizer(optimizer, params)
        if kept:
            optimizer.add_param_group({"params": kept, "lr": params_lr / denom_lr})


class BackboneFinetuning(BaseFinetuning):
    """Finetune ``task.backbone`` (Lightning's ``BackboneFinetuning``): frozen until
    ``unfreeze_backbone_at_epoch``, then trained in its own param group, whose learning rate starts at
    ``backbone_initial_lr`` (None: the first group's rate times ``backbone_initial_ratio_lr``) and is multiplied
    by ``lambda_func(epoch + 1)`` at the start of each later epoch; with ``should_align`` it stays at the first
    group's rate once it would pass it.

    Args:
        unfreeze_backbone_at_epoch: The epoch at whose start the backbone is unfrozen.
        lambda_func: ``epoch -> factor`` for the backbone's learning rate (default: 2.0 every epoch).
        backbone_initial_ratio_lr: The backbone's first rate as a fraction of the first group's.
        backbone_initial_lr: The backbone's first rate itself (overrides the ratio).
        should_align: Cap the backbone's rate at the first group's.
        initial_denom_lr: Passed to :meth:`unfreeze_and_add_param_group` (unused there when a rate is given,
            which it always is here).
        train_bn: Whether the backbone's BatchNorm layers are trained once unfrozen.
        verbose: Log both learning rates at each change.
        rounding: Decimal places of the logged rates.
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_backbone_lr = state["previous_backbone_lr"]
        super().load_state_dict(state)

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        # Lightning checks this in on_fit_start, after setup's freeze_before_training has already failed on it.
        if not isinstance(getattr(task, "backbone", None), Module):
            raise ValueError(
                f"BackboneFinetuning needs the task to have an nn.Module attribute `backbone`; "
                f"{type(task).__name__} has none. Use BaseFinetuning for other module names."
            )
        super().setup(trainer, task, stage)

    def freeze_before_training(self, pl_module: TaskModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: TaskModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial_backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.previous_backbone_lr = initial_backbone_lr
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                initial_backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
            if self.verbose:
                log.info(
                    "Current lr: %s, Backbone lr: %s",
                    round(current_lr, self.rounding),
                    round(initial_backbone_lr, self.rounding),
                )
        elif epoch > self.unfreeze_backbone_at_epoch:
            if self.previous_backbone_lr is None:  # set at the unfreeze epoch, restored on resume
                raise RuntimeError(
                    f"BackboneFinetuning: epoch {epoch} is past unfreeze_backbone_at_epoch="
                    f"{self.unfreeze_backbone_at_epoch}, but the backbone was never unfrozen in this run (a resume "
                    "from a checkpoint without this callback's state?)."
                )
            current_lr = optimizer.param_groups[0]["lr"]
            next_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            next_lr = current_lr if (self.should_align and next_lr > current_lr) else next_lr
            optimizer.param_groups[-1]["lr"] = next_lr
            self.previous_backbone_lr = next_lr
            if self.verbose:
                log.info(
                    "Current lr: %s, Backbone lr: %s", round(current_lr, self.rounding), round(next_lr, self.rounding)
                )
