"""How a failed process group is classified: from the final error of the failing rank, never from OOM-like text
anywhere in the tail. Each false-OOM case below is one the audit of 0.1 found misclassified (issue 11, items 1
and 2)."""

from __future__ import annotations

import pytest

from hfscale.launch.failures import classify, final_error, stderr_excerpt
from hfscale.launch.process import ProcessOutcome

EXIT_1 = ProcessOutcome(returncode=1, timed_out=False, wall_time_s=1.0, pid=1)


@pytest.mark.parametrize(
    ("stderr", "status", "words"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom", "CUDA out of memory"),
        ("[rank1]: RuntimeError: DefaultCPUAllocator: can't allocate memory", "oom", "host out of memory"),
        ("Signal 9 (SIGKILL) received by PID 123", "crashed", "a process of the trial was killed by SIGKILL"),
        ("ValueError: bad config\nsubprocess.CalledProcessError: ...", "crashed", "exit code 1: ValueError: bad"),
    ],
)
def test_classify_reads_what_launchers_print(stderr, status, words):
    verdict = classify(ProcessOutcome(returncode=1, timed_out=False, wall_time_s=1.0, pid=1), stderr)
    assert verdict.status == status
    assert words in verdict.reason


def test_the_worker_traceback_is_kept_when_torchrun_prints_its_table_after_it():
    worker = [f"[rank0]:   File 'x.py', line {i}" for i in range(30)] + ["[rank0]: TypeError: the real cause"]
    table = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "] + [f"  row {i}" for i in range(60)]
    text = "\n".join(worker + table)
    excerpt = stderr_excerpt(text)
    assert "[rank0]: TypeError: the real cause" in excerpt and "  row 59" in excerpt
    assert len(excerpt.splitlines()) == 15 + 1 + 40
    verdict = classify(ProcessOutcome(returncode=1, timed_out=False, wall_time_s=1.0, pid=1), text)
    assert verdict.reason == "exit code 1: TypeError: the real cause"


# -- false out-of-memory: OOM-like text that is not the final error ------------------------------------------------

WARNING_THEN_VALUE_ERROR = """\
/venv/lib/python3.11/site-packages/accelerate/utils/memory.py:12: UserWarning: retrying after out of memory
  warnings.warn(
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/transformers/models/bert/modeling_bert.py", line 900, in forward
    raise ValueError(
ValueError: Expected input batch_size (8) to match target batch_size (4).
"""

RUNTIME_ERROR_NAMING_OOM = """\
Traceback (most recent call last):
  File "/x/trial.py", line 10, in main
    build()
RuntimeError: invalid option 'out of memory fallback' for the allocator config
"""

SOURCE_LINE_THEN_KEY_ERROR = """\
Traceback (most recent call last):
  File "/x/trainer.py", line 31, in step
    batch = self.collate(inputs)
  File "/x/trainer.py", line 12, in collate
    except torch.OutOfMemoryError:
  File "/x/trainer.py", line 11, in collate
    return inputs["input_ids"]
KeyError: 'input_ids'
"""


@pytest.mark.parametrize(
    ("stderr", "reason"),
    [
        (WARNING_THEN_VALUE_ERROR, "exit code 1: ValueError: Expected input batch_size (8) to match target"),
        (RUNTIME_ERROR_NAMING_OOM, "exit code 1: RuntimeError: invalid option 'out of memory fallback'"),
        (SOURCE_LINE_THEN_KEY_ERROR, "exit code 1: KeyError: 'input_ids'"),
    ],
    ids=["warning-then-ValueError", "RuntimeError-naming-oom", "source-line-then-KeyError"],
)
def test_oom_text_that_is_not_the_final_error_is_a_crash(stderr, reason):
    verdict = classify(EXIT_1, stderr, memory_limit_bytes=2**30)
    assert verdict.status == "crashed"
    assert verdict.reason.startswith(reason)


# -- real out-of-memory in its various forms -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stderr", "what"),
    [
        # A trial under run.memory_limit_gib: OpenBLAS prints this and exits 1, no Python exception follows.
        (
            "OpenBLAS error: Memory allocation still failed after 10 retries, giving up.",
            "host out of memory (OpenBLAS)",
        ),
        ("Traceback (most recent call last):\n  File 'x', line 1\nMemoryError", "host out of memory"),
        ("terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc", "host out of"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "CUDA out of memory"),
        ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be reported asynchronously", "CUDA out"),
        ("OSError: [Errno 12] Cannot allocate memory", "host out of memory"),
        ("ImportError: libcudnn.so.9: failed to map segment from shared object", "host out of memory (mapping"),
    ],
)
def test_real_out_of_memory_is_oom(stderr, what):
    verdict = classify(EXIT_1, stderr, memory_limit_bytes=2**30)
    assert verdict.status == "oom", verdict
    assert verdict.reason.startswith(what)
    assert "(memory limit 1 GiB per process)" in verdict.reason


