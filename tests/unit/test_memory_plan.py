"""The memory plan (trainer/memory/), estimated on fake tensors in one process: FSDP divides the state by the ranks,
activation checkpointing and CPU offload take what they should off the device, the plan covers each phase of a run
and names the cheapest setting that fits (``python -m trainer.memory`` through its ``main``), and a fit logs the
plan of its run at its first batch. Against the memory a real step takes, measured in its own process:
tests/integration/test_memory.py."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from launch import REPO_ROOT
from memory_inputs import tokens

from recipes.charlm import CharGPT
from trainer import FSDPStrategy, TaskModule, Trainer
from trainer.memory import MemoryEstimate, estimate_memory, format_plan, plan_memory
from trainer.memory.__main__ import main

sys.path.insert(0, str(REPO_ROOT / "tests" / "harness" / "scripts"))
from tp_fit import MLPNet  # a task with a tensor-parallel plan


def test_fsdp_divides_the_state_and_recompute_and_offload_take_it_off_the_device() -> None:
    build, batch = (lambda: CharGPT(n_layer=2, sample_chars=0)), tokens(8, 128)
    one = estimate_memory(build, batch, strategy="fsdp", world_size=1)
    four = estimate_memory(build, batch, strategy="fsdp", world_size=4)
    assert four.params == pytest.approx(one.params / 4, rel=0.02)  # shards padded to the world size
    assert four.optimizer == pytest.approx(one.optimizer / 4, rel=0.02)
    assert four.activations == one.activations  # the micro-batch is the same on every rank
    recompute = estimate_memory(build, batch, strategy=FSDPStrategy(activation_checkpointing=["Block"]), world_size=4)
    assert recompute.activations < 0.2 * four.activations and recompute.device < four.device
    offload = estimate_memory(build, batch, strategy=FSDPStrategy(cpu_offload=True), world_size=4)
    assert offload.host == four.params + four.grads + four.optimizer and offload.device < four.device
    ddp = estimate_memory(build, batch, strategy="ddp", world_size=4)
    assert ddp.params == one.params and ddp.other >= one.params  # every rank holds it all, and DDP's buckets
    assert "FSDP x4" in four.summary() and "a rank" in four.summary()


def test_the_command_plans_a_task_on_its_data_and_names_the_cheapest_setting_that_fits(capsys) -> None:
    """``python -m trainer.memory`` on the recipe's char GPT and the first batch of its datamodule (32 windows of
    128): 148 MiB without recompute does not fit 100 MiB; recomputing the blocks (59 MiB) is the cheapest that does."""
    argv = ["--task", "recipes.charlm:CharGPT", "--task-args", '{"sample_chars": 0}', "--world-sizes", "1"]
    argv += ["--data", "recipes.charlm:CharDataModule", "--data-args", '{"max_chars": 200000, "batch_size": 32}']
    assert main([*argv, "--device-memory", "100MiB"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 10]
    assert [(r[0].strip(), r[-1].strip()) for r in rows[1:]] == [
        ("single device", "no"),
        ("FSDP", "no"),
        ("FSDP + activation checkpointing", "yes"),
        ("FSDP + activation checkpointing + CPU offload", "yes"),
    ], out
    assert "Cheapest that fits 100.0 MiB: FSDP + activation checkpointing x1" in out
    assert plan_memory(CharGPT, tokens(2, 8), device_memory=100 << 20, world_sizes=()) == ([], None)
    one = MemoryEstimate("DDP", 2, 1 << 20, 1 << 20, 2 << 20, 5 << 20, 1 << 20, 10 << 20, 0)
    assert "Nothing here fits 1.0 MiB a device" in format_plan([one], None, 1 << 20)
    assert "Cheapest that fits 16.0 MiB: DDP x2: 10.0 MiB a rank" in format_plan([one], one, 16 << 20)


def test_the_plan_covers_each_phase_of_a_run_and_names_the_one_that_decides() -> None:
    """Initialisation (FSDP: this rank's shard plus the largest module at full size, materialised one at a time;
    DDP: the whole model), the training step, an evaluation forward (the state plus gathered units, no gradients
    or saved activations), a save and a load (the state; an async save stages a copy of it in CPU memory)."""
    build, batch = (lambda: CharGPT(n_layer=2, sample_chars=0)), tokens(8, 128)
    four = estimate_memory(build, batch, strategy="fsdp", world_size=4)
    with torch.device("meta"):
        task = build()
    largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in task.modules())
    state = four.params + four.optimizer
    assert list(four.phases) == ["init", "train", "save", "load", "eval"]
    assert four.phases["init"] == four.params + largest and four.phases["train"] == four.device
    assert four.phases["save"] == four.phases["load"] == four.staging == state
    assert state < four.phases["eval"] < four.device and four.decides == "train" and four.peak == four.device
    assert "; phases: init " in four.summary() and four.summary().endswith(": train decides")
    ddp = estimate_memory(build, batch, strategy="ddp", world_size=4)
    assert ddp.phases["init"] == ddp.params == sum(p.numel() * 4 for p in task.parameters())
    # A phase above the step decides, and fitting means fitting it.
    loading = MemoryEstimate("FSDP", 4, 1, 0, 0, 0, 0, 10, 0, phases={"train": 10, "load": 30}, staging=1)
    assert loading.decides == "load" and loading.peak == 30 and not loading.fits(20) and loading.fits(30)


def test_the_plan_includes_hybrid_sharding_across_nodes() -> None:
    """With node_size, a world of several nodes also gets FSDPStrategy(replicate_size=nodes), ahead of FSDP over
    every rank: each rank holds the model sharded over its node's ranks only."""
    build, batch = (lambda: CharGPT(n_layer=2, sample_chars=0)), tokens(8, 128)
    estimates, _ = plan_memory(build, batch, device_memory=1 << 30, world_sizes=(2, 4), node_size=2, recompute=[])
    assert [(e.setting, e.world_size) for e in estimates] == [
        ("DDP", 2),
        ("FSDP", 2),
        ("FSDP + CPU offload", 2),
        ("DDP", 4),
        ("FSDP + HSDP 2 replicas", 4),
        ("FSDP", 4),
        ("FSDP + CPU offload", 4),
    ]
    hybrid, fsdp = estimates[4], estimates[5]
    assert hybrid.params == pytest.approx(2 * fsdp.params, rel=0.02) == estimates[1].params


