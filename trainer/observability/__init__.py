"""What a run tells the person watching it, and where its time goes.

* :mod:`~trainer.observability.rank_zero`: per-rank Python logging and the rank-zero helpers.
* :mod:`~trainer.observability.progress`: the console progress bar (tqdm on a terminal, log lines elsewhere).
* :mod:`~trainer.observability.summary`: the run summary at the end of ``fit``.
* :mod:`~trainer.observability.failures`: a failed rank's one line and its traceback file.
* :mod:`~trainer.observability.profiler`: ``Trainer(profiler="simple" | "pytorch")`` with Lightning's API.
* :mod:`~trainer.observability.phases`: per-rank phase times, always on, and the slow-run diagnosis;
  :mod:`~trainer.observability.goodput`: the job's goodput across restarts; :mod:`~trainer.observability.efficiency`
  wires both into a fit (throughput, MFU, the time budget, ``efficiency.json``).

May import: torch, :mod:`trainer.callback` (the progress bar is a callback), :mod:`trainer.data.transfer`, and, for
efficiency's gathers of every rank's times, :mod:`trainer.distributed.comm` and :mod:`trainer.distributed.launcher`.
What must agree across ranks is decided elsewhere: nothing here changes what a run does.
"""
