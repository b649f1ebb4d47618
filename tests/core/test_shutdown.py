"""A process that ends with ``skip_final_collection`` exits as it would have, minus the collector's work."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import atexit, sys
from pathlib import Path
from hfscale.core.shutdown import skip_final_collection

out = Path(sys.argv[1])

class Garbage:  # left in a reference cycle by the run: finalised, as at any exit
    def __del__(self):
        (out / "garbage-finalised").write_text("yes")

g = Garbage()
g.me = g
del g
atexit.register(lambda: (out / "atexit-ran").write_text("yes"))
skip_final_collection()
import gc
print("printed before exit", gc.get_freeze_count() > 1000, end="")
"""


def test_the_runs_garbage_is_finalised_atexit_runs_and_output_is_flushed(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout == "printed before exit True"  # what was alive is frozen: exit does not scan it
    assert (tmp_path / "garbage-finalised").read_text() == "yes"  # gc.freeze alone would never finalise it
    assert (tmp_path / "atexit-ran").read_text() == "yes"
    assert done.stderr == ""
