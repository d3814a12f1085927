"""FSDPStrategy and DDPStrategy in one process: bad settings and the old strategy keywords are refused before any
process group (showing the new form), strategy objects carry their settings into the run, async staging reuses its
CPU buffers, and a crafted folder without a manifest is never read. FSDP's launched runs (the maths of DDP on 2
ranks, sharded checkpoints that reshard, the plain export, hybrid sharding on two nodes):
tests/integration/test_fsdp.py."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_folder_without_a_manifest_is_never_read(tmp_path: Path) -> None:
    """A folder with keel.pt and a hostile .metadata but no keel.json was never committed: refused before a byte
    of it is unpickled (a committed save with a hostile file: tests/integration/test_checkpoint_integrity.py)."""
    from trainer.checkpoint.files import CorruptCheckpointError
    from trainer.checkpoint.reader import load_weights

    folder = tmp_path / "epoch=0-step=1.ckpt"
    folder.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"keel_format_version": 1, "state_dict": {}}, folder / "keel.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CorruptCheckpointError, match="has no keel.json: it was never committed"):
        load_weights(folder)
    assert not marker.exists()  # refused before anything in it ran


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"reduce_grads": "sometimes"}, "FSDPStrategy(reduce_grads='sometimes'): expected 'every_micro_batch'"),
        ({"units": [3]}, "FSDPStrategy(units=[3]): expected a non-empty list of module class names"),
        ({"cpu_offload": 1}, "FSDPStrategy(cpu_offload=1): expected True or False"),
        ({"replicate_size": 0}, "FSDPStrategy(replicate_size=0): expected a whole number >= 1"),
        ({"replicate_size": "nodes"}, "or 'auto' (one group per node)"),
        (
            {"replicate_size": 2},
            "FSDPStrategy(replicate_size=2) gives 2 replica groups, which do not divide the 1 data-parallel ranks",
        ),
    ],
)
def test_bad_fsdp_settings_are_refused_before_any_group(
    settings: dict, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed

    from trainer import FSDPStrategy, Trainer

    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("a group was made"))
    with pytest.raises(ValueError) as info:
        Trainer(logger=False, strategy=FSDPStrategy(**settings))
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "option, value, new_form",
    [
        ("fsdp_units", ["Block"], "Trainer(strategy=FSDPStrategy(units=['Block']))"),
        ("fsdp_cpu_offload", True, "Trainer(strategy=FSDPStrategy(cpu_offload=True))"),
        ("fsdp_reduce_grads", "last_micro_batch", "FSDPStrategy(reduce_grads='last_micro_batch')"),
        ("find_unused_parameters", True, "Trainer(strategy=DDPStrategy(find_unused_parameters=True))"),
        ("bucket_cap_mb", 50, "DDPStrategy(bucket_cap_mb=50)"),
    ],
)
def test_the_old_strategy_keywords_fail_showing_the_new_form(option: str, value: object, new_form: str) -> None:
    from trainer import Trainer

    with pytest.raises(ValueError) as info:
        Trainer(logger=False, strategy="fsdp", **{option: value})
    message = str(info.value)
    assert f"Trainer option {option!r} is now a setting of the strategy object" in message, message
    assert new_form in message and "_target_: trainer." in message, message


def test_strategy_objects_carry_their_settings_into_the_run() -> None:
    """The string forms build the defaults (Lightning's registered names their settings); the object given is the
    strategy the Trainer runs, and its settings are what the options record (plain values, classes by name)."""
    from trainer import DDPStrategy, FSDPStrategy, Trainer

    fsdp = FSDPStrategy(units=[torch.nn.Linear, "Block"], cpu_offload=True, reduce_grads="last_micro_batch")
    trainer = Trainer(logger=False, strategy=fsdp, enable_progress_bar=False)
    assert trainer.strategy is fsdp and trainer.strategy.world_size == 1
    recorded = trainer.options.resolved()["strategy"]
    assert recorded == {
        "name": "FSDPStrategy",
        "units": ["Linear", "Block"],
        "reshard_after_forward": True,
        "cpu_offload": True,
        "reduce_grads": "last_micro_batch",
        "activation_checkpointing": None,
        "tensor_parallel_size": 1,
        "replicate_size": 1,
    }
    assert "cpu_offload=True" in repr(fsdp) and "world_size=1" in repr(fsdp)
    assert Trainer(logger=False, strategy="fsdp_cpu_offload").strategy.cpu_offload is True
    # One process: a DDP strategy runs as the single-device one, as strategy="ddp" does.
    assert Trainer(logger=False, strategy=DDPStrategy(static_graph=True)).strategy.name == "single"
    with pytest.raises(ValueError, match=r"DDPStrategy\(bucket_cap_mb=0\): expected a number of megabytes > 0"):
        DDPStrategy(bucket_cap_mb=0)
    with pytest.raises(TypeError):
        DDPStrategy(True)  # keyword-only: a positional setting is a mistake


def test_async_staging_reuses_its_cpu_buffers_and_always_copies_the_current_values() -> None:
    from trainer.checkpoint.dcp_io import ReusedStaging

    w = torch.arange(4.0)
    state = {
        "model": {"w": w},
        "optimizers": [{"state": {"w": {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1}]}],
    }
    stager = ReusedStaging()
    first = stager.stage(state)
    w.add_(10)
    state["optimizers"][0]["param_groups"][0]["lr"] = 0.05
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr() != w.data_ptr()  # one buffer, reused
    assert (
        second["model"]["w"].tolist() == [10.0, 11.0, 12.0, 13.0]
        and second["optimizers"][0]["param_groups"][0]["lr"] == 0.05
    )
    w.add_(1)
    assert second["model"]["w"].tolist() == [10.0, 11.0, 12.0, 13.0]  # training goes on; the staged copy stays
    state["optimizers"][0]["state"]["w"]["exp_avg"] = torch.zeros(4)  # new optimizer state: a new layout
    third = stager.stage(state)
    assert (
        third["optimizers"][0]["state"]["w"]["exp_avg"].tolist() == [0.0] * 4
        and third["model"]["w"].tolist()[0] == 11.0
    )
