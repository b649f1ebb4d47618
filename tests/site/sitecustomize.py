"""Run at the start of every Python process the test suite starts: pytest's workers, and the sweep drivers,
launchers, trial ranks and scripts its tests launch (``tests/conftest.py`` puts this folder first on their
``PYTHONPATH``; a process given an environment of its own, as in the fresh-venv install test and the floors test,
does without).

It raises the garbage collector's first threshold from 700 (CPython 3.11's) to 10,000 allocations: each of those
processes imports the training stack (torch, transformers, accelerate; about 420,000 objects the collector tracks),
and at 700 the collector scans that growing heap over and over while it is imported. A trial's rank freezes its
imports anyway (``hfscale.core.collector``) but then trains at 10,000 too, where a user's trial trains at the
interpreter's threshold: its cyclic garbage is collected less often. Nothing a test asserts depends on when; the
figures (and a tiny trial's, unchanged) are in docs/development.md.
"""

import gc

DEFAULT_THRESHOLD = gc.get_threshold()
"""The interpreter's own thresholds, for a process that wants them back (the test workers, after collection)."""

gc.set_threshold(10_000, *DEFAULT_THRESHOLD[1:])