def _torchrun_table(rank: int, exitcode: int = 1) -> str:
    return f"""\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
hfscale.trial FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_10:00:00
  host      : vm
  rank      : {rank} (local_rank: {rank})
  exitcode  : {exitcode} (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_the_failing_ranks_final_error_decides():
    rank1_oom = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB"
    rank0_broken = "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:29500"
    text = "\n".join([rank1_oom, rank0_broken, _torchrun_table(rank=1)])
    assert final_error(text).rank == 1
    verdict = classify(EXIT_1, text)
    assert verdict.status == "oom"
    assert (
        verdict.reason
        == "CUDA out of memory on rank 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB"
    )
    # Without the table, the rank that ran out of memory is still the cause, whatever order the ranks printed in.
    assert classify(EXIT_1, "\n".join([rank1_oom, rank0_broken])).status == "oom"
    # The root cause is a plain crash on rank 0: another rank's warning about memory does not make it an OOM.
    crash = "\n".join(
        [
            "[rank1]: UserWarning: CUDA out of memory is likely at this batch size",
            "[rank0]: KeyError: 'labels'",
            _torchrun_table(rank=0),
        ]
    )
    verdict = classify(EXIT_1, crash)
    assert verdict.status == "crashed" and verdict.reason == "exit code 1: KeyError: 'labels'"


def test_final_error_is_none_without_an_error():
    assert final_error("") is None
    assert final_error("loading model\nstep 1/4") is None
    assert classify(EXIT_1, "step 1/4").reason == "exit code 1 (see stderr.log)"


NUMPY_UNDER_A_MEMORY_LIMIT = """\
Traceback (most recent call last):
  File "/x/trial.py", line 3, in <module>
    import numpy
ImportError:

IMPORTANT: PLEASE READ THIS FOR ADVICE ON HOW TO SOLVE THIS ISSUE!

Importing the numpy C-extensions failed. This error can happen for
many reasons, often due to issues with your setup or how NumPy was
installed.

Original error was: /venv/lib/python3.11/site-packages/numpy/_core/_multiarray_umath.so: failed to map segment \
from shared object
"""


def test_a_library_that_cannot_be_mapped_under_the_memory_limit_is_out_of_memory():
    """Under RLIMIT_AS the loader cannot map a shared library: numpy's multi-line ImportError says so on its last
    line, not on the exception's own line."""
    verdict = classify(EXIT_1, NUMPY_UNDER_A_MEMORY_LIMIT, memory_limit_bytes=2**29)
    assert verdict.status == "oom", verdict
    assert "mapping a library failed" in verdict.reason and "memory limit 0.5 GiB" in verdict.reason
    assert "failed to map segment" in final_error(NUMPY_UNDER_A_MEMORY_LIMIT).line
    long_tail = NUMPY_UNDER_A_MEMORY_LIMIT + "".join(f"note {i}\n" for i in range(60))
    excerpt = stderr_excerpt(long_tail)  # the error's first line is found although its message spans lines
    assert excerpt.splitlines()[3:5] == ["ImportError:", "..."]


def test_a_multi_line_message_ends_where_its_rank_stops_printing():
    text = (
        "[rank0]: ImportError:\n[rank0]: \n[rank0]: Original error was: failed to map segment from shared object\n"
        "[rank1]: RuntimeError: Cannot allocate memory on the other rank\n"
        "E0101 12:00:00.000 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1)\n"
    )
    lines = {error.rank: error.line for error in [final_error(text)]}
    assert "torch/distributed" not in next(iter(lines.values()))
    from hfscale.launch.failures import _fatal_lines

    rank0 = [line for rank, line in _fatal_lines(text) if rank == 0]
    assert rank0 == ["ImportError: Original error was: failed to map segment from shared object"]


# What the accelerate launcher printed in a CI run (2026-11-27, 2-process FSDP2 on CPU, abridged): rank 1 aborted at
# exit; torchrun then sent SIGTERM to rank 0, whose row comes first in its table, before the root cause.
TEARDOWN_ABORT_STDERR = """\
terminate called without an active exception
W1127 14:43:51.162000 20450 api.py:1028] Sending process 20453 closing signal SIGTERM
E1127 14:43:51.277000 20450 api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 20454)
Traceback (most recent call last):
  File "/venv/bin/accelerate", line 6, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n\
=======================================================
/work/user_script.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-27_14:43:51
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 20453)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 20453
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_14:43:51
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 20454)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 20454
=======================================================
"""


def test_the_root_causes_signal_and_a_native_abort_are_named_not_the_sigterm_sent_to_the_others():
    verdict = classify(EXIT_1, TEARDOWN_ABORT_STDERR)
    assert verdict.status == "crashed"
    assert verdict.reason == (
        "a process of the trial was killed by SIGABRT; last error: terminate called without an active exception"
    )
