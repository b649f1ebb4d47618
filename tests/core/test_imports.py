"""transformers' import of peft is left out of the processes that train no peft model."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.runs import TINY_SWEEP_RECIPE, write_recipe

PROBE = (
    "import sys\n"
    "sys.argv = ['hfscale', 'sweep', {recipe!r}, '--dry-run']\n"
    "from hfscale.commands.main import console\n"
    "status = console()\n"
    "loaded = ('transformers.trainer_utils', 'peft', 'bitsandbytes')\n"
    "print('LOADED', status, sorted(m for m in loaded if m in sys.modules))\n"
    "import peft  # still importable where something asks for it (LoRA's default targets in an estimate)\n"
    "print('PEFT', peft.__name__)\n"
)


def test_the_hfscale_command_reads_a_recipe_without_importing_peft(tmp_path):
    """Needs peft installed (the ``lora`` extra): without it there is nothing to leave out.

    The dry run checks the recipe's training_args against transformers' TrainingArguments (so it imports
    ``transformers.trainer_utils``) and must not pull peft, bitsandbytes and torch's compiler stack with it."""
    pytest.importorskip("peft")
    recipe = write_recipe(tmp_path, TINY_SWEEP_RECIPE)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(recipe=str(recipe))],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        cwd=tmp_path,
    )
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("LOADED")]
    assert line == "LOADED 0 ['transformers.trainer_utils']", out.stderr[-2000:]
    assert "PEFT peft" in out.stdout
