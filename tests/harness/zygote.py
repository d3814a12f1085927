"""A fork server for the test harness: a Python process that has imported torch once and forks each launched
process from itself, so that a launch skips the 2 to 3 s of imports every fresh interpreter pays here.

Started by tests/harness/launch.py (one per pytest worker, on its first launch) as ``python zygote.py SOCKET``; it
imports :data:`PRELOAD`, prints ``ready`` and serves on the Unix socket ``SOCKET``. A request is one JSON line
(``argv``: the script and its arguments, ``-m module`` or ``-c code`` and theirs; ``env``; ``cwd``; ``ppid``, the
parent the program would have had; ``watch``, a stand-in's pid) with the file descriptors of the launch's output
attached (``SCM_RIGHTS``: one for both streams, or standard output and error). The server forks; the parent answers
``{"pid": N}`` and, when that child exits, ``{"status": S, "cpu": C}`` (a ``waitpid`` status, its CPU seconds) on
the same connection; the child becomes what ``python script args`` would have been:

* a session of its own (``setsid``, as the harness's ``start_new_session=True``), its output on the launch's file,
  standard input from /dev/null, the launch's working directory;
* ``os.environ`` exactly the launch's environment, ``sys.path`` and ``sys.argv`` as the interpreter sets them for
  a script or ``-m``, unbuffered standard streams (the harness sets ``PYTHONUNBUFFERED``);
* Python's and NumPy's global random generators seeded afresh, as a new interpreter's are, and Python's default
  signal handlers;
* the program runs as ``__main__``; an uncaught exception is printed by ``sys.excepthook`` without this file's
  frames and the exit status is 1, ``SystemExit`` and ``KeyboardInterrupt`` exit as the interpreter would, and the
  interpreter's own shutdown (non-daemon threads, ``atexit``, finalizers) runs as in any process.

What a fork cannot give, it refuses: a program whose environment differs from the server's in a variable read when
an interpreter or a library starts (``PYTHONHASHSEED``, ``OMP_NUM_THREADS``, ``LD_PRELOAD``, ``TORCH_LOGS``, ...:
any not in :data:`FORK_SAFE`) is started as a fresh interpreter instead, by the harness (tests/harness/launch.py)
or by a torchrun worker's stand-in (tests/harness/fork_worker.py). ``{"members": MARKER}`` asks which live children
belong to the launch with that ``KEEL_LAUNCH_ID``.

The server itself runs no torch operation (no thread pool exists when it forks) and checks that it has one thread.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading

# What every launched program imports before it trains: torch, its optimizers (which import torch._dynamo), the
# process group and the sharded checkpoint (DCP) modules, NumPy. Third-party modules only: keel's own modules are
# imported by each program, fresh, so the code under test is never the server's copy.
PRELOAD = (
    "numpy",
    "torch",
    "torch.optim",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.run",
    "torch.nn.parallel",
    "torch.utils.data",
)
# What many of them import besides, where installed (the dev extra has them all): the TensorBoard writer, Hydra and
# OmegaConf (the recipes), s3fs. None reads an environment variable when imported: Hugging Face datasets does (HF_*),
# and scikit-learn's datasets start a native thread, so neither is here.
PRELOAD_IF_INSTALLED = ("torch.utils.tensorboard", "omegaconf", "hydra", "s3fs")


# Variables that may differ between the server's environment and a forked program's: those read after start-up (by
# keel, the launcher protocol, the trackers, storage clients, none of which the server imported). Any other difference
# (PYTHONHASHSEED, OMP_NUM_THREADS, LD_PRELOAD, TORCH_LOGS, MALLOC_*: read when an interpreter or a library starts)
# makes the launch a fresh interpreter, so that a test of such a variable gets what it sets.
# TORCHINDUCTOR_CACHE_DIR: set in the test process by torch's compiler once a test compiles, read when a program
# compiles, which the server never does. PYTHON_EXEC: what torchrun starts its workers with (the stand-in).
# Variables that a launcher sets for its workers (torchrun, tests/harness/launch.py's spawn_ranks); the harness also
# keeps them out of the environment it gives a launch, so that a test process started under torchrun does not pass
# its own on.
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
)
FORK_SAFE = frozenset(
    {
        *LAUNCHER_VARS,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "PYTEST_CURRENT_TEST",
        "PYTHONPATH",
        "PYTHON_EXEC",
        "PWD",  # the shells in between (the stand-in's wrapper) set these four
        "OLDPWD",
        "SHLVL",
        "_",
        "COLUMNS",
        "LINES",
        "TERM",
        "NO_COLOR",
        "TMPDIR",
        "TORCHINDUCTOR_CACHE_DIR",
    }
)
FORK_SAFE_PREFIXES = (
    "KEEL_",
    "TORCHELASTIC_",
    "PL_",
    "AWS_",
    "WANDB_",
    "MLFLOW_",
    "_MLFLOW_",
    "HF_",
    "SLURM_",
    "HYDRA_",
)


def unsafe_variables(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables that keep a program with environment ``env`` from being forked from a server started with
    ``base``: those that differ and are not in :data:`FORK_SAFE`."""
    names = set(env) | set(base)
    return sorted(
        name
        for name in names
        if env.get(name) != base.get(name) and name not in FORK_SAFE and not name.startswith(FORK_SAFE_PREFIXES)
    )


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_IF_INSTALLED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit(f"zygote: importing {PRELOAD} started threads; forking from it would be unsafe")
    # What the server imported is never garbage: out of the collector's sight, a forked program's collections and
    # its interpreter's shutdown do not walk it (an exit took 1.1 s after importing torch here, 0.26 s frozen) nor
    # copy its pages.
    gc.freeze()


