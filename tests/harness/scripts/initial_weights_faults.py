"""``initial_weights`` on 2 ranks when one rank fails first: ``initial_weights_faults.py SAVE EXPORT OUT``.

SAVE is a keel save of ``Regression()`` (tests/harness/models.py), EXPORT its safetensors file. In one process
group, rank by rank: inputs that fail on one rank alone at each step of the load (its path is missing, its copy of
the save lacks the manifest, its task has another shape, it sees another kind of source), then a good load. Every
case must raise on both ranks, naming the failed rank on the other, and leave the ranks' collectives paired (the
good load at the end works). Writes OUT.rank<R>.json: case -> the error each rank raised, and the weights the last
load gave.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch.distributed as dist
from models import Regression

from trainer.checkpoint.initial import load_initial_weights

MANIFEST = "keel.json"


def main() -> None:
    save, export, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    broken = save.parent / "no-manifest"
    if rank == 0:
        shutil.copytree(save, broken)
        (broken / MANIFEST).unlink()
    dist.barrier()
    one = {
        "missing on rank 0": ((save.parent / "absent") if rank == 0 else save, 8),
        "no manifest on rank 1": (broken if rank == 1 else save, 8),
        "another shape on rank 0": (save, 5 if rank == 0 else 8),
        "another kind on rank 1": (export if rank == 1 else save, 8),
        "good": (save, 8),
    }
    results: dict[str, str | None] = {}
    task = Regression()
    for case, (path, features) in one.items():
        task = Regression(features=features)
        try:
            load_initial_weights(task, path)
            results[case] = None
        except Exception as exc:
            results[case] = f"{type(exc).__name__}: {exc}"
    weights = {k: v.tolist() for k, v in task.state_dict().items()}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"errors": results, "weights": weights}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