def test_bf16_mixed_fsdp_with_norms_inside_the_blocks_is_planned() -> None:
    """Under bf16-mixed FSDP a block's LayerNorms are units of their own, gathered in fp32: the plan runs them like
    any unit (torch's memory tracker refuses units that group several modules), every phase included."""
    estimate = estimate_memory(
        lambda: CharGPT(sample_chars=0), tokens(2, 16), strategy="fsdp", world_size=2, precision="bf16-mixed"
    )
    assert set(estimate.phases) == {"init", "train", "eval", "save", "load"} and estimate.params > 0


def test_a_5b_parameter_model_on_8_ranks_under_bf16_mixed_holds_its_share_of_the_state() -> None:
    """75 blocks of 8192x8192 (5.03B parameters), 8 ranks, bf16-mixed, AdamW: the step's peak is parameters,
    gradients and AdamW's two states divided by the ranks (9.375 GiB), plus AdamW's foreach temporaries (at most
    half a parameter shard) and at most two units' gathered bf16 weights; no bf16 copy of the model (before bf16
    parameters were gathered, this plan said 17.2 GiB with 9.0 GiB of bf16 weight copies as activations)."""

    class Blocks(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8192, 8192, bias=False) for _ in range(75))

        def training_step(self, batch, batch_idx):
            x = batch[0]
            for block in self.blocks:
                x = x + torch.tanh(block(x))
            return x.square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    estimate = estimate_memory(Blocks, (torch.zeros(4, 8192),), strategy="fsdp", world_size=8, precision="bf16-mixed")
    parameters = 75 * 8192 * 8192
    shard, unit = parameters * 4 // 8, 8192 * 8192 * 2
    assert estimate.params == estimate.grads == shard and estimate.optimizer >= 2 * shard
    assert 4 * shard <= estimate.device <= 4 * shard + shard // 2 + 2 * unit + (1 << 20), estimate.summary()
    assert estimate.decides == "train" and estimate.fits(80 << 30)


