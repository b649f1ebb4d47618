"""Gloo's teardown race, which the tests of multi-process CPU runs tolerate where the run's evidence is complete.

torch 2.13 (pytorch/pytorch#179291, abandoned upstream): at interpreter exit, after ``destroy_process_group``, a rank
can abort on a Gloo worker thread still holding tensors. Seen twice in 2-process FSDP2 runs on CPU (once in a
fresh-clone CI run, 2026-11-27), never in 16 such runs in a row on an idle machine. hfscale's trials end their group
behind a barrier (``hfscale.core.collective.end_process_group``), so the result is written before any rank can exit;
a sweep keeps a result written before its group failed to exit (``LaunchRecord.after_result``).
"""

from __future__ import annotations

TEARDOWN_ABORT = "terminate called without an active exception"


def exited_or_aborted_at_teardown(returncode: int, stderr: str) -> bool:
    """Whether a run exited cleanly, or a rank aborted with :data:`TEARDOWN_ABORT` (the message is in stderr). The
    caller checks the run's own record (its result, its log files) as the evidence either way."""
    return returncode == 0 or TEARDOWN_ABORT in stderr
