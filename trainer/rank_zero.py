"""Where keel's rank-zero helpers were before the regroup: they are public in ``trainer`` now
(``from trainer import rank_zero_only``), kept here for programs written against this path, with one warning."""

from __future__ import annotations

import warnings

from trainer.observability.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]

warnings.warn(
    "trainer.rank_zero moved: import the rank-zero helpers from trainer "
    "(from trainer import rank_zero_only, rank_zero_info, rank_zero_warn, rank_zero_debug).",
    FutureWarning,
    stacklevel=2,
)
