"""Ports of public LightningModules, changed only in their imports (tests/unit/test_lightning_modules_one_process.py
and tests/integration/test_lightning_modules.py).

Each module keeps the original code; the one changed line is marked ``# was: ...``. What the originals
download or take from torchvision comes from :mod:`standins` (generated data of the same shapes).
"""
