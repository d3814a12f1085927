"""Where the Hydra config tree lives, for a wheel install and for a source checkout alike."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def config_dir() -> str:
    """The absolute path of keel's Hydra config folder.

    ``<package dir>/conf`` when it exists: ``pip install .`` copies the repository's top-level ``conf/``
    there (setup.py). Otherwise ``<repo root>/conf``: a source checkout or an editable install, where
    ``recipes/`` sits next to ``conf/``.

    Raises:
        FileNotFoundError: Neither folder exists; the message names both.
    """
    packaged = _PACKAGE_DIR / "conf"
    if packaged.is_dir():
        return str(packaged)
    checkout = _PACKAGE_DIR.parent / "conf"
    if checkout.is_dir():
        return str(checkout)
    raise FileNotFoundError(
        f"keel's Hydra configs are missing: neither {packaged} (installed package) nor {checkout} (source "
        "checkout) exists. Reinstall with `pip install .` or run from a checkout."
    )
