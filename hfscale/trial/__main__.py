"""``python -m hfscale.trial SPEC.json --result RESULT.json``: one trial, inside the process group the sweep started."""

import sys

from hfscale.core.shutdown import skip_final_collection
from hfscale.trial.entry import main

status = main()
skip_final_collection()  # every rank imported the Trainer: about a second of each run's exit (hfscale.core.shutdown)
sys.exit(status)
