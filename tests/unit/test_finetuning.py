"""BaseFinetuning / BackboneFinetuning (callbacks/finetuning.py): Lightning's behaviour, and exact resume.

The expected numbers come from Lightning 2.6.6 running the same program (tiny model below, Adam, gradient clipping,
``BackboneFinetuning(unfreeze_backbone_at_epoch=1)``) on CPU; keel's run matches them. Lightning is not installed
for these tests: the numbers are written here.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import quiet
from torch.utils.data import DataLoader, TensorDataset

import callbacks.lightning as L
from callbacks.finetuning import BackboneFinetuning, BaseFinetuning

EPOCHS = 6
# Lightning 2.6.6: the optimizer's param-group learning rates at the end of each epoch (head, then backbone:
# unfrozen at epoch 1 at 0.1 x the head's rate, doubled each epoch, aligned with the head's once past it).
LIGHTNING_LRS = [[0.01], [0.01, 0.001], [0.01, 0.002], [0.01, 0.004], [0.01, 0.008], [0.01, 0.01]]
# Lightning 2.6.6: the sum of each parameter (backbone.0.weight, .bias, backbone.2.weight, .bias, head.weight,
# .bias) at the end of each epoch. The backbone's stay at their initial values through epoch 0.
LIGHTNING_SUMS = [
    [-0.77883172, -0.76848269, 0.60294682, -0.78350794, 0.2782625, 0.10078075],
    [-0.80716538, -0.76278275, 0.60209048, -0.79113704, 0.39312193, 0.06616078],
    [-0.8851862, -0.74858296, 0.5911603, -0.80523783, 0.48980027, 0.03617337],
    [-1.08514547, -0.70755953, 0.55053115, -0.82844377, 0.56790483, 0.01102874],
    [-1.51474726, -0.61238909, 0.43225348, -0.86132729, 0.62780833, -0.0099286],
    [-2.00865269, -0.48615828, 0.24799383, -0.89201069, 0.67303634, -0.02947572],
]
INITIAL_SUMS = [-0.77883172, -0.76848269, 0.60294682, -0.78350794, 0.11319421, 0.13874434]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, (x.sum(1, keepdim=True) * 0.5).tanh()), batch_size=8)


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


class Record(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []
        self.sums: list[list[float]] = []
        self.backbone_trainable: list[bool] = []
        self.group_sizes: list[list[int]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        groups = trainer.optimizers[0].param_groups
        self.lrs.append([g["lr"] for g in groups])
        self.group_sizes.append([len(g["params"]) for g in groups])
        self.sums.append([p.detach().sum().item() for p in pl_module.parameters()])
        self.backbone_trainable.append(all(p.requires_grad for p in pl_module.backbone.parameters()))


def fit(
    max_epochs: int | None = EPOCHS, ckpt_path: str | None = None, save_dir: Path | None = None, **options
) -> tuple[Net, Record]:
    record = Record()
    cbs: list = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), record]
    opts = quiet(max_epochs=max_epochs, gradient_clip_val=0.05, callbacks=cbs, **options)
    if save_dir is not None:
        cbs.append(L.ModelCheckpoint(dirpath=save_dir, save_last=True, save_top_k=0))
        opts["enable_checkpointing"] = True
    task = Net()
    L.Trainer(**opts).fit(task, data(), ckpt_path=ckpt_path)
    return task, record


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[Net, Record]:
    return fit()


def test_frozen_parameters_do_not_change_before_the_unfreeze_epoch(uninterrupted: tuple[Net, Record]) -> None:
    _, record = uninterrupted
    assert record.sums[0][:4] == pytest.approx(INITIAL_SUMS[:4], abs=1e-7)  # the backbone, after epoch 0
    assert record.sums[0][4:] != pytest.approx(INITIAL_SUMS[4:], abs=1e-3)  # the head trained
    assert record.backbone_trainable == [False] + [True] * (EPOCHS - 1)
    assert record.group_sizes == [[2]] + [[2, 4]] * (EPOCHS - 1)  # the head's group, then the backbone's


def test_the_backbone_group_gets_lightning_s_learning_rates_and_weights(uninterrupted: tuple[Net, Record]) -> None:
    """Clipping covers the added group too (Lightning clips every parameter of the optimizer): without that,
    the sums part from Lightning's at epoch 1."""
    _, record = uninterrupted
    assert len(record.lrs) == len(record.sums) == EPOCHS
    for epoch in range(EPOCHS):
        assert record.lrs[epoch] == pytest.approx(LIGHTNING_LRS[epoch]), epoch
        assert record.sums[epoch] == pytest.approx(LIGHTNING_SUMS[epoch], abs=1e-6), epoch


