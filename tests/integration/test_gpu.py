"""CUDA / NCCL paths in launched processes: a one-rank nccl group under torchrun, FSDP on one GPU with a sharded
checkpoint, and ordinary steps that never sync the host. Skipped without a GPU (CI has none); run them, with the
in-process CUDA tests of tests/unit/test_gpu_one_process.py, on a GPU machine with
`python -m pytest -m gpu tests/unit/test_gpu_one_process.py tests/integration/test_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from launch import REPO_ROOT, torchrun

pytestmark = pytest.mark.gpu


def test_nccl_with_one_rank(tmp_path) -> None:
    script = REPO_ROOT / "tests" / "harness" / "scripts" / "ddp_fit.py"
    torchrun(script, str(tmp_path), "--batch", "8", nproc=1, timeout=300, env={"KEEL_TEST_ACCELERATOR": "cuda"}).check()
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert result["world_size"] == 1 and result["global_step"] == 8


def test_fsdp_on_one_gpu_bf16_nccl_with_a_sharded_checkpoint(tmp_path) -> None:
    """FSDP at one rank on CUDA: a one-rank nccl group and CUDA device mesh, bf16 mixed-precision policy
    (bf16 compute, fp32 sharded master weights), pinned-memory CPU offload, and a sharded checkpoint that
    exports to one plain file."""
    import subprocess
    import sys

    code = f"""
import sys, torch
sys.path.insert(0, 'tests/harness'); sys.path.insert(0, 'tests/harness/scripts')
from torch.utils.data import DataLoader, TensorDataset
from fsdp_fit import BlockNet, data
from trainer import FSDPStrategy, Trainer
from trainer.checkpoint.hf import export_weights
task = BlockNet()
trainer = Trainer(max_steps=4, accelerator='cuda', strategy=FSDPStrategy(cpu_offload=True), precision='bf16-mixed',
                  logger=False, enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0)
idx, x, y = data(48, 0).tensors
trainer.fit(task, DataLoader(TensorDataset(idx, x.float(), y.float()), batch_size=8))
trainer.save_checkpoint({str(tmp_path / "ck.ckpt")!r})
export_weights({str(tmp_path / "ck.ckpt")!r}, {str(tmp_path / "w.pt")!r})
weights = torch.load({str(tmp_path / "w.pt")!r}, weights_only=True)
print('OK', torch.distributed.get_backend(), next(iter(weights.values())).dtype)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert "OK nccl" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    "precision,clip,items",
    [
        ("32", 1.0, None),
        ("bf16-mixed", 1.0, None),
        ("16-mixed", 1.0, None),
        ("32", None, None),
        ("bf16-mixed", 1.0, "int"),  # token-normalised steps (num_items): the count as an int
        ("bf16-mixed", 1.0, "tensor"),  # and as a tensor on the GPU
    ],
)
def test_ordinary_steps_never_sync_the_host(tmp_path, strategy, precision, clip, items) -> None:
    """Ordinary steps under torch.cuda.set_sync_debug_mode("error") (DDP and FSDP at one nccl rank, with a
    pinned loader, a step scheduler, self.log on every step, global-norm clipping, and num_items losses): a
    synchronising CUDA call raises. Logging steps may sync once (tests/harness/scripts/cuda_sync_free.py)."""
    script = REPO_ROOT / "tests" / "harness" / "scripts" / "cuda_sync_free.py"
    args = [str(tmp_path), "--strategy", strategy, "--precision", precision] + (
        [] if clip is None else ["--clip", str(clip)]
    )
    args += [] if items is None else ["--items", items]
    torchrun(script, *args, nproc=1, timeout=300).check()
    import json

    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 14 and len(result["strict_steps"]) == 12, result
    if precision == "16-mixed":
        assert result["scale"] is not None and result["scale"] > 1.0
