"""The LightningCLI program of the tests (tests/harness/scripts/lightning_cli_prog.py) and what both its
in-process tests (tests/unit/test_lightning_cli_in_process.py) and its launched ones
(tests/integration/test_lightning_cli.py) expect of it. The constant marked "Lightning 2.6.6" was measured by
running the same program under Lightning 2.6.6."""

from __future__ import annotations

import importlib.util

import pytest
from launch import REPO_ROOT

HAS_JSONARGPARSE = importlib.util.find_spec("jsonargparse") is not None
needs_jsonargparse = pytest.mark.skipif(not HAS_JSONARGPARSE, reason="the cli extra (jsonargparse) is not installed")

PROG = REPO_ROOT / "tests" / "harness" / "scripts" / "lightning_cli_prog.py"

QUIET = ["--trainer.enable_model_summary=false"]

# Lightning 2.6.6: `fit` with the default logger writes config.yaml here, under default_root_dir (the cwd).
LIGHTNING_CONFIG_PATH = "lightning_logs/version_0/config.yaml"
