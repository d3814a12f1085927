"""Runnable recipes: Hydra entry points (``python -m recipes.train``) and example tasks.

This package is the only place that calls ``hydra.main`` / ``hydra.utils.instantiate`` (docs/design.md
section 1); it imports ``callbacks`` and ``trainer``, never the other way round.
"""
