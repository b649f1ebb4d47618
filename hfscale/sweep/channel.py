"""The drivers' channel of a sweep on several machines: machine 0 serves a small key-value store over HTTP
(:class:`Coordinator`), the other machines' drivers read its plan and write their own keys (:class:`Follower`),
and each side knows how long the other has been silent.

Plain HTTP from the standard library: torch's TCPStore printed C++ stack traces on every wait timeout. The store
takes a shared token (:data:`TOKEN_ENV`) and lets a follower write only its own keys; what the keys mean is
:mod:`hfscale.sweep.machines`'.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
"""How often a follower tells machine 0 it is alive (also while its trial runs)."""
SILENT_AFTER_S = 10.0
"""A driver not heard from for this long is taken as gone: nobody waits for it any more."""
_POLL_S = 0.5
_MACHINE_HEADER = "X-Hfscale-Machine"
_TOKEN_HEADER = "X-Hfscale-Token"
TOKEN_ENV = "HFSCALE_SWEEP_TOKEN"
"""The shared secret every driver of one sweep has in its environment (see the module's docstring)."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest value a follower may write (an environment record or a report is a few KiB)."""
# What machine k may write: its own keys only (never ``plan`` or ``start/i``, machine 0's).
_WRITABLE = re.compile(r"(?:ready|report)/\d+/\d+|(?:alive|env)/\d+")


@dataclass(frozen=True, kw_only=True)
class Absent:
    """Why a machine's key did not come while machine 0 waited (:meth:`Coordinator.wait_for`)."""

    kind: str
    """``never`` (its driver never spoke), ``stopped`` (it spoke, then went silent: dead) or ``late`` (its driver
    is alive, its part still running or not ready in time)."""
    why: str

    @property
    def gone(self) -> bool:
        """Its driver never came or stopped: a cause of failure, not a consequence."""
        return self.kind in ("never", "stopped")


def _absent(value: str | Absent) -> Absent:
    return value if isinstance(value, Absent) else Absent(kind="stopped", why=value)


# -- the drivers' channel -------------------------------------------------------------------------------------


class MachineZeroGone(RuntimeError):
    """Machine 0's driver stopped answering (it finished, was killed, or its host is unreachable)."""


class ChannelRefused(RuntimeError):
    """Machine 0's driver refused a request (403): this driver's ``HFSCALE_SWEEP_TOKEN`` is not machine 0's."""


class _Store:
    """Keys and JSON values, and when each machine last spoke."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.last_seen: dict[int, float] = {}
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    """Machine 0's answers: a value by its key (GET), a follower's own key written (PUT); :func:`_handler` gives it
    its store and token."""

    store: _Store
    token: str | None

    def _refuse(self, code: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _allowed(self) -> bool:
        """The shared token matches (or machine 0 has none); else answers 403."""
        if self.token is not None:
            given = self.headers.get(_TOKEN_HEADER) or ""
            if not hmac.compare_digest(given.encode("utf-8"), self.token.encode("utf-8")):
                self._refuse(403)
                return False
        machine = self.headers.get(_MACHINE_HEADER)
        if machine is not None and machine.isdigit():
            with self.store.lock:
                self.store.last_seen[int(machine)] = time.monotonic()
        return True

    def do_GET(self) -> None:
        if not self._allowed():
            return
        key = self.path.lstrip("/")
        with self.store.lock:
            found, value = key in self.store.values, self.store.values.get(key)
        if not found:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps(value).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        if not self._allowed():
            return
        if not _WRITABLE.fullmatch(self.path.lstrip("/")):
            self._refuse(403)
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._refuse(400)
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._refuse(413)
            return
        try:
            value = json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            self._refuse(400)
            return
        with self.store.lock:
            self.store.values[self.path.lstrip("/")] = value
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("coordinator: " + format, *args)


def _handler(store: _Store, token: str | None) -> type[BaseHTTPRequestHandler]:
    """A handler class bound to ``store`` and ``token`` (the server makes one handler per request)."""
    return type("Handler", (_Handler,), {"store": store, "token": token})


class Coordinator:
    """Machine 0's end: an HTTP server (every interface, the given port) holding the plan, the decisions and the
    other machines' reports."""

    def __init__(self, port: int, *, token: str | None = None) -> None:
        self.store = _Store()
        token = token or os.environ.get(TOKEN_ENV) or None
        if token is None:
            logger.warning(
                "machine 0: %s is not set: the drivers' channel on port %d accepts any request from the network; "
                "export the same random value on every machine",
                TOKEN_ENV,
                port,
            )
        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("", port), _handler(self.store, token))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="hfscale-coordinator", daemon=True)
        self.thread.start()

    def publish(self, key: str, value: Any) -> None:
        with self.store.lock:
            self.store.values[key] = value

    def value(self, key: str) -> Any | None:
        with self.store.lock:
            return self.store.values.get(key)

    def silent_for(self, machine: int) -> float | None:
        """Seconds since ``machine``'s driver last spoke; None when it never did."""
        with self.store.lock:
            seen = self.store.last_seen.get(machine)
        return None if seen is None else time.monotonic() - seen

    def wait_for(
        self, keys: Mapping[int, str], *, timeout_s: float, sleep: Callable[[float], None] = time.sleep
    ) -> dict[int, Absent]:
        """Wait until every machine's key in ``keys`` is published, at most ``timeout_s``; a machine that spoke
        and then went silent for :data:`SILENT_AFTER_S` is not waited for. Returns the machines whose key did not
        come, with why: their driver never spoke, went silent (both gone), or is alive but late."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = {m: k for m, k in keys.items() if self.value(k) is None}
            gone = {m for m in missing if (s := self.silent_for(m)) is not None and s > SILENT_AFTER_S}
            if not missing or set(missing) == gone or time.monotonic() >= deadline:
                break
            sleep(_POLL_S)
        problems = {}
        for machine in missing:
            silent = self.silent_for(machine)
            if silent is None:
                why = f"its driver never contacted machine 0 (waited {timeout_s:g} s, --machine-wait-s)"
                problems[machine] = Absent(kind="never", why=why)
            elif silent > SILENT_AFTER_S:
                problems[machine] = Absent(kind="stopped", why=f"its driver stopped (last heard {silent:.0f} s ago)")
            else:
                why = f"its driver is alive but did not answer within {timeout_s:g} s (--machine-wait-s)"
                problems[machine] = Absent(kind="late", why=why)
        return problems

    def received_environments(self) -> dict[int, dict[str, Any]]:
        """The environment records the other machines sent (``env/<m>``), by machine."""
        with self.store.lock:
            items = list(self.store.values.items())
        return {int(k[4:]): v for k, v in items if k.startswith("env/") and k[4:].isdigit() and isinstance(v, dict)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Follower:
    """Machine ``k``'s end: reads and writes machine 0's keys, and tells it every :data:`HEARTBEAT_S` that this
    driver is alive."""

    def __init__(self, host: str, port: int, machine: int) -> None:
        self.base = f"http://{host}:{port}/"
        self.machine = machine
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None
        self._last_answer = time.monotonic()
        self.token = os.environ.get(TOKEN_ENV) or None

    def _request(self, key: str, data: bytes | None = None) -> Any | None:
        headers = {_MACHINE_HEADER: str(self.machine), "Content-Type": "application/json"}
        if self.token is not None:
            headers[_TOKEN_HEADER] = self.token
        request = urllib.request.Request(
            self.base + key, data=data, method="PUT" if data is not None else "GET", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                self._last_answer = time.monotonic()
                return None
            if exc.code == 403:
                raise ChannelRefused(
                    f"machine 0's driver at {self.base} refused {key!r} (403): set the same {TOKEN_ENV} on every "
                    "machine (and write only this machine's keys)"
                ) from None
            raise
        self._last_answer = time.monotonic()
        return json.loads(body) if body else None

    def get(self, key: str) -> Any | None:
        """The value, or None when it is not published yet (or machine 0 does not answer now)."""
        try:
            return self._request(key)
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: Any) -> bool:
        """Publish ``value``; False when machine 0 did not take it."""
        try:
            self._request(key, json.dumps(value).encode("utf-8"))
            return True
        except (OSError, ValueError):
            return False

    def put_until(self, key: str, value: Any) -> None:
        """Publish ``value``, retrying until machine 0 takes it.

        Raises:
            MachineZeroGone: when machine 0 has not answered for :data:`SILENT_AFTER_S`.
            ChannelRefused: when machine 0 refuses it (another token).
        """
        data = json.dumps(value).encode("utf-8")
        while True:
            try:
                self._request(key, data)
                return
            except (OSError, ValueError):
                silent = time.monotonic() - self._last_answer
                if silent > SILENT_AFTER_S:
                    raise MachineZeroGone(
                        f"machine 0's driver at {self.base} did not take {key!r}: no answer for {silent:.0f} s"
                    ) from None
                time.sleep(_POLL_S)

    def wait_for(self, key: str, *, timeout_s: float | None, answered_before: bool = True) -> Any:
        """The value of ``key`` once machine 0 publishes it.

        Raises:
            TimeoutError: after ``timeout_s`` (None: no limit while machine 0 answers).
            MachineZeroGone: when machine 0, having answered before (``answered_before``), has not answered for
                :data:`SILENT_AFTER_S`.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            value = self.get(key)
            if value is not None:
                return value
            now = time.monotonic()
            if answered_before and now - self._last_answer > SILENT_AFTER_S:
                raise MachineZeroGone(
                    f"machine 0's driver at {self.base} stopped answering {now - self._last_answer:.0f} s ago"
                )
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"nothing from machine 0's driver at {self.base} within {timeout_s:g} s")
            time.sleep(_POLL_S)

    def start_heartbeat(self) -> None:
        """Beat once now, then every :data:`HEARTBEAT_S` in a thread until :meth:`stop`."""

        def beat() -> None:
            with contextlib.suppress(ChannelRefused):
                while True:
                    self.put(f"alive/{self.machine}", time.time())
                    if self._stop.wait(HEARTBEAT_S):
                        return

        with contextlib.suppress(ChannelRefused):
            self.put(f"alive/{self.machine}", time.time())

        self._heart = threading.Thread(target=beat, name="hfscale-heartbeat", daemon=True)
        self._heart.start()

    def stop(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join(timeout=HEARTBEAT_S + 6)


__all__ = [
    "HEARTBEAT_S",
    "MAX_BODY_BYTES",
    "SILENT_AFTER_S",
    "TOKEN_ENV",
    "Absent",
    "ChannelRefused",
    "Coordinator",
    "Follower",
    "MachineZeroGone",
]
