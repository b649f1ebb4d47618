"""The collector kept off the training stack: paused while it is imported, then frozen out of its sight."""

from __future__ import annotations

import subprocess
import sys

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
print(gc.isenabled(), end=" ")
gc.unfreeze()
gc.enable()
try:
    with frozen_after_imports():
        raise ImportError("a missing library")
except ImportError:
    print(gc.isenabled(), gc.get_freeze_count() == 0, end="")
"""


def test_imports_run_with_the_collector_paused_then_their_garbage_is_collected_and_the_rest_frozen(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", FROZEN_PROBE, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    # Paused inside, enabled again after, what was alive frozen; a collector disabled before stays disabled; an
    # import that raises freezes nothing and leaves the collector as it was.
    assert done.stdout == "True True True False True True", done.stderr
    assert (tmp_path / "garbage-finalised").read_text() == "yes"  # a freeze without the collection would keep it
