"""``python -m hfscale.trial SPEC.json --result RESULT.json``: one trial, inside the process group the sweep started."""

from hfscale.core.collector import exit_without_teardown
from hfscale.trial.entry import main

exit_without_teardown(main(process_ends=True))
