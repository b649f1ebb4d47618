"""The run folder: its layout, its lock (held across processes, released by the kernel), appends, superseding
rows, and what one corrupt line costs (that line only)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import REPO

from hfscale.records.row import TrialResult
from hfscale.results.run_folder import CORRUPT_FILE, RunFolder, RunFolderError, RunFolderWriteError
from hfscale.strategy import Strategy


def _row(name: str, *, repeat: int = 0, status: str = "ok", reason: str | None = None) -> TrialResult:
    strategy = Strategy(name=name, device="cpu")
    return TrialResult(trial=name, repeat=repeat, strategy=strategy, description=strategy.describe(), status=status,
                       reason=reason)  # fmt: skip


def _folder(tmp_path: Path, *rows: TrialResult) -> RunFolder:
    folder = RunFolder.create_at(tmp_path / "run")
    for row in rows:
        folder.append(row)
    return folder


def test_layout_and_exclusive_creation(tmp_path):
    a = RunFolder.create(out_dir=tmp_path, name="r")
    b = RunFolder.create(out_dir=tmp_path, name="r")
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    assert a.repeat_dir("x", 0, 1) == a.path / "trials" / "x"
    assert a.repeat_dir("x", 1, 3) == a.path / "trials" / "x" / "repeat-2"
    assert a.probe_dir("x", 16) == a.path / "trials" / "x" / "probes" / "bs16"
    with pytest.raises(RunFolderError, match=r"exists; continue it with --resume"):
        RunFolder.create_at(a.path)


def test_append_and_read_back_the_latest_row_of_each_trial_and_repeat(tmp_path):
    folder = _folder(tmp_path, _row("a"), _row("b"), _row("a", repeat=1), _row("b", status="oom", reason="later"))
    rows = folder.rows()
    assert [(r.trial, r.repeat, r.status) for r in rows] == [("a", 0, "ok"), ("b", 0, "oom"), ("a", 1, "ok")]
    assert len(folder.results_path.read_text().splitlines()) == 4  # append-only: nothing rewritten


_HOLD = """
import sys, time
from hfscale.results.run_folder import RunFolder
with RunFolder(sys.argv[1]).locked():
    print("locked", flush=True)
    time.sleep(60)