@pytest.mark.slow
def test_a_70b_transformer_on_64_ranks_is_planned_on_this_machine() -> None:
    """A Llama-70B-shaped transformer (70.55B parameters: 80 layers of width 8192, grouped-query attention, a
    28672-wide MLP, 128256 tokens) on 64 ranks of 80 GiB, bf16-mixed, AdamW, the layers recomputed, a sequence of
    4096: every phase is estimated in one process on fake tensors (about 3 minutes here) and the plan fits."""
    from models import Llama

    estimate = estimate_memory(
        Llama,
        (torch.zeros(1, 4096, dtype=torch.long),) * 2,
        strategy=FSDPStrategy(activation_checkpointing=["LlamaLayer"]),
        world_size=64,
        precision="bf16-mixed",
    )
    assert set(estimate.phases) == {"init", "train", "eval", "save", "load"}
    assert estimate.params == pytest.approx(70.55e9 * 4 / 64, rel=0.01)
    assert estimate.fits(80 << 30), estimate.summary()


def test_estimating_another_world_size_inside_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a run (a process group exists) the estimate runs on fake groups over the run's own ranks: only at
    the run's world size (the plan the Trainer logs at fit start, tested in test_ddp and test_tensor_parallel)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(
        RuntimeError, match=r"one of 4 ranks .* estimate at world_size=4 here.*python -m trainer.memory"
    ):
        estimate_memory(lambda: CharGPT(sample_chars=0), tokens(2, 16), world_size=2)


