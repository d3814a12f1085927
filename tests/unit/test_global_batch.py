"""``global_batch_size`` in one process: its derivation (refusing what does not divide, naming the numbers),
schedules in global-batch terms, the accumulation it drives in the Trainer, and the resume checks (a new micro-batch
size continues the same run; another global batch, or a checkpoint saved without the option, is refused). Elastic
runs that keep the global batch under two torchrun agents: tests/integration/test_elastic.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import Regression, loader, quiet, regression_data

from trainer import Callback, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.data.global_batch import accumulation_for


def test_derivation_refuses_what_does_not_divide_naming_the_numbers() -> None:
    assert accumulation_for(16, world_size=2, micro_batch=4).k(epoch=0, global_step=0) == 2
    with pytest.raises(ValueError) as info:
        accumulation_for(20, world_size=2, micro_batch=4)
    message = str(info.value)
    for part in ("global_batch_size=20", "world size 2", "micro-batch size 4", "16 or 24", "1, 2, 5, 10"):
        assert part in message, message


def test_schedule_in_global_batch_terms() -> None:
    schedule = accumulation_for({"step": {0: 8, 3: 16}}, world_size=2, micro_batch=2)
    assert [schedule.k(epoch=0, global_step=s) for s in range(5)] == [2, 2, 2, 4, 4]
    by_epoch = accumulation_for({0: 8, 2: 32}, world_size=1, micro_batch=4)
    assert [by_epoch.k(epoch=e, global_step=0) for e in range(4)] == [2, 2, 8, 8]
    with pytest.raises(ValueError, match=r"from step 3"):
        accumulation_for({"step": {0: 8, 3: 12}}, world_size=2, micro_batch=4)


class _RecordK(Callback):
    """Micro-batches run in each optimizer step."""

    def __init__(self) -> None:
        self.k: list[int] = []
        self.micro = 0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.micro += 1
        if trainer.optimizer_stepped:
            self.k.append(self.micro)
            self.micro = 0


def _fit(root: Path, *, steps: int, batch: int, ckpt: bool = True, **options) -> tuple[Trainer, Regression, _RecordK]:
    record = _RecordK()
    callbacks = [record] + ([ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=1)] if ckpt else [])
    trainer = Trainer(
        **quiet(max_steps=steps, precision="64", enable_checkpointing=ckpt, callbacks=callbacks, seed=1, **options)
    )
    task = Regression(optimizer="adamw", dtype=torch.float64)
    trainer.fit(
        task, loader(regression_data(64, dtype=torch.float64), batch, shuffle=True), ckpt_path="last" if ckpt else None
    )
    return trainer, task, record


def test_global_batch_drives_accumulation_in_the_trainer(tmp_path: Path) -> None:
    trainer, _, record = _fit(tmp_path, steps=4, batch=4, ckpt=False, global_batch_size={"step": {0: 8, 2: 16}})
    assert record.k == [2, 2, 4, 4] and trainer.global_step == 4


def test_a_new_micro_batch_size_continues_the_same_run(tmp_path: Path) -> None:
    """Resume at G=16 with micro-batch 8 (accumulate 2) from a micro-batch 4 run (accumulate 4): same maths."""
    _, reference, _ = _fit(tmp_path / "ref", steps=6, batch=4, ckpt=False, global_batch_size=16)
    _fit(tmp_path / "ck", steps=3, batch=4, global_batch_size=16)
    _, resumed, record = _fit(tmp_path / "ck", steps=6, batch=8, global_batch_size=16)
    assert record.k == [2, 2, 2]
    for name, value in reference.state_dict().items():
        assert torch.allclose(resumed.state_dict()[name], value, rtol=0, atol=1e-10), name


def test_resume_with_another_global_batch_is_refused(tmp_path: Path) -> None:
    _fit(tmp_path, steps=2, batch=4, global_batch_size=16)
    with pytest.raises(ValueError, match=r"global_batch_size=16; this run asks for global_batch_size=32"):
        _fit(tmp_path, steps=4, batch=4, global_batch_size=32)
    with pytest.raises(
        ValueError, match=r"without the option this run would take 4 \(1 data-parallel rank\(s\) x micro-batch 4"
    ):
        _fit(tmp_path, steps=4, batch=4)
    with pytest.raises(ValueError, match=r"world size 1 x micro-batch size 3"):
        _fit(tmp_path, steps=4, batch=3, global_batch_size=16)
    trainer, _, _ = _fit(tmp_path, steps=4, batch=4, accumulate_grad_batches=4)  # 16 per step: the same run
    assert trainer.global_step == 4


def test_checkpoint_without_the_option_resumes_only_with_the_same_samples_per_step(tmp_path: Path) -> None:
    _fit(tmp_path, steps=2, batch=4, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"written with 8 samples per optimizer step \(no global_batch_size\)"):
        _fit(tmp_path, steps=4, batch=4, global_batch_size=16)
    trainer, _, record = _fit(tmp_path, steps=4, batch=4, global_batch_size=8)
    assert record.k == [2, 2] and trainer.global_step == 4


def test_global_batch_and_other_accumulation_settings_are_exclusive() -> None:
    with pytest.raises(ValueError, match="global_batch_size=16 and accumulate_grad_batches=2"):
        Trainer(global_batch_size=16, accumulate_grad_batches=2)
    from callbacks import GradientAccumulationScheduler

    trainer = Trainer(**quiet(max_steps=1, global_batch_size=8, callbacks=[GradientAccumulationScheduler({0: 2})]))
    with pytest.raises(ValueError, match="GradientAccumulationScheduler and Trainer\\(global_batch_size=8\\)"):
        trainer.fit(Regression(), loader(regression_data(), 4))
