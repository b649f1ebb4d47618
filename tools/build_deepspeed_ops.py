"""Build the DeepSpeed ops the CPU test suite loads, once, before the tests run (tox's ``commands_pre``).

DeepSpeed JIT-compiles an op the first time a process loads it (about a minute each on 2 cores) into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), and every later process loads
the built library. Without this step the first test that happens to load each op pays its build inside its own
timing, and two tests loading the same op at once wait on the build's lock. The ops: ``cpu_adam`` (ZeRO-Offload's
optimizer), ``fused_adam`` (DeepSpeed's Adam on the CPU accelerator) and ``deepspeed_shm_comm`` (its shared-memory
collectives between processes of one machine).

Prints each op with the seconds its load took (a few hundredths when it was already built). Without deepspeed
installed it says so and exits 0: the tests that need it are skipped then.

torch guards a build with an empty ``lock`` file in the op's build folder, removed by the process that made it; a
build killed midway (an interrupted tox run) leaves it, and every later load then waits on it forever (seen: a CI
run stalled 12 minutes on one). A lock older than any build takes (:data:`STALE_LOCK_S`) is removed first, and said.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")
STALE_LOCK_S = 20 * 60
"""Older than this, a build lock is a killed build's: one op builds in about a minute on 2 cores."""


def extensions_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else ``torch_extensions`` in the user's cache."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(given) if given else Path(cache) / "torch_extensions"


def remove_stale_locks(root: Path, *, now: float | None = None) -> list[Path]:
    """Remove build locks under ``root`` (``PYTHON_TAG/OP/lock``) older than :data:`STALE_LOCK_S`; returns them."""
    now = time.time() if now is None else now
    stale = [lock for lock in root.glob("*/*/lock") if now - lock.stat().st_mtime > STALE_LOCK_S]
    for lock in stale:
        lock.unlink(missing_ok=True)
        print(f"removed a stale build lock (a killed build's): {lock}")
    return stale


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("deepspeed is not installed: nothing to build")
        return 0
    remove_stale_locks(extensions_root())
    accelerator = get_accelerator()
    for name in OPS:
        start = time.perf_counter()
        accelerator.create_op_builder(name).load()
        print(f"{name}: loaded in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
