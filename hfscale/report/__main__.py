"""``python -m hfscale.report RUN``: the same as ``hfscale report RUN``."""

import sys

from hfscale.commands.report import main

sys.exit(main())
