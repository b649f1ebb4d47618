"""Headless Chromium for the tests that load a report in a real browser.

Debian's ``chromium`` package (``apt-get install -y chromium``) or ``CHROMIUM_PATH`` pointing at a Chromium or Chrome
binary; a test that needs it is skipped with that reason where neither is found. Chromium runs with networking cut
off (every host resolves to nothing), so a report must carry everything it shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def chromium() -> str:
    candidates = [os.environ.get("CHROMIUM_PATH", "")]
    candidates += [shutil.which(n) or "" for n in ("chromium", "chromium-browser", "google-chrome", "chrome")]
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        pytest.skip("headless Chromium not found: apt-get install -y chromium, or set CHROMIUM_PATH")
    return found


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        f"--user-data-dir={profile}",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc
