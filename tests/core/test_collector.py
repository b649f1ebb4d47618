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


EXIT_PROBE = """
import atexit, sys, threading, time
from pathlib import Path
from hfscale.core.collector import exit_without_teardown

out = Path(sys.argv[1])

class Finalised:  # alive at exit: the ordinary teardown finalises it, exit_without_teardown does not
    def __del__(self, done=out / "teardown-ran"):
        done.write_text("yes")

keep = Finalised()
atexit.register(lambda: (out / "exit-handler-ran").write_text("yes"))
if sys.argv[2] == "thread":  # a thread the interpreter waits for: the ordinary exit, after it
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread-finished").write_text("yes"))).start()
sys.stdout.write("buffered, not yet written")
exit_without_teardown(3)
"""


def _ended(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = tmp_path / mode
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(out), mode], capture_output=True, text=True)
    return done, {p.name for p in out.iterdir()}


def test_a_rank_ends_with_its_code_exit_handlers_and_output_but_no_teardown(tmp_path):
    done, left = _ended(tmp_path, "alone")
    assert done.returncode == 3 and done.stdout == "buffered, not yet written", done.stderr
    assert left == {"exit-handler-ran"}  # the interpreter's teardown (finalising what is alive) was skipped


def test_a_thread_the_interpreter_would_wait_for_keeps_the_ordinary_exit(tmp_path):
    done, left = _ended(tmp_path, "thread")
    assert done.returncode == 3 and done.stdout == "buffered, not yet written", done.stderr
    assert left == {"thread-finished", "exit-handler-ran", "teardown-ran"}  # the teardown the other test skips
