"""Ignores SIGTERM and starts a grandchild in a new session that ignores SIGTERM too.

Writes "<own pid> <grandchild pid>" to <dir>/stubborn.pid, then sleeps forever:
models a wedged launcher whose worker escaped its process group.
"""

import os
import signal
import subprocess
import sys
import time

out_dir = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"],
    start_new_session=True,
)
tmp = os.path.join(out_dir, "stubborn.pid.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
os.replace(tmp, os.path.join(out_dir, "stubborn.pid"))
sys.stdout.write("stubborn: ignoring SIGTERM\n")
sys.stdout.flush()
time.sleep(1000)
