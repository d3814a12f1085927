"""Every import path a Lightning program writes resolves after the rewrite ``lightning`` -> ``callbacks.lightning``
(and ``pytorch_lightning`` -> ``callbacks.lightning``), for the names keel has; every other public name of
Lightning raises keel's error saying what to use instead.

tests/fixtures/lightning_public_names.txt lists Lightning 2.6.6's public ``(module, name)`` pairs (made by
tests/fixtures/make_lightning_names.py from the reference install; Lightning is never installed for these tests).
"""

from __future__ import annotations

import importlib
import itertools
import re
import sys
from pathlib import Path

import pytest

import callbacks.lightning as L
from callbacks import lightning_cli
from callbacks.finetuning import BackboneFinetuning
from callbacks.lightning import _tree
from trainer import Trainer
from trainer.distributed.strategy import DDPStrategy as KeelDDP
from trainer.module import DataModule, TaskModule
from trainer.observability.rank_zero import rank_zero_info, rank_zero_only

NAMES = Path(__file__).resolve().parents[1] / "fixtures" / "lightning_public_names.txt"
GENERIC = "keel's Lightning names have no"  # the message for a name Lightning does not have either


def lightning_pairs() -> list[tuple[str, str]]:
    pairs = []
    for line in NAMES.read_text().splitlines():
        if line and not line.startswith("#"):
            module, _, name = line.partition(" ")
            pairs.append((module, name))
    return pairs


def rewrites(module: str) -> list[str]:
    """The keel module paths a Lightning program's ``module`` becomes: ``lightning.pytorch.X`` is also
    ``pytorch_lightning.X``."""
    if module == "lightning.pytorch" or module.startswith("lightning.pytorch."):
        rest = module.removeprefix("lightning.pytorch")
        return [f"callbacks.lightning.pytorch{rest}", f"callbacks.lightning{rest}"]
    return ["callbacks.lightning" + module.removeprefix("lightning")]


CASES = [(keel, name, module) for module, name in lightning_pairs() for keel in rewrites(module)]


def test_the_fixture_lists_lightning_s_public_api() -> None:
    pairs = lightning_pairs()
    assert len(pairs) > 300 and len(set(pairs)) == len(pairs)
    for expected in [
        ("lightning", "Trainer"),
        ("lightning", "Fabric"),
        ("lightning.fabric", "Fabric"),
        ("lightning.pytorch", "cli_lightning_logo"),
        ("lightning.pytorch.callbacks", "BackboneFinetuning"),
        ("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint"),
        ("lightning.pytorch.loggers.tensorboard", "TensorBoardLogger"),
        ("lightning.pytorch.utilities.rank_zero", "rank_zero_only"),
        ("lightning.pytorch.utilities.types", "STEP_OUTPUT"),
        ("lightning.pytorch.cli", "LightningCLI"),
        ("lightning.pytorch.tuner", "Tuner"),
        ("lightning.pytorch.loops", ""),
    ]:
        assert expected in pairs, expected


def _keel_message(exc: BaseException) -> str:
    text = str(exc)
    assert text.startswith("keel has no "), f"not keel's message: {type(exc).__name__}: {text}"
    assert GENERIC not in text and len(text.split(": ", 1)[1]) > 15, text  # says what to use instead
    return text


@pytest.mark.parametrize(("keel", "name", "lightning"), CASES, ids=[f"{k}:{n}" for k, n, _ in CASES])
def test_every_lightning_name_resolves_or_says_what_to_use(keel: str, name: str, lightning: str) -> None:
    try:
        module = importlib.import_module(keel)
    except ImportError as exc:  # a module keel has nothing of
        _keel_message(exc)
        assert _tree.lacking_module(keel.removeprefix("callbacks.lightning").strip(".").removeprefix("pytorch.")), keel
        with pytest.raises(ImportError, match="^keel has no "):
            exec(f"from {keel} import {name or '*'}", {})
        return
    if not name:
        return
    scope: dict[str, object] = {}
    try:
        exec(f"from {keel} import {name}", scope)
    except ImportError as exc:
        _keel_message(exc)
        with pytest.raises(AttributeError) as attribute:
            getattr(module, name)
        assert str(attribute.value) == str(exc)
        return
    assert getattr(module, name) is scope[name]


