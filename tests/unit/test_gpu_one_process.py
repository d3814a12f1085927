"""CUDA paths in one process: batches placed on the GPU from pinned memory and copied on keel's stream, predictions
brought back to the CPU, bf16-mixed and 16-mixed (unscaled before the hooks and clipping), the memory plan against
CUDA's peaks, and the phases' device times from CUDA events. Skipped without a GPU (CI has none); run them, with
the launched NCCL runs of tests/integration/test_gpu.py, on a GPU machine with
`python -m pytest -m gpu tests/unit/test_gpu_one_process.py tests/integration/test_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from models import Regression, quiet, regression_data
from torch.utils.data import DataLoader

from trainer import Callback, Trainer

pytestmark = pytest.mark.gpu


class Probe(Callback):
    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        self.seen["batch_device"] = batch[0].device
        self.seen["param_device"] = next(task.parameters()).device

    def on_before_optimizer_step(self, trainer, task, optimizer) -> None:
        grads = [p.grad for p in task.parameters() if p.grad is not None]
        self.seen["grad_finite"] = all(bool(torch.isfinite(g).all()) for g in grads)
        self.seen["grad_max"] = max(float(g.abs().max()) for g in grads)
        self.seen["scale"] = trainer._precision.scaler.get_scale() if trainer._precision.scaler else None


class DtypeProbe(Regression):
    def training_step(self, batch, batch_idx):
        self.matmul_dtype = self.net[0](batch[0]).dtype
        return super().training_step(batch, batch_idx)


def test_batches_are_placed_on_the_gpu_from_pinned_memory() -> None:
    probe = Probe()
    task = Regression()
    Trainer(**quiet(max_steps=3, accelerator="cuda", callbacks=[probe])).fit(
        task, DataLoader(regression_data(), batch_size=8, pin_memory=True)
    )
    assert probe.seen["batch_device"].type == "cuda" and probe.seen["param_device"].type == "cuda"


def test_predictions_made_on_the_gpu_come_back_on_the_cpu() -> None:
    trainer = Trainer(**quiet(accelerator="cuda"))
    predictions = trainer.predict(Regression(), DataLoader(regression_data(32), batch_size=8))
    assert len(predictions) == 4 and all(p.device.type == "cpu" for p in predictions)


def test_bf16_mixed_on_cuda() -> None:
    task = DtypeProbe()
    trainer = Trainer(**quiet(max_epochs=3, accelerator="cuda", precision="bf16-mixed"))
    trainer.fit(task, DataLoader(regression_data(), batch_size=8))
    assert task.matmul_dtype == torch.bfloat16 and next(task.parameters()).dtype == torch.float32


def test_16_mixed_unscales_before_hooks_and_clipping() -> None:
    probe = Probe()
    task = DtypeProbe()
    trainer = Trainer(
        **quiet(max_epochs=2, accelerator="cuda", precision="16-mixed", gradient_clip_val=1.0, callbacks=[probe])
    )
    trainer.fit(task, DataLoader(regression_data(), batch_size=8))
    assert task.matmul_dtype == torch.float16
    assert probe.seen["scale"] is not None and probe.seen["scale"] > 1.0
    # The hook sees true gradients (unscaled): far below the loss scale (65536 at the start).
    assert probe.seen["grad_finite"] and probe.seen["grad_max"] < 100.0


def test_pinned_batches_are_copied_on_keels_stream_and_arrive_intact() -> None:
    """trainer.data.transfer.BatchCopier: pinned batches on a side stream (the compute stream waits on the
    device), unpinned ones on the compute stream; values intact either way. Overlap itself is measured by
    benchmarks/gpu.py (batch_copy_overlap), not asserted here."""
    from trainer.data.transfer import BatchCopier

    device = torch.device("cuda")
    copier = BatchCopier(device, float_dtype=None, overlap=True)
    assert copier.stream is not None
    batch = [torch.randn(1024, 1024).pin_memory(), {"y": torch.arange(10).pin_memory()}]
    for _ in range(3):
        moved = copier(batch)
        total = moved[0].sum() + moved[1]["y"].sum()  # used on the compute stream right away
        assert (
            moved[0].is_cuda
            and torch.equal(moved[0].cpu(), batch[0])
            and torch.equal(moved[1]["y"].cpu(), batch[1]["y"])
        )
        assert torch.isclose(total.cpu(), batch[0].sum() + 45)
    plain = copier([torch.ones(3)])  # not pinned: the compute stream's copy
    assert plain[0].is_cuda and plain[0].sum().item() == 3.0


def char_tokens() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """64 windows of 129 characters, and the first micro-batch of 32 (inputs, targets) they give."""
    x = torch.randint(0, 128, (64, 129), generator=torch.Generator().manual_seed(0))
    return x, (x[:32, :-1], x[:32, 1:])


def char_gpt():
    """The char GPT the CUDA memory checks run: 6 blocks of width 384."""
    from recipes.charlm import CharGPT

    return CharGPT(n_layer=6, n_embd=384, n_head=6, sample_chars=0)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_the_memory_estimate_matches_the_cuda_peak_of_a_real_step(precision: str) -> None:
    """trainer.memory on fake CUDA tensors against torch.cuda.max_memory_allocated of two real steps of the char
    GPT (the caching allocator's peak of live tensors), within 15%; and the plan the Trainer logs at fit start."""
    from torch.utils.data import TensorDataset

    from trainer.memory import estimate_memory

    x, batch = char_tokens()

    estimate = estimate_memory(char_gpt, batch, precision=precision, device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    trainer = Trainer(
        **quiet(max_steps=2, accelerator="cuda", precision=precision, enable_model_summary=False, memory_plan=True)
    )
    trainer.fit(char_gpt(), DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=32))
    real = torch.cuda.max_memory_allocated() - start
    assert abs(estimate.device - real) / real < 0.15, (estimate.summary(), real)
    # Trainer(memory_plan=True) logs the same plan at the first batch (fake tensors: not in the peak above).
    from trainer.memory import MemoryPlan

    (plan,) = [cb for cb in trainer.callbacks if isinstance(cb, MemoryPlan)]
    assert plan.summary is not None and plan.summary.startswith(f"Memory plan: {estimate.summary()}; fits ")


class PhasePeaks(Callback):
    """torch.cuda.max_memory_allocated in each phase of a run: everything before the first training batch is
    initialisation; then the steps and the validations."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.phase = "init"
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()

    def enter(self, phase: str) -> None:
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), torch.cuda.max_memory_allocated() - self.start)
        torch.cuda.reset_peak_memory_stats()
        self.phase = phase

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        self.enter("train")

    def on_validation_start(self, trainer, task) -> None:
        self.enter("eval")

    def on_validation_end(self, trainer, task) -> None:
        self.enter("train")


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_the_plan_of_each_phase_against_the_cuda_peaks_of_a_run(precision: str) -> None:
    """The plan's initialisation, step and evaluation peaks against torch.cuda.max_memory_allocated in those phases
    of a real fit of the char GPT on one GPU, within 20%, and the phase that decides."""
    from torch.utils.data import TensorDataset

    from trainer.memory import estimate_memory

    x, batch = char_tokens()

    plan = estimate_memory(char_gpt, batch, precision=precision, device="cuda")
    torch.cuda.empty_cache()
    peaks = PhasePeaks()
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=32)
    trainer = Trainer(
        **quiet(max_steps=2, accelerator="cuda", precision=precision, val_check_interval=1, callbacks=[peaks])
    )
    trainer.fit(char_gpt(), loader, loader)
    peaks.enter("done")
    for phase in ("init", "train", "eval"):
        assert abs(plan.phases[phase] - peaks.peaks[phase]) < 0.2 * peaks.peaks[phase], (phase, plan, peaks.peaks)
    assert plan.decides == max(("init", "train", "eval"), key=peaks.peaks.__getitem__)


def test_the_device_times_of_the_phases_come_from_cuda_events(tmp_path) -> None:
    """On CUDA the phase clock records a timing event at each mark; the time budget holds the device's seconds
    per phase next to the host's, and the compute phases' device time is there (the stream ran the kernels)."""
    import json

    from trainer.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="run", version=0)
    trainer = Trainer(**quiet(max_steps=16, log_every_n_steps=2, accelerator="cuda", logger=logger))
    trainer.fit(Regression(), DataLoader(regression_data(256), batch_size=4))
    budget = json.loads((tmp_path / "run" / "version_0" / "efficiency.json").read_text())
    (device,), (host,) = budget["per_rank_device_seconds"], budget["per_rank_seconds"]
    assert device["forward"] > 0 and device["backward"] > 0 and device["optimizer"] > 0, device
    assert sum(device.values()) <= sum(host.values()) * 1.05 + 0.01, (device, host)
