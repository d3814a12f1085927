"""On several ranks, an error that ends the program is one console line per rank; the tracebacks go to files.

Every rank of a failed torchrun or SLURM job prints its own traceback (torchrun prefixes each line with
``[rankN]:``): over a hundred lines for one error on two ranks, where the message that matters is easy to miss.
When a stage of a multi-rank run raises, the Trainer writes the rank's full traceback to ``failure-rank<N>.log`` in
the run directory (:func:`record`), and the process's ``sys.excepthook`` then prints, if the error ends the
program, one line naming the rank, the error, where it was raised and that file. The launcher's own summary
(torchrun's "Root Cause") gets the same line through the error file torchrun asks each worker to write.

A program that catches the error sees it unchanged; ``KEEL_FULL_TRACEBACK=1`` prints Python's traceback as usual.
One process is left alone: there the traceback is what the user expects to read.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from types import TracebackType

_MARK = "_keel_failure"  # set on the exception: (rank, traceback file)
_installed = False


def _folder(run_dir: str | None) -> str:
    """Where the traceback file goes: the run directory, or a local folder when it is on object storage or not
    known yet (the failure came before the loggers picked their version)."""
    if run_dir and "://" not in run_dir:  # a URL (object storage) is never a local folder
        return run_dir
    return os.path.join(tempfile.gettempdir(), "keel-failures")


def record(exc: BaseException, *, rank: int, run_dir: str | None) -> str | None:
    """Write ``exc``'s traceback to ``failure-rank<rank>.log`` and mark ``exc`` so that the hook prints one line for
    it. Returns the file (None when it could not be written: the error itself is never hidden by this)."""
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a failure to report
        return None
    folder = _folder(run_dir)
    path = os.path.join(folder, f"failure-rank{rank}.log")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as out:
            out.write(f"rank {rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            out.write("".join(traceback.format_exception(exc)))
        setattr(exc, _MARK, (rank, path))
    except Exception:
        return None
    install()
    return path


def one_line(exc: BaseException, tb: TracebackType | None) -> str:
    """``keel: rank 1 failed: ValueError: bad batch (train.py:7 in training_step); traceback in PATH``."""
    rank, path = getattr(exc, _MARK)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    frames = traceback.extract_tb(tb) if tb is not None else []
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    error = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"keel: rank {rank} failed: {error}{where}; traceback in {path}"


def _write_launcher_error_file(line: str) -> None:
    """torchrun's summary reads each worker's error file (``TORCHELASTIC_ERROR_FILE``): give it the one line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as out:
            json.dump(data, out)
    except OSError:
        pass


def install() -> None:
    """Put the one-line hook in front of ``sys.excepthook`` (once per process)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if getattr(value, _MARK, None) is None or os.environ.get("KEEL_FULL_TRACEBACK") == "1":
            previous(kind, value, tb)
            return
        line = one_line(value, tb)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        _write_launcher_error_file(line)

    sys.excepthook = hook
    _installed = True
