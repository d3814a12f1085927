"""Public LightningModules run unchanged but for the import (tests/lightning_ports/), on 2 ranks, and
``rank_zero_info`` printing in a fresh interpreter before any Trainer. The same ports in one process, and the
Lightning behaviours they rely on (issue 13), are in tests/unit/test_lightning_modules_one_process.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launch import REPO_ROOT, spawn_ranks
from ports_runner import HAS_TORCHMETRICS, SCRIPT


# ---------------------------------------------------------------------------- the ports, 2 ranks
def test_ports_on_two_ranks(tmp_path: Path) -> None:
    cases = ["autoencoder", "gan", "transformer"] + (["imagenet", "hydra_mnist"] if HAS_TORCHMETRICS else [])
    spawn_ranks(SCRIPT, str(tmp_path), *cases, nproc=2, timeout=400).check()
    ranks = {case: [json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in (0, 1)] for case in cases}
    ae = ranks["autoencoder"]
    assert ae[0]["global_step"] == ae[1]["global_step"] == 10  # the data is sharded over the 2 ranks
    assert ae[0]["tested"] == ae[1]["tested"] and ae[0]["processes"] == 2
    gan = ranks["gan"]
    assert [g["global_step"] for g in gan] == [6, 6]
    # logger.experiment on rank 1 writes nothing: one event file in the run directory
    assert gan[0]["event_files"] == gan[1]["event_files"] and len(gan[0]["event_files"]) == 1
    assert all(t["keys_match"] and t["trained_is_plain"] and t["global_step"] == 4 for t in ranks["transformer"])
    if HAS_TORCHMETRICS:
        # ParallelStrategy: the template divides by num_processes in every setup (fit, then validate), as in Lightning
        assert [r["batch_size"] for r in ranks["imagenet"]] == [4, 4]
        assert ranks["imagenet"][0]["validated"] == ranks["imagenet"][1]["validated"]
        hydra = ranks["hydra_mnist"]
        assert hydra[0]["per_device"] == 8 and hydra[0]["tested"] == hydra[1]["tested"]
        assert "last.ckpt" in hydra[0]["files"]


def test_nan_on_one_rank_stops_both_ranks_naming_the_step(tmp_path: Path) -> None:
    spawn_ranks(SCRIPT, str(tmp_path), "nan", nproc=2, timeout=150).check()
    for rank in (0, 1):
        result = json.loads((tmp_path / "nan" / f"rank{rank}.json").read_text())
        assert "Non-finite training loss (nan) at step 3 on rank 1" in result["error"], result


# ---------------------------------------------------------------------------- nothing fails silently
def test_rank_zero_info_prints_before_any_trainer() -> None:
    code = (
        "from trainer.observability.rank_zero import rank_zero_info, rank_zero_warn\n"
        "rank_zero_info('hello %s', 'info')\nrank_zero_warn('hello warn')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert "hello info" in out.stderr and "hello warn" in out.stderr, out
