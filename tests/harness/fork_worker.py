"""A torchrun worker's stand-in: asks the harness's fork server (tests/harness/zygote.py) to fork the worker's program
with this process's environment, working directory and output, then lives as long as it does.

The harness's torchrun launches set ``PYTHON_EXEC`` (the interpreter torchrun starts its workers with) to a wrapper
that runs ``python -S fork_worker.py``, and the server's socket in ``KEEL_TEST_ZYGOTE``: the agent starts this small
program (standard library only, ``-S``: about 20 ms) where it would have started ``python -u SCRIPT ARGS`` (3 s of
imports here), and it stands for the worker:

* it exits with the worker's exit code, or dies of the worker's signal, so the agent sees what it would have seen;
* a signal it gets (the agent's SIGTERM to its process group, a test's SIGINT) goes to the worker's process group;
* if it is SIGKILLed, the server kills the worker's group (it watches this process through a pidfd);
* the worker's ``os.getppid()`` is this process's parent, the agent, as a real worker's is.

Where the server cannot fork for this environment (a variable read at start-up differs: zygote.FORK_SAFE), or has
gone away, it replaces itself with the real ``python -u SCRIPT ARGS``.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _exec_python(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def main() -> None:
    argv = sys.argv[1:]  # what torchrun gives its python: -u SCRIPT ARGS, or -u -m MODULE ARGS
    path = os.environ.get("KEEL_TEST_ZYGOTE")
    if not path or argv[:1] != ["-u"]:
        _exec_python(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = {
            "argv": argv[1:],
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "ppid": os.getppid(),
            "watch": os.getpid(),
        }
        socket.send_fds(conn, [json.dumps(request).encode()], [1, 2])
        reader = conn.makefile("rb")
        child = int(json.loads(reader.readline())["pid"])  # no pid: refused (a variable read at start-up differs)
    except (OSError, ValueError, KeyError):
        conn.close()
        _exec_python(argv)
        return

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(child, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    line = reader.readline()
    if not line:  # the server died: so did what it forked (SIGKILL of the whole group, from the harness)
        os.kill(os.getpid(), signal.SIGKILL)
    code = os.waitstatus_to_exitcode(json.loads(line)["status"])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
