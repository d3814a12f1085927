"""Checkpoint integrity on two ranks: a bit flipped in rank 1's data file of the newest save is refused, and
``ckpt_path="last"`` falls back to the previous committed save on both ranks, which then resume exactly. The rest
of checkpoint integrity and security (payloads that never run, silent corruption, the ``last`` pointer, ``best``,
optimizer classes, teardown after a failure), in one process: tests/unit/test_checkpoint_safety.py."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import torch
from checkpoint_damage import assert_same_weights, save_name
from launch import REPO_ROOT, spawn_ranks

# ---------------------------------------------------------------------- 7. two ranks
TWO_RANK_SCRIPT = textwrap.dedent(
    '''
    """Two ranks: reference run; a run with saves; a bit flipped in rank 1's data file of the newest save;
    ckpt_path="last" again. Writes OUT/rank{R}.pt."""
    import logging
    import os
    import sys
    from pathlib import Path

    out, ck, folders = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    sys.path[:0] = folders.split(os.pathsep)  # tests/harness (models, checkpoint_damage) and tests/integration
    import torch
    import torch.distributed as dist
    from models import Regression, loader, quiet, regression_data

    from trainer import Callback, Trainer
    from trainer.checkpoint.model_checkpoint import ModelCheckpoint
    from checkpoint_damage import flip_tensor_bit, save_name, tensor_span, weights

    class Probe(Callback):
        def on_fit_start(self, trainer, task):
            self.step, self.path = trainer.global_step, trainer.ckpt_path

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    def fit(max_steps, ckpt_path=None, checkpoint=True, probe=None):
        callbacks = [ModelCheckpoint(dirpath=ck, every_n_train_steps=1, save_top_k=2)] if checkpoint else []
        callbacks += [probe] if probe is not None else []
        trainer = Trainer(**quiet(max_steps=max_steps, enable_checkpointing=checkpoint, callbacks=callbacks))
        task = Regression()
        trainer.fit(task, loader(regression_data(), 8, shuffle=True), ckpt_path=ckpt_path)
        return trainer, task

    _, reference = fit(6, checkpoint=False)  # uninterrupted, 2 epochs of 4 steps minus 2
    trainer, _ = fit(4)  # saves at 3 and 4 are kept
    rank = trainer.global_rank
    newest = ck / save_name(4)
    flipped = None
    if rank == 1:  # the file this rank wrote: some tensor of the run stored in __1_0.distcp
        import pickle

        with open(newest / ".metadata", "rb") as handle:
            metadata = pickle.load(handle)
        items = metadata.storage_data.items()
        flipped = [i.fqn for i, s in items if s.relative_path == "__1_0.distcp" and i.index is not None][0]
        assert flip_tensor_bit(newest, flipped) == "__1_0.distcp"
    dist.barrier()
    records = Records()
    logging.getLogger("trainer").addHandler(records)
    probe = Probe()
    trainer, task = fit(6, ckpt_path="last", probe=probe)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "reference": weights(reference),
            "resumed": weights(task),
            "step": trainer.global_step,
            "start": probe.step,
            "path": probe.path,
            "warnings": records.messages,
            "flipped": flipped,
        },
        out / f"rank{rank}.pt",
    )
    '''
)


def test_two_ranks_fall_back_from_a_damaged_rank1_file(tmp_path: Path) -> None:
    script = tmp_path / "fallback_fit.py"
    script.write_text(TWO_RANK_SCRIPT)
    out, ck = tmp_path / "out", tmp_path / "ck"
    folders = os.pathsep.join(str(REPO_ROOT / "tests" / f) for f in ("harness", "integration"))
    spawn_ranks(script, str(out), str(ck), folders, nproc=2, timeout=180).check()
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[1]["flipped"], "rank 1 wrote no tensor to __1_0.distcp"
    for result in ranks:
        assert result["start"] == 3 and result["path"] == str(ck / save_name(3)), result["path"]
        assert result["step"] == 6
        assert_same_weights(result["resumed"], result["reference"])
    assert_same_weights(ranks[0]["resumed"], ranks[1]["resumed"])
    fallbacks = [w for w in ranks[0]["warnings"] if "Falling back" in w]
    assert len(fallbacks) == 1 and "__1_0.distcp" in fallbacks[0] and save_name(3) in fallbacks[0], ranks[0]["warnings"]