def test_layers_built_in_configure_model_are_counted() -> None:
    """configure_model runs in the estimate as in fit (with no device mesh): a task that builds its layers there
    has the same parameters as one that builds them in __init__."""
    from trainer import TaskModule

    class Net(TaskModule):
        def __init__(self, late: bool) -> None:
            super().__init__()
            self.late = late
            self.body = torch.nn.Sequential() if late else torch.nn.Sequential(torch.nn.Linear(64, 64))

        def configure_model(self) -> None:
            assert self.device_mesh is None
            if self.late and not len(self.body):
                self.body.append(torch.nn.Linear(64, 64))

        def training_step(self, batch, batch_idx):
            return self.body(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batch = (torch.randn(4, 64),)
    early = estimate_memory(lambda: Net(False), batch)
    late = estimate_memory(lambda: Net(True), batch)
    assert late.params == early.params == (64 * 64 + 64) * 4


def test_the_plan_suggests_tensor_parallelism_for_a_task_with_a_plan() -> None:
    """``tensor_parallel_sizes=(2,)`` adds FSDP + TP 2 (without and with recompute) at each world size that 2
    divides, after recompute and before offload; the task's configure_model applies its plan on the run's mesh
    (tests/harness/scripts/tp_fit.py: the blocks' projections split), so at 2 ranks TP holds half of the split
    layers and the activations they make, where FSDP at 2 ranks shards the state but keeps every activation."""
    batch = (torch.arange(64), torch.randn(64, 6, dtype=torch.float64), torch.randn(64, dtype=torch.float64))
    estimates, chosen = plan_memory(
        MLPNet, batch, device_memory=1 << 30, world_sizes=(1, 2), precision="64", tensor_parallel_sizes=(2, 4)
    )
    assert [(e.setting, e.world_size) for e in estimates] == [
        ("single device", 1),
        ("FSDP", 1),
        ("FSDP + activation checkpointing", 1),
        ("FSDP + activation checkpointing + CPU offload", 1),
        ("DDP", 2),
        ("FSDP", 2),
        ("FSDP + activation checkpointing", 2),
        ("FSDP + TP 2", 2),
        ("FSDP + TP 2 + activation checkpointing", 2),
        ("FSDP + activation checkpointing + CPU offload", 2),
    ]
    assert chosen is estimates[0]
    one, fsdp2, tp2 = estimates[1], estimates[5], estimates[7]
    assert tp2.activations < 0.8 * fsdp2.activations == 0.8 * one.activations
    assert fsdp2.params < tp2.params < one.params  # TP splits the blocks' projections, not the input and head


def test_a_step_that_reads_a_value_on_the_host_is_refused_by_name() -> None:
    """Fake tensors have no values: ``.item()`` in training_step cannot be estimated, and the error says so."""
    from trainer import TaskModule

    class Net(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = self.body(batch[0]).square().mean()
            self.last = loss.item()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(RuntimeError, match=r"reads a tensor on the host \(.item\(\), .tolist\(\)"):
        estimate_memory(Net, (torch.randn(2, 4),))


def _fit(task, memory_plan, caplog: pytest.LogCaptureFixture) -> tuple[dict, list[logging.LogRecord]]:
    from torch.utils.data import DataLoader, TensorDataset

    from trainer import Trainer

    caplog.clear()
    x = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(1))
    trainer = Trainer(
        max_steps=3, memory_plan=memory_plan, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with caplog.at_level(logging.INFO, logger="trainer.memory.callback"):
        trainer.fit(task, DataLoader(TensorDataset(x, x), batch_size=8, shuffle=True))
    records = [r for r in caplog.records if r.name == "trainer.memory.callback"]
    return {k: v.clone() for k, v in task.state_dict().items()}, records


def test_fit_logs_the_plan_of_the_run_at_its_first_batch_and_trains_the_same(caplog) -> None:
    """Trainer(memory_plan=True) on CPU: one INFO line at the first batch, the estimate of this run's task (made on
    a meta copy of it: nothing of the real task changes) and micro-batch; with dropout, the weights after 3 steps are
    bit for bit those of a run without the plan (the estimate draws no random number). Off by default."""

    def build() -> CharGPT:
        torch.manual_seed(0)
        return CharGPT(block_size=32, n_layer=2, dropout=0.1, sample_chars=0)

    planned, records = _fit(build(), True, caplog)
    plain, none = _fit(build(), False, caplog)
    assert none == [] and planned.keys() == plain.keys()
    assert all(torch.equal(planned[k], plain[k]) for k in planned)
    (line,) = records
    x = torch.zeros(8, 32, dtype=torch.long)
    assert line.levelno == logging.INFO
    assert line.getMessage() == f"Memory plan: {estimate_memory(build, (x, x)).summary()}"
    assert not Trainer().options.memory_plan  # off by default, on every device


def _loss(out: dict | torch.Tensor) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out


def test_a_run_the_plan_cannot_estimate_says_why_in_one_line_and_trains_on(caplog) -> None:
    """A step that reads a value on the host (``.item()``) and manual optimization: the run trains as without the
    plan, and one line (WARNING, since memory_plan=True was asked for) names the reason and how to turn it off."""

    class Reads(CharGPT):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.last = float(_loss(out).item())
            return out

    class Manual(CharGPT):
        def __init__(self) -> None:
            super().__init__(block_size=32, n_layer=1, sample_chars=0)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = _loss(super().training_step(batch, batch_idx))
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    _, reads = _fit(Reads(block_size=32, n_layer=1, sample_chars=0), True, caplog)
    _, manual = _fit(Manual(), True, caplog)
    for (record,), why in ((reads, "reads a tensor on the host"), (manual, "manual optimization")):
        assert record.levelno == logging.WARNING
        assert record.getMessage().startswith("Memory plan: not estimated: ") and why in record.getMessage()
        assert "Trainer(memory_plan=False) turns the plan off" in record.getMessage()
