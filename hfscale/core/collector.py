"""The cyclic garbage collector in a trial's own process, kept off the training stack it imports.

After ``from transformers import Trainer`` the collector tracks about 420,000 objects (torch's and transformers'
modules, functions, type caches), every one alive until the process ends. CPython's collector scans them again and
again for nothing: six full collections while they are imported, one more inside ``trainer.train()`` (0.28 s of a
tiny trial's ``train_setup`` phase, against 0.03 s without it) and a last one at exit. A sweep pays that in every
rank of every run, and a full collection that lands in a timed step is a step-time outlier.

Measured on 2 idle CPU cores (Python 3.11, torch 2.13, transformers 5.24), runs interleaved: a process that imports
the Trainer and exits took 3.91-4.03 s, 3.20-3.39 s with :func:`skip_final_collection` before exit (five runs each,
2026-11-27); one tiny BERT trial process (``python -m hfscale.trial``, the suite's shared sweep) with that exit took
4.92-4.99 s, and 3.74-3.81 s with :func:`frozen_after_imports` around its imports as well (three runs each,
2026-11-28), its ``imports`` phase 3.3-3.5 s against 2.65-2.68 s. Peak memory was the same (0.5427 and 0.5425 GiB),
as were the step times.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_after_imports() -> Iterator[None]:
    """Import in the block with the collector paused; then collect once and freeze what is alive.

    For the entry point of a process that is hfscale's own (a trial rank), around the imports and before any user
    code runs: every object then alive is a module's or a library's, and stays alive as long as the process, so
    ``gc.freeze`` only spares later collections the scan of it. What the imports left in reference cycles is
    collected first, as the collector would have. Never in a process that goes on with objects of its own (a test
    process, a notebook): those would be frozen too, and never collected.
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


def skip_final_collection() -> None:
    """Make the garbage collection at interpreter exit cheap: collect now, then freeze what is alive.

    For a process's entry point, once its work is written, just before it returns its exit status, and only where
    the process ran no user code (a script, a factory): never in a process that goes on, since frozen objects are
    never collected. The collection first finalises what the run left in reference cycles; ``gc.freeze`` then moves
    every live object out of the collector's sight, so exit frees them by reference counting only. ``atexit``
    handlers (logging's flush, a tracker's finish) still run and the standard streams are still flushed. What is
    lost: the finalisers of objects still alive at exit and reachable only through a cycle (a class's attributes, a
    registry's entries), which exit's collection would have run; a buffered file held that way is not flushed.
    hfscale's own files are written and closed before this is called.
    """
    gc.collect()
    gc.freeze()
