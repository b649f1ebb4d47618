"""``python -m hfscale.sweep RECIPE`` and ``accelerate launch -m hfscale.sweep RECIPE``: the same as ``hfscale sweep``.

The entry point is this file, not the loop's module, so the loop is imported once (as ``hfscale.sweep.loop``), never
a second time as ``__main__``.
"""

import sys

from hfscale.core.imports import leave_out_peft

leave_out_peft()  # this process is a driver: it never trains, and transformers' import of peft costs seconds
from hfscale.commands.sweep import main  # noqa: E402

sys.exit(main())
