"""``python -m hfscale.report RUN``: the same as ``hfscale report RUN``."""

import sys

from hfscale.report.cli import main

sys.exit(main())
