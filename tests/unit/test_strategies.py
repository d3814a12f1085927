"""Strategy objects in one process: activation checkpointing recomputes the chosen modules in backward and
changes no weight, while autograd keeps fewer bytes for backward. The 2-rank DDP and FSDP runs under activation
checkpointing are in tests/integration/test_fsdp.py; settings and their errors in test_fsdp_settings.py and
test_options.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from recipes.charlm import VOCAB_SIZE, CharGPT
from trainer import DDPStrategy, FSDPStrategy, Trainer


class CountedGPT(CharGPT):
    """The char GPT, recording for each training step the bytes of the distinct storages autograd kept for
    backward (``saved_tensors_hooks``: under activation checkpointing, what a recomputed block would have kept is
    not kept)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kept_bytes: list[int] = []
        self.recomputed: list[int] = []

    def training_step(self, batch, batch_idx):
        storages: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        self.recomputed.append(sum("forward" in m.__dict__ for m in self.modules()))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = super().training_step(batch, batch_idx)
        self.kept_bytes.append(sum(storages.values()))
        return out


def fit_gpt(strategy, steps: int = 3) -> CountedGPT:
    torch.manual_seed(0)
    task = CountedGPT(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1, warmup_steps=1, sample_chars=0)
    tokens = torch.randint(0, VOCAB_SIZE, (64, 33), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = Trainer(
        max_steps=steps,
        strategy=strategy,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task, loader)
    assert trainer.global_step == steps
    return task


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """FSDP in one process makes a one-rank group, which the Trainer keeps until exit: end it here, so that the
    tests after these run in a process without one (the watchdog's tests dump a group's Flight Recorder)."""
    yield
    from trainer.distributed import comm

    comm.destroy_process_group()


@pytest.mark.parametrize("strategy", [DDPStrategy, FSDPStrategy], ids=["ddp-as-single", "fsdp"])
def test_activation_checkpointing_keeps_the_weights_bit_for_bit_and_fewer_bytes(strategy) -> None:
    """With dropout on (the recompute must replay the RNG): the same weights to the bit as without it, every
    block recomputed during training and given its own forward back after fit."""
    plain = fit_gpt(strategy())
    recomputed = fit_gpt(strategy(activation_checkpointing=["Block"]))
    assert plain.recomputed == [0] * 6 and recomputed.recomputed == [2] * 6  # 2 blocks, 3 steps of 2 micro-batches
    ours, theirs = recomputed.state_dict(), plain.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "recompute changed the weights"
    assert recomputed.kept_bytes[0] < 0.6 * plain.kept_bytes[0], (recomputed.kept_bytes, plain.kept_bytes)
    assert not any("forward" in m.__dict__ for m in recomputed.modules())  # restored by teardown


def test_activation_checkpointing_of_a_class_the_task_lacks_names_its_classes() -> None:
    with pytest.raises(ValueError) as info:
        fit_gpt(DDPStrategy(activation_checkpointing=["Blok"]), steps=1)
    message = str(info.value)
    assert "the strategy's activation_checkpointing names ['Blok']" in message and "'Block'" in message, message
    with pytest.raises(ValueError, match=r"FSDPStrategy\(activation_checkpointing=\[3\]\): expected a non-empty"):
        FSDPStrategy(activation_checkpointing=[3])