class _Child:
    """A forked child as the server keeps it: the connection to answer when it exits, the launch it belongs to, and
    the pidfd of the process it stands in for (a torchrun worker's stand-in, tests/harness/fork_worker.py)."""

    def __init__(self, conn: socket.socket, marker: str | None, watch: int | None) -> None:
        self.conn, self.marker, self.watch = conn, marker, watch


class _Server:
    """The server's loop: requests on the socket, stand-ins that die, children that exit."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.children: dict[int, _Child] = {}
        self.base = dict(os.environ)

    def run(self) -> dict:
        """Serve until the harness goes away; in a forked child, return its request."""
        print("ready", flush=True)
        while True:
            for key, _ in self.selector.select(timeout=0.02):
                if key.data is not None:
                    self._stand_in_died(key)
                    continue
                request = self._accept()
                if request is not None:
                    return request
            self._reap()
            if os.getppid() == 1:  # the harness died without closing us
                raise SystemExit(0)

    def _stand_in_died(self, key: selectors.SelectorKey) -> None:
        """What a SIGKILLed stand-in stood for dies with it, as a SIGKILLed worker would."""
        self.selector.unregister(key.fileobj)
        os.close(key.fd)
        child = self.children.get(key.data)
        if child is not None:
            child.watch = None
            _kill_group(key.data)

    def _answer(self, conn: socket.socket, message: dict, fds: tuple[int, ...] | list[int] = ()) -> None:
        conn.sendall(json.dumps(message).encode() + b"\n")
        conn.close()
        for fd in fds:
            os.close(fd)

    def _accept(self) -> dict | None:
        conn, _ = self.listener.accept()
        conn.setblocking(True)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
        request = json.loads(message)
        if "members" in request:  # the harness asks which live children belong to its launch
            marker = request["members"]
            self._answer(conn, {"pids": [pid for pid, child in self.children.items() if child.marker == marker]})
            return None
        unsafe = unsafe_variables(request["env"], self.base)
        if unsafe:  # a stand-in asks for an environment a fork cannot give: it execs the real interpreter
            print(f"zygote: refused {request['argv'][:2]}: {unsafe}", file=sys.stderr, flush=True)
            self._answer(conn, {"refused": unsafe}, fds)
            return None
        started, ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(started)
            self._close_in_child(conn)
            os.setsid()  # before the requester hears of the pid: its signals go to the child's group
            os.close(ready)
            request["fds"] = fds
            return request
        os.close(ready)
        os.read(started, 1)  # EOF once the child has its own session (or has died)
        os.close(started)
        for fd in fds:
            os.close(fd)
        watch = None
        if request.get("watch"):
            try:
                watch = os.pidfd_open(request["watch"])
                self.selector.register(watch, selectors.EVENT_READ, pid)
            except ProcessLookupError:  # the stand-in is gone already
                _kill_group(pid)
        self.children[pid] = _Child(conn, request["env"].get("KEEL_LAUNCH_ID"), watch)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        return None

    def _close_in_child(self, conn: socket.socket) -> None:
        self.selector.close()
        for other in (self.listener, conn, *(child.conn for child in self.children.values())):
            other.close()
        for child in self.children.values():
            if child.watch is not None:
                os.close(child.watch)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            if child.watch is not None:
                self.selector.unregister(child.watch)
                os.close(child.watch)
            try:
                cpu = usage.ru_utime + usage.ru_stime  # the child's and its reaped descendants' CPU seconds
                child.conn.sendall(json.dumps({"status": status, "cpu": round(cpu, 3)}).encode() + b"\n")
            except OSError:
                pass  # the requester is gone; nothing to tell
            child.conn.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _become(request: dict) -> None:
    """Turn this forked child into the process ``python argv...`` would have started."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    fds = request["fds"]
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)  # one file for both, or standard output and error apart
    for fd in set(fds):
        os.close(fd)
    # The parent the program would have had: the test process for the harness's own launches, the torchrun agent
    # for a worker (keel names a run by its agent; a test's worker kills its agent to lose a node).
    ppid = int(request["ppid"])
    os.getppid = lambda: ppid
    for name in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGUSR1", "SIGUSR2", "SIGHUP"):
        signum = getattr(signal, name)
        signal.signal(signum, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    if request["cwd"]:
        os.chdir(request["cwd"])
    import io
    import random
    import tempfile

    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False), errors="backslashreplace", write_through=True
    )
    tempfile.tempdir = None
    random.seed()
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass
    argv = request["argv"]
    base = sys.path[1 + len([p for p in _SERVER_PYTHONPATH.split(os.pathsep) if p]) :]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        first = os.getcwd()
    elif argv[0] == "-c":
        first = ""  # as `python -c`: the current directory, looked up at each import
    else:
        first = os.path.dirname(os.path.realpath(argv[0]))
    sys.path[:] = [first, *extra, *base]


def _run(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0], as -m does
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
    elif argv[0] == "-c":
        import types

        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _main() -> None:
    _preload()
    request = _Server(sys.argv[1]).run()
    _become(request)
    try:
        _run(request["argv"])
    except SystemExit:
        raise
    except BaseException as error:  # what the interpreter does with an uncaught exception, minus our frames
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, _RUNPY, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)  # the hook prints the exception's own traceback
        if isinstance(error, KeyboardInterrupt):
            sys.stdout.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None


_RUNPY = importlib.import_module("runpy").__file__
_SERVER_PYTHONPATH = os.environ.get("PYTHONPATH", "")

if __name__ == "__main__":
    _main()
