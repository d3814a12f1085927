"""``lightning.pytorch.utilities.model_helpers`` under keel: ``is_overridden`` answers as Lightning's does for the
same classes, and ``get_torchvision_model`` is torchvision's ``get_model``.

The expected answers are Lightning 2.6.6's, measured with the reference install: the classes below written against
``lightning.pytorch`` and each case's ``is_overridden`` call printed.
"""

from __future__ import annotations

import functools
import sys
import types
from unittest.mock import Mock

import pytest
import torch

import callbacks.lightning as L
from callbacks.lightning.pytorch.utilities.model_helpers import get_torchvision_model, is_overridden


def deco(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)

    return inner


class Plain(L.LightningModule):
    pass


class Over(L.LightningModule):
    def training_step(self, batch, batch_idx):
        return None

    @deco
    def on_train_epoch_end(self):
        pass


class DM(L.LightningDataModule):
    def train_dataloader(self):
        return []


class CB(L.Callback):
    def on_train_start(self, trainer, pl_module):
        pass


def over_fn(self, batch, batch_idx):
    return None


def with_attribute(name: str, value: object) -> Plain:
    task = Plain()
    setattr(task, name, value)
    return task


# Lightning 2.6.6's answers for the same calls.
LIGHTNING = {
    "plain.training_step": False,
    "over.training_step": True,
    "over.validation_step": False,
    "over.on_train_epoch_end (functools.wraps)": True,
    "partial on the instance": True,
    "Mock(wraps=...) on the instance": True,
    "Mock() on the instance": False,
    "dm.train_dataloader": True,
    "dm.val_dataloader": False,
    "cb.on_train_start": True,
    "cb.on_train_end": False,
    "instance None": False,
    "no such attribute": False,
    "parent given": True,
    "no such method, parent given": False,
}


def test_is_overridden_answers_as_lightning() -> None:
    plain = Plain()
    keel = {
        "plain.training_step": is_overridden("training_step", plain),
        "over.training_step": is_overridden("training_step", Over()),
        "over.validation_step": is_overridden("validation_step", Over()),
        "over.on_train_epoch_end (functools.wraps)": is_overridden("on_train_epoch_end", Over()),
        "partial on the instance": is_overridden(
            "validation_step", with_attribute("validation_step", functools.partial(over_fn, plain))
        ),
        "Mock(wraps=...) on the instance": is_overridden(
            "validation_step", with_attribute("validation_step", Mock(wraps=over_fn))
        ),
        "Mock() on the instance": is_overridden("validation_step", with_attribute("validation_step", Mock())),
        "dm.train_dataloader": is_overridden("train_dataloader", DM()),
        "dm.val_dataloader": is_overridden("val_dataloader", DM()),
        "cb.on_train_start": is_overridden("on_train_start", CB()),
        "cb.on_train_end": is_overridden("on_train_end", CB()),
        "instance None": is_overridden("training_step", None),
        "no such attribute": is_overridden("no_such", Over()),
        "parent given": is_overridden("on_train_start", CB(), L.Callback),
        "no such method, parent given": is_overridden("no_such_method", Over(), L.LightningModule),
    }
    assert keel == LIGHTNING


def test_is_overridden_without_a_parent_to_infer_raises() -> None:
    # Lightning 2.6.6: ValueError("Expected a parent"); keel's message says what to pass.
    with pytest.raises(ValueError, match=r"object is not a LightningModule, .* pass the class .* as `parent=`"):
        is_overridden("x", object())
    with pytest.raises(ValueError, match="Plain has no method 'x'"):
        is_overridden("x", with_attribute("x", over_fn), Plain)


def test_get_torchvision_model_is_torchvisions_get_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def get_model(name: str, **kwargs: object) -> torch.nn.Module:
        calls.append((name, kwargs))
        return torch.nn.Linear(1, 1)

    models = types.SimpleNamespace(get_model=get_model)
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    assert isinstance(get_torchvision_model("resnet18", weights=None, num_classes=3), torch.nn.Linear)
    assert calls == [("resnet18", {"weights": None, "num_classes": 3})]
    monkeypatch.setitem(sys.modules, "torchvision", None)  # not installed
    with pytest.raises(ModuleNotFoundError, match=r"get_torchvision_model\('resnet18'\) needs torchvision"):
        get_torchvision_model("resnet18")
