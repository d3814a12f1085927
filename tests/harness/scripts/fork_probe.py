"""What a launched program sees of its interpreter, as one JSON line, then what argv[2] asks for.

    python fork_probe.py OUT ok          # print the state, exit 0
    python fork_probe.py OUT exit        # exit 3 through sys.exit
    python fork_probe.py OUT raise       # an uncaught ValueError from a function of this file
    python fork_probe.py OUT orphan      # fork a child that outlives this process (its pid in OUT/orphan.pid)

tests/integration/test_launch.py compares a launch forked from the harness's preloaded server with a fresh
interpreter (KEEL_TEST_FORK=0).
"""

import sys

PRELOADED = "torch" in sys.modules  # before this program imports anything: forked from the harness's server

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
state = {
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "pythonpath": [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p in sys.path],
    "cwd": os.getcwd(),
    "probe": os.environ.get("KEEL_PROBE"),
    "session_leader": os.getsid(0) == os.getpid(),
    "random": random.random(),
    "numpy": float(np.random.random()),
    "hash": hash("keel"),
    "stdin": sys.stdin.read(),
    "main_file": sys.modules["__main__"].__file__,
    "preloaded": PRELOADED,
    "rank": os.environ.get("RANK"),
    "parent": os.getppid(),
}
print(json.dumps(state), flush=True)
print("to stderr", file=sys.stderr, flush=True)


def fail() -> None:
    raise ValueError("probe failure")


if mode == "exit":
    sys.exit(3)
elif mode == "raise":
    fail()
elif mode == "orphan":
    pid = os.fork()
    if pid == 0:
        time.sleep(1000)
        os._exit(0)
    with open(os.path.join(out, "orphan.pid"), "w") as f:
        f.write(str(pid))
