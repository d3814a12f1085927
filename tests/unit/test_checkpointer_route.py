"""The route a save and a resume take: the Trainer's Checkpointer, the store's commit, then DCP.

A save is at most three keel frames below ``ModelCheckpoint.save`` (``Checkpointer.save`` -> ``store.save`` ->
``_write``), a resume at most two below the fit's body (``Checkpointer.load`` -> ``reader.load``): no layer only
passes the call on. Counted on the real stack at the moment DCP is called.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from models import Regression, loader, quiet, regression_data

import trainer
from trainer import Trainer

KEEL = Path(trainer.__file__).parent


def keel_frames_below(caller: str) -> list[str]:
    """The keel functions (``module.function``) between the innermost ``caller`` and the DCP call."""
    names = []
    for frame in inspect.stack()[2:]:  # [0] this function, [1] the DCP stand-in
        if not Path(frame.filename).is_relative_to(KEEL):
            continue
        name = f"{Path(frame.filename).stem}.{frame.function}"
        if name == caller:
            return names
        names.append(name)
    raise AssertionError(f"{caller} is not on the stack")


def test_a_save_and_a_resume_take_the_short_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    routes: dict[str, list[str]] = {}
    save, load = dcp.save, dcp.load

    def counted_save(*args, **kwargs):
        routes.setdefault("save", keel_frames_below("model_checkpoint.save"))
        return save(*args, **kwargs)

    def counted_load(*args, **kwargs):
        routes.setdefault("load", keel_frames_below("trainer._fit"))
        return load(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", counted_save)
    monkeypatch.setattr(dcp, "load", counted_load)
    data = loader(regression_data(16), batch_size=4)
    options = quiet(max_steps=2, enable_checkpointing=True, default_root_dir=str(tmp_path))
    Trainer(**options).fit(Regression(), data)
    resumed = Trainer(**dict(options, max_steps=3))
    resumed.fit(Regression(), data, ckpt_path="last")

    assert resumed.global_step == 3
    # ModelCheckpoint.save -> Checkpointer.save -> store.save -> store._write -> dcp.save
    assert routes["save"] == ["store._write", "store.save", "checkpointer.save"]
    # Trainer._fit -> Checkpointer.load -> reader.load -> dcp.load
    assert routes["load"] == ["reader.load", "checkpointer.load"]
