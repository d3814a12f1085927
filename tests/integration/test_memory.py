"""The memory plan (trainer/memory/): estimated on fake tensors, it matches the memory a real step takes on the
CPU within 15% (the char GPT and a 100M-parameter model, measured as the resident-set high-water mark of a real
``Trainer.fit`` in its own process: tests/harness/scripts/measure_memory.py). The plan itself (FSDP, activation
checkpointing and CPU offload, the phases, the cheapest setting that fits), in one process:
tests/unit/test_memory_plan.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import REPO_ROOT
from memory_inputs import tokens

from recipes.charlm import CharGPT
from trainer.memory import estimate_memory

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "measure_memory.py"


def measured(n_layer: int, n_embd: int, n_head: int, batch: int, block: int) -> int:
    args = [f"--n-layer={n_layer}", f"--n-embd={n_embd}", f"--n-head={n_head}", f"--batch={batch}", f"--block={block}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["measured"]


@pytest.mark.parametrize(
    "n_layer, n_embd, n_head, batch, block",
    [
        (4, 128, 4, 32, 128),
        # 16 s of AdamW on 100M parameters (twice: estimate and real step): a variant of the same check, slow.
        pytest.param(14, 768, 12, 2, 128, marks=pytest.mark.slow),
    ],
    ids=["char-gpt", "100M-parameters"],
)
def test_the_estimate_matches_the_memory_a_real_step_takes(n_layer, n_embd, n_head, batch, block) -> None:
    """The recipe's char GPT (0.8M parameters: activations dominate) and a 99.4M-parameter one (weights, gradients
    and AdamW state dominate), one process."""
    estimate = estimate_memory(
        lambda: CharGPT(block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd, sample_chars=0),
        tokens(batch, block),
    )
    real = measured(n_layer, n_embd, n_head, batch, block)
    assert abs(estimate.device - real) / real < 0.15, (estimate.summary(), real)
