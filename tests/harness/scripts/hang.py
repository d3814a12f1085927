"""Every rank writes "<pid> <parent pid>" to <dir>/rank<R>.pid, then sleeps forever."""

import os
import sys
import time

out_dir = sys.argv[1]
rank = os.environ.get("RANK", "0")
tmp = os.path.join(out_dir, f"rank{rank}.pid.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}\n")
os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pid"))
sys.stdout.write(f"rank {rank} hanging\n")
sys.stdout.flush()
time.sleep(1000)
