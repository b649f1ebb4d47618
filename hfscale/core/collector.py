"""The cyclic garbage collector in a trial's own process, kept off the training stack it imports.

After ``from transformers import Trainer`` the collector tracks about 420,000 objects (torch's and transformers'
modules, functions, type caches), nearly all alive until the process ends. CPython's collector scans them again and
again for nothing: six full collections while they are imported (``gc.get_stats()``), one more inside
``trainer.train()`` and a last one at exit. A sweep pays that in every rank of every run, and a full collection that
lands in a timed step is a step-time outlier. Frozen once imported, they are scanned by none of these. What it
saves, measured: docs/development.md (the suite's time).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn


@contextlib.contextmanager
def frozen_after_imports() -> Iterator[None]:
    """Import in the block with the collector paused; then collect once and freeze what is alive.

    For the entry point of a process that is hfscale's own (a trial rank), around the imports and before any user
    code runs: what is alive then is mostly the modules and what they made, which live as long as the process, so
    ``gc.freeze`` spares every later collection, exit's included, the scan of them. What the imports left in
    reference cycles is collected first, as the collector would have. The price: the few objects of the process's
    own alive at the freeze (its argument parser, the spec, a logging handler) are never collected if they later
    become cyclic garbage (a bound, paid once, not per step); a frozen object alive at exit only through a cycle is
    not finalised then; and ``gc.get_objects()`` and ``gc.get_referrers()`` no longer see frozen objects (a script
    hunting leaked tensors that way still sees its own). Never while objects that may yet die are alive, as inside
    a test or a notebook that goes on. An import that raises leaves nothing frozen and the collector as it was.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.collect()
        gc.freeze()
    finally:
        if was_enabled:
            gc.enable()


def exit_without_teardown(code: int) -> NoReturn:
    """End a process that is hfscale's own once its work is done, skipping the interpreter's teardown: a trial rank
    of a recipe's workload (not a user's script, whose open files and objects may still have work for their
    finalisers), once its result is written and every rank has passed the group's closing barrier.

    What ``sys.exit`` would do next is unload the training stack module by module, finalise the model and the data
    set, and run the C++ destructors of torch's process group, which on CPU sometimes aborts a rank of a
    multi-process run at exit (``terminate called without an active exception``). Measured on a tiny trial: 0.50-0.54
    CPU-seconds of exit against 0.09-0.11 this way (docs/development.md). The exit handlers still run (logging's
    flush among them), and the standard streams are flushed, C's too (DeepSpeed's ops print through C's stdio). A
    thread the interpreter would wait for (not a daemon) keeps the ordinary exit, so that it can finish.
    """
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing left to save
            stream.flush()
    with contextlib.suppress(Exception):  # C's stdio buffers, where a library left output in them
        ctypes.CDLL(None).fflush(None)
    os._exit(code)