def test_the_specific_import_forms() -> None:
    from callbacks.lightning.loggers import CSVLogger  # from pytorch_lightning.loggers import CSVLogger
    from callbacks.lightning.pytorch.callbacks import BackboneFinetuning as BF
    from callbacks.lightning.pytorch.callbacks import ModelCheckpoint
    from callbacks.lightning.pytorch.callbacks.early_stopping import EarlyStopping
    from callbacks.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint as MC
    from callbacks.lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
    from callbacks.lightning.pytorch.core import LightningModule
    from callbacks.lightning.pytorch.core.datamodule import LightningDataModule
    from callbacks.lightning.pytorch.loggers.tensorboard import TensorBoardLogger
    from callbacks.lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
    from callbacks.lightning.pytorch.trainer import Trainer as T
    from callbacks.lightning.pytorch.utilities import rank_zero_only as rzo
    from callbacks.lightning.pytorch.utilities.rank_zero import rank_zero_info as rzi

    assert ModelCheckpoint is MC is L.ModelCheckpoint and BF is BackboneFinetuning
    assert EarlyStopping is L.EarlyStopping
    assert LightningModule is TaskModule and LightningDataModule is DataModule and T is L.Trainer
    assert issubclass(T, Trainer) and T.default_log_name == "lightning_logs"  # keel's Trainer, Lightning's log folder
    assert TensorBoardLogger is L.TensorBoardLogger and CSVLogger is L.CSVLogger
    assert rzo is rank_zero_only and rzi is rank_zero_info
    assert LightningCLI is lightning_cli.LightningCLI
    assert LightningArgumentParser is lightning_cli.LightningArgumentParser
    assert SaveConfigCallback is lightning_cli.SaveConfigCallback
    assert ParallelStrategy is L.ParallelStrategy and DDPStrategy is L.DDPStrategy
    assert "LightningCLI" not in L.LACKING


def test_module_forms_are_one_module_object() -> None:
    import callbacks.lightning.pytorch as pl
    import callbacks.lightning.pytorch.callbacks.model_checkpoint

    assert pl is L and L.pytorch is L
    assert importlib.import_module("callbacks.lightning.pytorch.callbacks") is L.callbacks
    assert importlib.import_module("callbacks.lightning.callbacks") is L.pytorch.callbacks
    mc = sys.modules["callbacks.lightning.pytorch.callbacks.model_checkpoint"]
    assert mc is sys.modules["callbacks.lightning.callbacks.model_checkpoint"]
    assert callbacks.lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint is L.ModelCheckpoint
    assert L.utilities.rank_zero.rank_zero_only is rank_zero_only
    assert {"ModelCheckpoint", "BackboneFinetuning"} <= set(dir(L.callbacks))
    from callbacks.lightning.pytorch.callbacks import progress

    assert progress.TQDMProgressBar is L.TQDMProgressBar
    from callbacks.lightning.pytorch.callbacks.stochastic_weight_avg import StochasticWeightAveraging
    from callbacks.lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging

    assert StochasticWeightAveraging is callbacks.StochasticWeightAveraging is L.callbacks.StochasticWeightAveraging
    assert issubclass(EMAWeightAveraging, WeightAveraging) and WeightAveraging is callbacks.WeightAveraging


def test_lacking_names_and_modules_raise_keel_s_error() -> None:
    with pytest.raises(ImportError, match=r"^keel has no lightning\.pytorch\.callbacks\.ModelPruning: "):
        from callbacks.lightning.pytorch.callbacks import ModelPruning  # noqa: F401
    with pytest.raises(AttributeError, match="torch.nn.utils.prune"):
        L.pytorch.callbacks.ModelPruning  # noqa: B018
    with pytest.raises(ImportError, match="^keel has no .*Fabric: write the loop with torch"):
        from callbacks.lightning import Fabric  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"^keel has no lightning\.pytorch\.accelerators: .*accelerator="):
        import callbacks.lightning.pytorch.accelerators  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"^keel has no lightning\.pytorch\.plugins: .*precision="):
        importlib.import_module("callbacks.lightning.plugins.precision")
    with pytest.raises(AttributeError, match=r"^keel has no lightning\.pytorch\.loops: "):
        L.loops  # noqa: B018
    with pytest.raises(AttributeError, match=r"callbacks\.pruning: use `torch\.nn\.utils\.prune`"):
        L.callbacks.pruning  # noqa: B018
    # a name Lightning does not have either: the names keel has, for a typo
    with pytest.raises(ImportError, match=r"no lightning\.pytorch\.callbacks\.ModelCheckpiont; available: .*Model"):
        from callbacks.lightning.pytorch.callbacks import ModelCheckpiont  # noqa: F401
    with pytest.raises(AttributeError, match="available"):
        L.NoSuchThing  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="is not a module: import it with `from "):
        importlib.import_module("callbacks.lightning.pytorch.callbacks.ModelCheckpoint")
    assert not hasattr(L.callbacks, "__wrapped__") and not hasattr(L.callbacks, "_private")


