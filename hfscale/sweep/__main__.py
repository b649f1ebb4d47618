"""``python -m hfscale.sweep RECIPE`` and ``accelerate launch -m hfscale.sweep RECIPE``: the same as ``hfscale sweep``.

The entry point is this file, not the loop's module, so the loop is imported once (as ``hfscale.sweep.loop``), never
a second time as ``__main__``.
"""

import sys

from hfscale.commands.sweep import main

sys.exit(main())
