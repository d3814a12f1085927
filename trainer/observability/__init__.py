"""What a run tells the person watching it.

* :mod:`~trainer.observability.rank_zero`: per-rank Python logging and the rank-zero helpers.
* :mod:`~trainer.observability.progress`: the console progress bar (tqdm on a terminal, log lines elsewhere).
* :mod:`~trainer.observability.profiler`: ``Trainer(profiler="simple" | "pytorch")`` with Lightning's API.
* :mod:`~trainer.observability.phases`: per-rank phase times, always on, and the slow-run diagnosis.

May import: torch, :mod:`trainer.callback` (the progress bar is a callback), :mod:`trainer.data.transfer`.
Never :mod:`trainer.distributed`: what must agree across ranks is decided elsewhere.
"""