"""


def test_the_lock_is_held_across_processes_and_released_when_its_holder_is_killed(tmp_path):
    folder = _folder(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with (
            pytest.raises(RunFolderError, match=rf"being written by another sweep \(pid {holder.pid} on "),
            folder.locked(),
        ):
            pass
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the flock
        holder.wait(timeout=10)
        with folder.locked():
            assert json.loads(folder.lock_path.read_text())["pid"] == os.getpid()
        assert folder.lock_path.read_text() == ""  # released: no holder named
    finally:
        holder.kill()
        holder.wait()


def test_a_corrupt_middle_line_costs_that_line_only(tmp_path, caplog):
    folder = _folder(tmp_path, _row("a"), _row("b"), _row("c"))
    lines = folder.results_path.read_text().splitlines(keepends=True)
    lines[1] = '{"trial": "b", "status": "ok", "strat\x00garbage\n'
    folder.results_path.write_text("".join(lines))

    with caplog.at_level(logging.WARNING, logger="hfscale.results.run_folder"):
        assert [r.trial for r in folder.rows()] == ["a", "c"]
    assert f"{folder.results_path}:2: not a valid row, skipped (not JSON" in caplog.text
    with pytest.raises(ValueError, match=r"results\.jsonl:2: not JSON"):
        folder.rows(on_bad_line="raise")

    moved = folder.set_aside_bad_lines()
    assert [b.number for b in moved] == [2]
    assert [r.trial for r in folder.rows(on_bad_line="raise")] == ["a", "c"]
    aside = [json.loads(line) for line in (folder.path / CORRUPT_FILE).read_text().splitlines()]
    assert aside[0]["line"] == 2 and aside[0]["text"].startswith('{"trial": "b"')
    assert folder.set_aside_bad_lines() == []


def test_a_row_that_is_json_but_not_a_row_is_set_aside_too(tmp_path):
    folder = _folder(tmp_path, _row("a"))
    with open(folder.results_path, "a") as fh:
        fh.write(json.dumps({"schema_version": 2, "trial": "b", "status": "exploded"}) + "\n")
    scan = folder.scan()
    assert [r.trial for r in scan.rows] == ["a"] and "status" in scan.bad_lines[0].error


def test_a_torn_last_line_is_not_a_row_and_is_moved_aside_before_the_next_append(tmp_path):
    folder = _folder(tmp_path, _row("a"))
    with open(folder.results_path, "a") as fh:
        fh.write('{"trial": "b", "sta')  # killed mid-write
    assert [r.trial for r in folder.rows()] == ["a"] and folder.scan().torn_tail
    moved = folder.set_aside_bad_lines()
    assert moved[0].error == "torn last line"
    folder.append(_row("b"))
    assert [r.trial for r in folder.rows(on_bad_line="raise")] == ["a", "b"]


def test_a_row_of_a_newer_schema_is_refused_not_skipped(tmp_path):
    folder = _folder(tmp_path, _row("a"))
    with open(folder.results_path, "a") as fh:
        fh.write(json.dumps({"schema_version": 99, "trial": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"results\.jsonl:2: a row of schema_version 99, written by a newer hfscale"):
        folder.rows()
    with pytest.raises(ValueError, match="upgrade hfscale"):
        folder.set_aside_bad_lines()  # never moved aside: it is not corrupt


def test_environment_record_and_resumed_entries(tmp_path):
    folder = _folder(tmp_path)
    assert folder.environment() == {}
    folder.write_environment({"host": "h", "sweep": {"timeout_s": 60}})
    record = folder.record_resume({"host": "h", "sweep": {"timeout_s": 5}})
    assert record["resumed"] == [{"host": "h", "sweep": {"timeout_s": 5}}]
    assert folder.environment() == record


@pytest.mark.parametrize("run", ["cpu_small-cpu2", "bert_large-h100"])
def test_the_committed_runs_read_with_every_row(run, tmp_path):
    folder = RunFolder(REPO / "results" / run)
    lines = folder.results_path.read_text().splitlines()
    assert len(folder.rows(on_bad_line="raise")) == len(lines)
    copy = shutil.copytree(folder.path, tmp_path / run, ignore=shutil.ignore_patterns("trials"))
    start = time.monotonic()
    assert RunFolder(copy).set_aside_bad_lines() == []  # nothing to repair: nothing rewritten
    assert (Path(copy) / "results.jsonl").read_text().splitlines() == lines
    assert time.monotonic() - start < 5


# -- a full disk or a read-only folder (issue 15, item 5) -----------------------------------------------------------


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_row_that_cannot_be_written_names_the_file_and_costs_nothing_written_before(tmp_path, monkeypatch):
    folder = _folder(tmp_path, _row("a"))
    before = folder.results_path.read_bytes()
    monkeypatch.setattr("hfscale.results.run_folder.os.fsync", _no_space)  # the line is written, then the disk is full
    with pytest.raises(RunFolderWriteError, match=r"cannot write .*results\.jsonl: No space left on device") as info:
        folder.append(_row("b"))
    assert info.value.errno == errno.ENOSPC and info.value.path == folder.results_path
    # Before: half a row (here: a whole one, unsynced) stayed in the file.
    assert folder.results_path.read_bytes() == before
    monkeypatch.undo()
    folder.append(_row("b"))
    assert [r.trial for r in folder.rows(on_bad_line="raise")] == ["a", "b"]


def test_writability_is_checked_before_anything_runs(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    assert folder.check_writable() > 0
    assert sorted(p.name for p in folder.path.rglob("*")) == ["trials"]  # the probe file is removed
    monkeypatch.setattr("hfscale.results.run_folder.os.fsync", _no_space)
    with pytest.raises(RunFolderWriteError, match=r"cannot write .*run/\.write-check: No space left on device"):
        folder.check_writable()
    assert not (folder.path / ".write-check").exists()


def test_an_environment_record_that_cannot_be_written_keeps_the_old_one(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    folder.write_environment({"gpu_count": 0})
    monkeypatch.setattr("hfscale.results.run_folder.os.replace", _no_space)
    with pytest.raises(RunFolderWriteError, match=r"cannot write .*environment\.json: No space left on device"):
        folder.write_environment({"gpu_count": 1})
    assert folder.environment() == {"gpu_count": 0}
    assert sorted(p.name for p in folder.path.iterdir()) == ["environment.json"]
