"""``python -m hfscale.trial SPEC.json --result RESULT.json``: one trial, inside the process group the sweep started."""

import sys

from hfscale.trial.entry import main

sys.exit(main(process_ends=True))
