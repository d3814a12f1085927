"""Stands in for a run that saves, then dies of gloo's known abort (tests/harness/launch.py KNOWN_ABORT) on its first
attempt: ``abort_once.py STATE OUT [URL]``. Each attempt needs STATE/keep (and removes it), counts one up in
STATE/count, writes OUT/saw with the count it found (OUT must not exist yet) and adds a line to STATE's sibling
attempts.log, which no argument names. The first attempt then aborts with the known text; with a URL argument
every attempt does."""

import os
import sys
from pathlib import Path

state, out = Path(sys.argv[1]), Path(sys.argv[2])
attempts = state.parent / "attempts.log"
first = not attempts.exists()
with attempts.open("a") as log:
    log.write("attempt\n")
(state / "keep").unlink()  # FileNotFoundError where a retry did not get it back
count = int((state / "count").read_text())
(state / "count").write_text(str(count + 1))
out.mkdir()  # FileExistsError where a retry found the first attempt's output
(out / "saw").write_text(str(count))
if first or len(sys.argv) > 3:
    sys.stderr.write("terminate called without an active exception\n")
    sys.stderr.flush()
    os.abort()
