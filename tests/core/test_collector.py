"""The collector kept off the training stack: imports frozen once done, and an exit without the final scan."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import atexit, sys
from pathlib import Path
from hfscale.core.collector import skip_final_collection

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


FROZEN_PROBE = """
import gc, sys
from pathlib import Path
from hfscale.core.collector import frozen_after_imports

out = Path(sys.argv[1])

class Garbage:  # left in a reference cycle by an import: collected before the freeze, as the collector would
    def __del__(self):
        (out / "garbage-finalised").write_text("yes")

with frozen_after_imports():
    paused = not gc.isenabled()
    import json, email.parser  # noqa: F401 (modules, as an import of the training stack leaves them)
    g = Garbage()
    g.me = g
    del g
print(paused, gc.isenabled(), gc.get_freeze_count() > 1000, end=" ")
gc.disable()
with frozen_after_imports():
    pass
print(gc.isenabled(), end="")
"""


def test_imports_run_with_the_collector_paused_then_their_garbage_is_collected_and_the_rest_frozen(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", FROZEN_PROBE, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    # Paused inside, enabled again after, what was alive frozen; a collector disabled before stays disabled.
    assert done.stdout == "True True True False", done.stderr
    assert (tmp_path / "garbage-finalised").read_text() == "yes"  # a freeze without the collection would keep it