def test_every_lacking_entry_is_a_name_or_module_of_lightning() -> None:
    """The tables hold no stale entries: each is in the fixture (or keel's own fallback for the CLI's names)."""
    pairs = lightning_pairs()
    names = {name for _, name in pairs}
    modules = {m.removeprefix("lightning.pytorch").removeprefix("lightning").strip(".") for m, _ in pairs}
    assert not [k for k in _tree.LACKING if k.rpartition(".")[2] not in names and k != "LightningLite"]
    assert not [m for m in _tree.LACKING_MODULES if m not in modules]
    assert not [m for m in _tree.PROVIDED if m not in modules]
    assert all(name in _tree.TARGETS for names in _tree.PROVIDED.values() for name in names)


def test_lightning_strategy_classes_build_keel_s_strategies_with_their_settings() -> None:
    """``DDPStrategy(find_unused_parameters=True)`` and ``FSDPStrategy(auto_wrap_policy={Block}, ...)`` as Lightning
    programs write them build keel's strategies; ``isinstance`` holds for keel's own; what keel has no equivalent
    for raises naming the argument."""
    import torch
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy

    from callbacks.lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ParallelStrategy
    from trainer.distributed.fsdp import FSDPStrategy as KeelFSDP

    assert isinstance(KeelDDP(), DDPStrategy) and not isinstance(KeelDDP(), FSDPStrategy)
    assert issubclass(KeelDDP, DDPStrategy) and isinstance(KeelFSDP(), FSDPStrategy)
    ddp = DDPStrategy(find_unused_parameters=True, static_graph=False, process_group_backend="gloo")
    assert isinstance(ddp, KeelDDP) and ddp.find_unused_parameters is True
    fsdp = FSDPStrategy(
        auto_wrap_policy={torch.nn.TransformerEncoderLayer, torch.nn.Linear},
        cpu_offload=CPUOffload(offload_params=True),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        state_dict_type="sharded",
        activation_checkpointing_policy={torch.nn.TransformerEncoderLayer},
    )
    assert isinstance(fsdp, KeelFSDP) and fsdp.cpu_offload is True and fsdp.reshard_after_forward is False
    assert fsdp.settings()["units"] == ["Linear", "TransformerEncoderLayer"]
    assert fsdp.settings()["activation_checkpointing"] == ["TransformerEncoderLayer"]
    assert FSDPStrategy().settings() == KeelFSDP().settings()
    hybrid = FSDPStrategy(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    assert hybrid.replicate_size == "auto" and hybrid.reshard_after_forward is True
    assert FSDPStrategy(sharding_strategy="_HYBRID_SHARD_ZERO2").reshard_after_forward is False
    refused = [
        (lambda: DDPStrategy(ddp_comm_hook=print), "DDPStrategy(ddp_comm_hook=<built-in function print>): keel"),
        (lambda: DDPStrategy(start_method="spawn"), "keel does not spawn processes"),
        (lambda: DDPStrategy(bucket_size=3), "DDPStrategy(bucket_size=...): keel's DDP takes find_unused_parameters"),
        (lambda: FSDPStrategy(sharding_strategy="NO_SHARD"), "for NO_SHARD use strategy='ddp'"),
        (lambda: FSDPStrategy(auto_wrap_policy=lambda *a: True), "the set of module classes"),
        (lambda: FSDPStrategy(mixed_precision=object()), "precision='bf16-mixed'"),
    ]
    for build, expected in refused:
        with pytest.raises(TypeError) as info:
            build()
        assert expected in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=r"process_group_backend='nccl'\) on cpu: keel uses 'gloo'"):
        Trainer(logger=False, strategy=FSDPStrategy(process_group_backend="nccl"), accelerator="cpu")
    with pytest.raises(TypeError, match=r"strategy='auto'\) instead of SingleDeviceStrategy"):
        L.SingleDeviceStrategy()
    one = Trainer(logger=False, enable_progress_bar=False, strategy=DDPStrategy(find_unused_parameters=True))
    assert isinstance(one.strategy, L.SingleDeviceStrategy) and not isinstance(one.strategy, ParallelStrategy)