def test_resume_after_the_unfreeze_epoch_is_bit_identical(tmp_path: Path, uninterrupted: tuple[Net, Record]) -> None:
    """Lightning 2.6.6 resumes this run with the backbone frozen again (requires_grad False: its sums stay at the
    epoch-1 values); keel restores the trainable flags, the param groups and their Adam state."""
    whole, record = uninterrupted
    fit(max_epochs=2, save_dir=tmp_path)
    resumed, again = fit(ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_weights(resumed, whole)
    assert again.lrs == record.lrs[2:] and again.backbone_trainable == [True] * (EPOCHS - 2)


def test_resume_from_before_the_unfreeze_epoch_is_bit_identical(
    tmp_path: Path, uninterrupted: tuple[Net, Record]
) -> None:
    whole, record = uninterrupted
    fit(max_epochs=1, save_dir=tmp_path)
    resumed, again = fit(ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_weights(resumed, whole)
    assert again.lrs == record.lrs[1:]


def test_resume_inside_an_epoch_runs_its_finetune_function_once(
    tmp_path: Path, uninterrupted: tuple[Net, Record]
) -> None:
    """Saved at step 10 (epoch 2, batch 2 of 4): the resumed epoch 2 keeps the backbone rate set at its start."""
    whole, record = uninterrupted
    fit(max_epochs=None, max_steps=10, save_dir=tmp_path)
    resumed, again = fit(ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_weights(resumed, whole)
    assert again.lrs == record.lrs[2:]


def test_the_state_keeps_lightning_s_keys() -> None:
    callback = BackboneFinetuning()
    state = callback.state_dict()
    assert state == {"internal_optimizer_metadata": {}, "previous_backbone_lr": None}
    # a Lightning checkpoint's state (no keel keys) loads; its groups are applied when the fit starts
    callback.load_state_dict({**state, "internal_optimizer_metadata": {0: [{"lr": 0.1, "params": ["head.weight"]}]}})
    task = Net()
    optimizer = torch.optim.SGD([task.head.bias], lr=0.5)
    callback.on_fit_start(SimpleNamespace(optimizers=[optimizer], world_size=1), task)
    assert optimizer.param_groups == [{"lr": 0.1, "params": [task.head.weight]}]


def test_backbone_finetuning_needs_a_backbone() -> None:
    class NoBackbone(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(2, 1)

    with pytest.raises(ValueError, match="nn.Module attribute `backbone`"):
        BackboneFinetuning().setup(SimpleNamespace(), NoBackbone(), "fit")


def test_a_custom_base_finetuning_subclass() -> None:
    """Lightning's documented example: freeze in freeze_before_training, unfreeze in finetune_function."""

    class FreezeUnfreeze(BaseFinetuning):
        def __init__(self, unfreeze_at_epoch: int = 1) -> None:
            super().__init__()
            self._unfreeze_at_epoch = unfreeze_at_epoch

        def freeze_before_training(self, pl_module) -> None:
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
            if current_epoch == self._unfreeze_at_epoch:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=True)

    record = Record()
    L.Trainer(**quiet(max_epochs=3, callbacks=[FreezeUnfreeze(), record])).fit(Net(), data())
    assert record.lrs == [[0.01], [0.01, 0.001], [0.01, 0.001]]  # no lr: the first group's / initial_denom_lr
    with pytest.raises(NotImplementedError):
        BaseFinetuning().freeze_before_training(Net())


def test_static_helpers_match_lightning() -> None:
    """Each expectation is what Lightning 2.6.6's helpers do with the same modules."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 2), nn.LayerNorm(2)))
    flat = BaseFinetuning.flatten_modules(net)
    assert [type(m).__name__ for m in flat] == ["Linear", "BatchNorm1d", "Linear", "LayerNorm"]
    assert [type(m).__name__ for m in BaseFinetuning.flatten_modules([net[0], [net[2]]])] == [
        "Linear",
        "Linear",
        "LayerNorm",
    ]
    BaseFinetuning.freeze(net, train_bn=False)
    assert [p.requires_grad for p in net.parameters()] == [False] * 8 and not net[1].track_running_stats
    BaseFinetuning.make_trainable(net)
    BaseFinetuning.freeze(net, train_bn=True)
    assert [p.requires_grad for p in net.parameters()] == [False, False, True, True, False, False, False, False]
    assert net[1].track_running_stats
    BaseFinetuning.make_trainable(net)
    assert len(list(BaseFinetuning.filter_params(net, train_bn=False))) == 6
    assert list(BaseFinetuning.filter_params(net, requires_grad=False)) == []


def test_filter_on_optimizer_compares_parameters_by_identity() -> None:
    """Lightning 2.6.6 compares values: a fresh LayerNorm equals another one, so it kept 0 of these 2 parameters,
    and unfreezing Linear + LayerNorm added a group of 2 (not 4) parameters. keel keeps them."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 2), nn.LayerNorm(2))
    head = nn.LayerNorm(2)  # same values as body[1]: ones and zeros
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    assert len(BaseFinetuning.filter_on_optimizer(optimizer, list(body[1].parameters()))) == 2
    BaseFinetuning.freeze(body)
    BaseFinetuning.unfreeze_and_add_param_group(body, optimizer)
    assert [(len(g["params"]), g["lr"]) for g in optimizer.param_groups] == [(2, 0.1), (4, pytest.approx(0.01))]
    with pytest.warns(UserWarning, match="already exist within another group"):
        assert BaseFinetuning.filter_on_optimizer(optimizer, list(head.parameters())) == []
    other = torch.optim.SGD(head.parameters(), lr=0.1)
    BaseFinetuning.unfreeze_and_add_param_group(body[0], other, lr=0.5)  # an lr is taken as it is
    assert [(len(g["params"]), g["lr"]) for g in other.param_groups] == [(2, 0.1), (2, 0.5)]


def test_unfreezing_under_multi_rank_ddp_raises() -> None:
    """DDP synchronises only what was trainable when it wrapped the task: keel refuses instead of letting the
    unfrozen backbone train apart on each rank."""
    task, callback = Net(), BackboneFinetuning(unfreeze_backbone_at_epoch=0)
    ddp = SimpleNamespace(world_size=2, strategy=SimpleNamespace(ddp=object()), optimizers=[], current_epoch=0)
    callback.setup(ddp, task, "fit")  # freezes the backbone; then the optimizers are built
    optimizer = torch.optim.Adam([p for p in task.parameters() if p.requires_grad], lr=0.01)
    ddp.optimizers.append(optimizer)
    with pytest.raises(RuntimeError, match=r"unfroze backbone\.0\.bias, .* under strategy='ddp' on 2 ranks"):
        callback.on_train_epoch_start(ddp, task)
    one = SimpleNamespace(world_size=1, strategy=SimpleNamespace(ddp=None), optimizers=[optimizer], current_epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backbone is in the optimizer already after the refused attempt
        BackboneFinetuning(unfreeze_backbone_at_epoch=0).on_train_epoch_start(one, task)


def test_the_names_resolve_from_lightning_s_paths() -> None:
    from callbacks.lightning.pytorch.callbacks import BackboneFinetuning as B1
    from callbacks.lightning.pytorch.callbacks.finetuning import BaseFinetuning as B2
    from callbacks.lightning.pytorch.callbacks.finetuning import multiplicative

    assert B1 is BackboneFinetuning and B2 is BaseFinetuning and multiplicative(3) == 2.0
