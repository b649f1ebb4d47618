"""Run at the start of every Python process the test suite starts: pytest's workers, and the sweep drivers,
launchers, trial ranks and scripts its tests launch (``tests/conftest.py`` puts this folder first on their
``PYTHONPATH``; a process given an environment of its own, as the fresh-venv install test is, does without).

It raises the garbage collector's first threshold from 700 (CPython 3.11's) to 10,000 allocations: each of those
processes imports the training stack (torch, transformers, accelerate; about 420,000 objects the collector tracks),
and at 700 the collector scans that growing heap over and over while it is imported. Measured on 2 cores
(2026-11-28, user and system CPU, three runs each): importing transformers' Trainer with peft, bitsandbytes,
accelerate and DeepSpeed took 6.3-7.1 CPU-seconds against 7.2-7.9; one printed two-process config run alone with
pytest (tests/scenarios/test_user_configs.py: the test process, the launcher and two ranks; two runs each) 21.0-22.3
against 24.0-25.7. A trial's own rank freezes its imports anyway (``hfscale.core.collector``), so its figures are
unchanged (a tiny BERT trial, two runs each: imports 2.75-2.83 s against 2.73-2.83, peak 0.5428-0.5429 GiB both
ways). What a test asserts does not depend on when cyclic garbage is collected: the collector still runs, less
often.
"""

import gc

DEFAULT_THRESHOLD = gc.get_threshold()
"""The interpreter's own thresholds, for a process that wants them back (the test workers, after collection)."""

gc.set_threshold(10_000, *DEFAULT_THRESHOLD[1:])