def test_utilities_keel_adds_for_lightning_programs() -> None:
    import torch

    from callbacks.lightning.pytorch.utilities import grad_norm
    from callbacks.lightning.pytorch.utilities.exceptions import MisconfigurationException
    from callbacks.lightning.pytorch.utilities.types import STEP_OUTPUT, OptimizerLRScheduler  # noqa: F401

    layer = torch.nn.Linear(2, 1)
    layer(torch.ones(3, 2)).sum().backward()
    norms = grad_norm(layer, norm_type=2)
    # Lightning 2.6.6's keys: grad_2.0_norm/<name> and grad_2.0_norm_total
    assert sorted(norms) == ["grad_2.0_norm/bias", "grad_2.0_norm/weight", "grad_2.0_norm_total"]
    assert torch.allclose(
        norms["grad_2.0_norm_total"], torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    )
    assert grad_norm(torch.nn.Linear(2, 1), 2) == {}
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm(layer, 0)
    assert issubclass(MisconfigurationException, Exception)


def test_cli_lightning_logo_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from callbacks.lightning.pytorch import cli_lightning_logo

    cli_lightning_logo()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "keel" in out


def test_importing_the_names_stays_cheap() -> None:
    """``import callbacks.lightning`` loads neither the CLI (jsonargparse) nor an integration."""
    from launch import import_check

    code = (
        "import sys, callbacks.lightning as L; from callbacks.lightning.pytorch.callbacks import ModelCheckpoint; "
        "print(sorted(m for m in ('jsonargparse', 'callbacks.lightning_cli', 'wandb', 'mlflow') if m in sys.modules))"
    )
    assert import_check(code).stdout.strip() == "[]"


def test_callbacks_lightning_has_no_file_named_like_a_lightning_module() -> None:
    """The finder comes after the ordinary ones: a file in the package would shadow Lightning's module."""
    package = Path(L.__file__).parent
    files = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if p.is_dir()}
    assert all(name.startswith("_") for name in files - {"__pycache__"}), files


def test_the_porting_page_lists_every_name_keel_lacks() -> None:
    """docs/porting.md's table "Not in keel: what to use instead" names each lacking name (and each module keel has
    nothing of) with keel's message."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "porting.md").read_text()
    table = page[page.index("## Not in keel: what to use instead") :]
    missing = []
    for module, name in lightning_pairs():
        keel = rewrites(module)[0]
        try:
            getattr(importlib.import_module(keel), name) if name else None
            continue
        except (ImportError, AttributeError) as exc:
            hint = str(exc).split(": ", 1)[1]
        if f"`{name or module}`" not in table or hint.replace("docs/", "") not in re.sub(
            r"\[(\w+)\]\(\1\.md\)", r"\1.md", table
        ):
            missing.append(f"{module} {name}")
    assert not missing, missing


def test_the_porting_pages_table_is_one_table_naming_only_what_keel_lacks_once() -> None:
    """The table is one block (a blank line inside it ends the table, and the rest renders as a paragraph of `|`),
    and each row names only names keel does not have, each (module, name) once."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "porting.md").read_text()
    section = page[page.index("## Not in keel: what to use instead") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))
    assert not [line for line in lines[first + len(block) :] if line.startswith("|")], "a blank line splits the table"
    seen, present = set(), []
    for row in block[2:]:
        module_cell, names_cell = row.split(" | ")[:2]
        names = re.findall(r"`([^`]+)`", names_cell.split("(and the module")[0])
        for module in re.findall(r"`([^`]+)`", module_cell):
            keel = rewrites(module)[0]
            for name in names:
                assert (module, name) not in seen, f"{module} {name} is listed twice"
                seen.add((module, name))
                try:
                    getattr(importlib.import_module(keel), name)
                except (ImportError, AttributeError):
                    continue
                present.append(f"{module} {name}")
    assert not present, f"the table lists names keel has: {present}"


def test_the_rank_zero_helpers_are_public_in_trainer_and_the_earlier_path_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seed guide's rank-aware logging imports them from keel itself; before the regroup they lived in
    ``trainer.rank_zero``, which still imports, with one warning naming the new home."""
    import importlib
    import sys
    import warnings

    import trainer
    from trainer.observability import rank_zero

    names = ("rank_zero_only", "rank_zero_info", "rank_zero_warn", "rank_zero_debug")
    assert all(getattr(trainer, n) is getattr(rank_zero, n) and n in trainer.__all__ for n in names)
    monkeypatch.delitem(sys.modules, "trainer.rank_zero", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        earlier = importlib.import_module("trainer.rank_zero")
    assert [str(w.message) for w in caught] == [
        "trainer.rank_zero moved: import the rank-zero helpers from trainer (from trainer import rank_zero_only, "
        "rank_zero_info, rank_zero_warn, rank_zero_debug)."
    ]
    assert all(getattr(earlier, n) is getattr(rank_zero, n) for n in names)
