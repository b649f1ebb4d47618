"""Build the DeepSpeed ops the CPU test suite loads, once, before the tests run (tox's ``commands_pre``).

DeepSpeed JIT-compiles an op the first time a process loads it (about a minute each on 2 cores) into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), and every later process loads
the built library. Without this step the first test that happens to load each op pays its build inside its own
timing, and two tests loading the same op at once wait on the build's lock. The ops: ``cpu_adam`` (ZeRO-Offload's
optimizer), ``fused_adam`` (DeepSpeed's Adam on the CPU accelerator) and ``deepspeed_shm_comm`` (its shared-memory
collectives between processes of one machine).

Prints each op with the seconds its load took (a few hundredths when it was already built). Without deepspeed
installed it says so and exits 0: the tests that need it are skipped then.
"""

from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("deepspeed is not installed: nothing to build")
        return 0
    accelerator = get_accelerator()
    for name in OPS:
        start = time.perf_counter()
        accelerator.create_op_builder(name).load()
        print(f"{name}: loaded in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
