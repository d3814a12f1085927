"""The program that runs the ported LightningModules (tests/harness/scripts/lightning_ports_run.py), for its
tests in one process (tests/unit/test_lightning_modules_one_process.py) and on 2 ranks
(tests/integration/test_lightning_modules.py), and whether the ports that need torchmetrics can run."""

from __future__ import annotations

import importlib.util

from launch import REPO_ROOT

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "lightning_ports_run.py"
HAS_TORCHMETRICS = importlib.util.find_spec("torchmetrics") is not None
