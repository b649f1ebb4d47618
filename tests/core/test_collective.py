"""The one gather across ranks: nothing to gather in one process, every rank's object in rank order in several; and
the end of a run's process group, which no rank leaves before the main process has written its result."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hfscale.core.collective import all_gather_object, end_process_group

TWO_RANKS = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from hfscale.core.collective import all_gather_object

    def rank_main(rank, folder):
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
        try:
            seen = {"gathered": all_gather_object(["rank", rank]), "told_one": all_gather_object(rank, world_size=1)}
        finally:
            dist.destroy_process_group()
        with open(f"{folder}/rank{rank}.json", "w") as fh:
            json.dump(seen, fh)

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
    """
)


def test_one_process_gathers_its_own_object():
    assert all_gather_object({"rank": 0}) == [{"rank": 0}]
    assert all_gather_object(3, world_size=1) == [3]


@pytest.mark.slow
def test_two_processes_gather_each_other_in_rank_order(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=300)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["gathered"] == [["rank", 0], ["rank", 1]]
        assert seen["told_one"] == [rank]  # the caller says one process: nothing is gathered


# Rank 1 aborts at exit, as Gloo's teardown race makes a rank do; torch's spawn then ends rank 0 as a launcher
# would. Rank 0 looks for 5 s for rank 1 leaving before it writes its result; if rank 1 left (no barrier), rank 0 is
# ended before it writes. Core dumps off: an aborting torch process would write one into the working folder.
ABORTING_PEER = textwrap.dedent(
    """
    import os, resource, sys, time
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from hfscale.core.collective import end_process_group

    def rank_main(rank, folder):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
        if rank == 1:
            end_process_group()
            open(f"{folder}/leaving", "w").close()
            os.abort()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if os.path.exists(f"{folder}/leaving"):
                time.sleep(60)  # ended by spawn meanwhile: the result is never written
            time.sleep(0.05)
        with open(f"{folder}/result.json", "w") as fh:
            fh.write("{}")
        end_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
    """
)


def test_ending_the_group_without_one_does_nothing():
    end_process_group()


@pytest.mark.slow
def test_no_rank_leaves_the_group_before_the_main_process_has_written(tmp_path):
    script = tmp_path / "aborting_peer.py"
    script.write_text(ABORTING_PEER)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode != 0 and "SIGABRT" in proc.stderr  # rank 1 did abort, and spawn said so
    assert (tmp_path / "leaving").exists() and (tmp_path / "result.json").exists(), proc.stderr[-2000:]
