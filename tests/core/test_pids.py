"""When a process started, read from the kernel to its clock tick."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import NoReturn

import pytest

PROBE = """import time
first_line = time.time()
from hfscale.trial.train import process_start_time
print(process_start_time(), first_line)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_trials_start_time_lies_between_its_launch_and_its_first_line():
    """The trial's ``startup`` and ``total`` timings start here. psutil's ``create_time`` (used before) adds the start
    to ``/proc/stat``'s boot time in whole seconds, so it placed the start up to a second before the launch."""
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    started, first_line = map(float, out.stdout.split())
    assert launched - 0.02 <= started <= first_line, (started - launched, first_line - started)  # 0.01 s ticks


def test_without_proc_the_start_is_psutils_else_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no ``/proc`` (``started_at`` gives None): psutil's figure, and where psutil fails too, the time
    of the call, so the timings start at the trial's ``main``."""
    import psutil

    from hfscale.trial import train

    monkeypatch.setattr(train, "started_at", lambda: None)
    assert train.process_start_time() == psutil.Process().create_time()

    def no_process(*args: object) -> NoReturn:
        raise psutil.AccessDenied()

    monkeypatch.setattr(psutil, "Process", no_process)
    before = time.time()
    assert before <= train.process_start_time() <= time.time()
