"""The import hook that lays Lightning's module tree over ``callbacks.lightning``.

After the rewrite ``lightning`` -> ``callbacks.lightning`` (``pytorch_lightning`` -> ``callbacks.lightning``), a
program imports ``callbacks.lightning.pytorch.callbacks.model_checkpoint`` or ``callbacks.lightning.loggers``:
modules no file defines. :class:`LightningFinder` (on ``sys.meta_path``, after the ordinary finders) makes each
of Lightning's modules keel has (``_tree.PROVIDED``) a :class:`LightningNamespace` whose names resolve to keel's
objects on first use; ``callbacks.lightning.pytorch.X`` is the same module object as ``callbacks.lightning.X``.
That works for ``import a.b.c``, ``from a.b import c`` and ``importlib.import_module`` alike.

What keel lacks fails at once with what to use instead: importing a module keel has nothing of raises
``ModuleNotFoundError``, a missing name raises ``AttributeError`` on attribute access and ``ImportError`` in
``from ... import`` (Python asks the finder for ``<module>.<name>`` when the attribute is missing, and the finder
raises with keel's message; a bare ``AttributeError`` would become Python's message without it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

from callbacks.lightning import _tree

PACKAGE = "callbacks.lightning"


def resolve(path: str, name: str) -> Any:
    """Keel's object for Lightning's ``name`` in module ``path``.

    Raises:
        LookupError: keel has no such name there (the message is keel's, saying what to use instead).
    """
    if name in _tree.PROVIDED.get(path, ()):
        module, _, attr = _tree.TARGETS[name].partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except AttributeError:  # an optional target its module does not define (yet): treated as lacking
            pass
    raise LookupError(not_found(path, name))


def not_found(path: str, name: str, available: Sequence[str] = ()) -> str:
    """The message for Lightning's ``path.name`` that keel does not provide."""
    hint = _tree.lacking_name(path, name)
    if hint is not None:
        return f"keel has no {_tree.lightning_name(path, name)}: {hint}"
    names = sorted(available or _tree.PROVIDED.get(path, ()))
    return f"keel's Lightning names have no {_tree.lightning_name(path, name)}; available: {names}."


def submodule(path: str, name: str) -> types.ModuleType | None:
    """Lightning's module ``path.name`` as keel has it, or None when it is not one of Lightning's modules.

    Raises:
        AttributeError: it is a module keel has nothing of (the message says what to use instead).
    """
    child = f"{path}.{name}" if path else name
    if _tree.is_module(child):
        return importlib.import_module(f"{PACKAGE}.{child}")
    if child in _tree.LACKING_MODULES:
        raise AttributeError(f"keel has no {_tree.lightning_name(child)}: {_tree.LACKING_MODULES[child]}")
    return None


class LightningNamespace(types.ModuleType):
    """One of Lightning's modules holding keel's objects under Lightning's names, each imported on first use."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, f"Lightning's ``{_tree.lightning_name(path)}``: keel's objects under its names.")
        self.__path__: list[str] = []  # a package: `import M.sub` and `from M import x` reach the finder
        self.__all__ = sorted(_tree.PROVIDED.get(path, ()))
        self._lightning_path = path

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # dunders Python probes for, and Lightning's private names
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        module = submodule(self._lightning_path, attr)
        if module is not None:
            return module
        try:
            value = resolve(self._lightning_path, attr)
        except LookupError as exc:
            raise AttributeError(str(exc)) from None
        setattr(self, attr, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__all__})

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (Lightning's {_tree.lightning_name(self._lightning_path)}, keel's names)>"


class _NamespaceLoader(importlib.abc.Loader):
    def __init__(self, path: str) -> None:
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return LightningNamespace(spec.name, self.path)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the names resolve on first use."""


class _AliasLoader(importlib.abc.Loader):
    """``callbacks.lightning.pytorch.X``: the module ``callbacks.lightning.X`` itself (Python keeps what
    ``exec_module`` leaves in ``sys.modules``)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class LightningFinder(importlib.abc.MetaPathFinder):
    """Finds ``callbacks.lightning.<Lightning's module path>``; see the module docstring."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + "."):
            return None
        rest = fullname[len(PACKAGE) + 1 :]
        if rest.startswith("_"):
            return None  # keel's own modules of the package (files)
        lightning_path = rest.removeprefix("pytorch.")
        if _tree.is_module(lightning_path):
            if lightning_path != rest:
                loader: importlib.abc.Loader = _AliasLoader(f"{PACKAGE}.{lightning_path}")
            else:
                loader = _NamespaceLoader(lightning_path)
            return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
        refuse(lightning_path)


def refuse(path: str) -> NoReturn:
    """Raise keel's error for importing Lightning's ``path``: a module keel has nothing of, or a name that keel
    lacks (``from M import name`` tries ``M.name`` as a module when ``M`` has no attribute ``name``)."""
    hint = _tree.lacking_module(path)
    if hint is not None:
        raise ModuleNotFoundError(f"keel has no {_tree.lightning_name(path)}: {hint}")
    parent, _, name = path.rpartition(".")
    if parent == "" or _tree.is_module(parent):
        if name in _tree.PROVIDED.get(parent, ()):
            try:
                resolve(parent, name)
            except LookupError as exc:  # an optional target that is not there
                raise ImportError(str(exc)) from None
            raise ModuleNotFoundError(
                f"{_tree.lightning_name(parent, name)} is not a module: import it with "
                f"`from {PACKAGE}.{parent or 'pytorch'} import {name}`."
            )
        from callbacks import lightning

        raise ImportError(not_found(parent, name, lightning.NAMES if parent == "" else ()))
    raise ModuleNotFoundError(
        f"keel has no {_tree.lightning_name(path)}: it is not one of Lightning's public modules that keel knows "
        "(docs/porting.md lists what keel has)."
    )


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the ordinary finders: the package's own files win)."""
    if not any(isinstance(finder, LightningFinder) for finder in sys.meta_path):
        sys.meta_path.append(LightningFinder())
