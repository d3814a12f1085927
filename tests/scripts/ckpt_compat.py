"""Resume the previous release's checkpoints (tests/fixtures/checkpoints_v1/) with today's keel.

Usage: ckpt_compat.py OUT NAME... (NAME: single, fsdp). For each, the run of make.py there is rebuilt
(Regression(optimizer="adamw", lr=0.02, scheduler="step") after torch.manual_seed(0), 64 shuffled samples
in batches of 8, seed=0, max_steps=12; strategy="fsdp" at world size 1 for "fsdp"), resumed from
``NAME-step5.ckpt`` and its final weights (and the steps it trained) written to OUT/NAME.pt as plain full
tensors, beside the final weights of the previous release's uninterrupted run (``NAME-final.pt``, DTensors
gathered with full_tensor()).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import torch
from models import Regression, loader, quiet, regression_data

from trainer import Callback, Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_v1"


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu().clone()


class CountSteps(Callback):
    def __init__(self) -> None:
        self.trained: list[int] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped:
            self.trained.append(trainer.global_step)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        torch.manual_seed(0)
        counter = CountSteps()
        options = quiet(max_steps=12, seed=0, callbacks=[counter])
        if name == "fsdp":
            options["strategy"] = "fsdp"
        trainer = Trainer(**options)
        task = Regression(optimizer="adamw", lr=0.02, scheduler="step")
        trainer.fit(task, loader(regression_data(64), 8, shuffle=True), ckpt_path=str(FIXTURES / f"{name}-step5.ckpt"))
        expected = torch.load(FIXTURES / f"{name}-final.pt", weights_only=False)  # DTensors for fsdp
        torch.save(
            {
                "weights": {k: full(v) for k, v in task.state_dict().items()},
                "expected": {k: full(v) for k, v in expected.items()},
                "global_step": trainer.global_step,
                "trained": counter.trained,  # the optimizer steps this run took (a resume: 6 to 12)
                "strategy": type(trainer.strategy).__name__,
            },
            out / f"{name}.pt",
        )


if __name__ == "__main__":
    main()
