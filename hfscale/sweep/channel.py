"""The drivers' channel of a sweep on several machines: machine 0 serves a small key-value store over HTTP
(:class:`Coordinator`), the other machines' drivers read its plan and write their own keys (:class:`Follower`),
and each side knows how long the other has been silent.

Plain HTTP from the standard library: torch's TCPStore printed C++ stack traces on every wait timeout. What the
keys mean is :mod:`hfscale.sweep.machines`'.

What machine 0 trusts, and no more:

- **Who writes.** Every request names its machine (``X-Hfscale-Machine: k``) and carries that machine's credential,
  an HMAC of ``k`` under the shared token (:data:`TOKEN_ENV`, :func:`machine_credential`); the token itself never
  travels. Machine k may write only keys that end in its own number (``ready/<i>/k``, ``report/<i>/k``,
  ``alive/k``, ``env/k``) and read only machine 0's (``plan``, ``start/<i>``). Without a token (allowed only on a
  loopback address) the machine number still has to match the key.
- **Where it listens.** The address that routes to ``--main-process-ip`` (or ``--channel-bind``); without a token,
  anything but a loopback address is refused before the server starts.
- **How long and how much.** Each socket operation times out after :data:`SOCKET_TIMEOUT_S` and a whole request
  is cut after :data:`REQUEST_DEADLINE_S`, so no client holds a handler thread; at most :data:`MAX_HEADERS` headers
  and :data:`MAX_BODY_BYTES` of body.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
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
MAX_HEADERS = 32
"""The most headers a request may carry (a follower sends five)."""
SOCKET_TIMEOUT_S = 10.0
"""How long machine 0 waits for each read or write of a request's socket."""
REQUEST_DEADLINE_S = 30.0
"""How long one request may hold a handler thread in all (a client sending a byte at a time is cut there)."""
# What machine k may write: its own keys only, the machine number last (never ``plan`` or ``start/i``, machine 0's).
_WRITABLE = re.compile(r"(?:ready|report)/\d+/(?P<owner>\d+)|(?:alive|env)/(?P<own>\d+)")
# What every other machine may read: machine 0's plan and decisions.
_READABLE = re.compile(r"plan|start/\d+")


class ChannelError(ValueError):
    """Machine 0's channel cannot start as asked (no token on an address other machines can reach)."""


def machine_credential(token: str, machine: int) -> str:
    """Machine ``machine``'s credential: HMAC-SHA256 of its number under the shared token. Machine 0 derives it to
    check who writes; a follower sends its own, never the token."""
    return hmac.new(token.encode("utf-8"), f"hfscale-machine/{machine}".encode(), hashlib.sha256).hexdigest()


def route_address(host: str | None) -> str:
    """The local address that routes to ``host`` (machine 0's ``--main-process-ip``): the interface the other
    machines reach machine 0 on. Loopback for None. Connecting a UDP socket sends nothing.

    Raises:
        ChannelError: when ``host`` cannot be resolved or routed to (naming ``--channel-bind``).
    """
    if host is None:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except (OSError, UnicodeError) as exc:  # a name that cannot be encoded ("a..b") raises UnicodeError
        raise ChannelError(
            f"no local address routes to --main-process-ip {host} ({exc}); give the address to serve the other "
            "machines' drivers on with --channel-bind ADDR"
        ) from exc


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP literal, or ``localhost``) is a loopback address; a host name is not."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


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
    """Machine 0's driver refused a request (4xx, with its reason): another ``HFSCALE_SWEEP_TOKEN``, a machine
    number outside the sweep, a key that is not this machine's."""


class _Store:
    """Keys and JSON values, and when each machine last spoke."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.last_seen: dict[int, float] = {}
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    """Machine 0's answers: one of its own keys (GET), a follower's own key written (PUT); :func:`_handler` gives it
    its store, token and machine count."""

    store: _Store
    token: str | None
    machines: int | None
    timeout = SOCKET_TIMEOUT_S  # StreamRequestHandler sets it on the socket: every read and write is bounded

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(REQUEST_DEADLINE_S, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def finish(self) -> None:
        self._deadline.cancel()
        with contextlib.suppress(OSError):
            super().finish()

    def _cut(self) -> None:
        """Past :data:`REQUEST_DEADLINE_S`: end the connection, whatever the client is still sending."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if len(self.headers) > MAX_HEADERS:
            self.close_connection = True
            self.send_error(431, f"more than {MAX_HEADERS} headers")
            return False
        return True

    def _refuse(self, code: int, why: str = "") -> None:
        """Answer ``code`` with ``why`` as its body (the follower puts it in its error) and end the connection."""
        body = why.encode("utf-8")
        self.close_connection = True
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _machine(self) -> int | None:
        """The machine this request comes from, its credential checked; None after answering 403."""
        claimed = self.headers.get(_MACHINE_HEADER) or ""
        machine = int(claimed) if claimed.isdigit() and len(claimed) < 6 else None
        if machine is None or machine == 0 or (self.machines is not None and machine >= self.machines):
            span = f"1 to {self.machines - 1}" if self.machines is not None else "1 or more"
            self._refuse(403, f"machine {claimed or '(none)'} is not one of this sweep's machines ({span})")
            return None
        if self.token is not None:
            given = (self.headers.get(_TOKEN_HEADER) or "").encode("utf-8")
            if not hmac.compare_digest(given, machine_credential(self.token, machine).encode("utf-8")):
                self._refuse(403, f"not machine {machine}'s credential: set the same {TOKEN_ENV} on every machine")
                return None
        with self.store.lock:
            self.store.last_seen[machine] = time.monotonic()
        return machine

    def do_GET(self) -> None:
        machine = self._machine()
        if machine is None:
            return
        key = self.path.lstrip("/")
        if not (_READABLE.fullmatch(key) or _owner(key) == machine):
            self._refuse(403, f"machine {machine} may read machine 0's plan and decisions and its own keys only")
            return
        with self.store.lock:
            found, value = key in self.store.values, self.store.values.get(key)
        if not found:
            self._refuse(404)
            return
        body = json.dumps(value).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        machine = self._machine()
        if machine is None:
            return
        key = self.path.lstrip("/")
        if _owner(key) != machine:
            self._refuse(403, f"machine {machine} may write only its own keys (ending in /{machine})")
            return
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            self._refuse(411, "a numeric Content-Length is required")
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self._refuse(413, f"at most {MAX_BODY_BYTES} bytes")
            return
        try:
            value = json.loads(self.rfile.read(length) or b"null")
        except (ValueError, OSError):
            self._refuse(400, "the body is not JSON")
            return
        with self.store.lock:
            self.store.values[key] = value
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("coordinator: " + format, *args)


def _owner(key: str) -> int | None:
    """The machine whose key ``key`` is (the number it ends in); None for machine 0's keys or no key at all."""
    match = _WRITABLE.fullmatch(key)
    if match is None:
        return None
    return int(match.group("owner") or match.group("own"))


class _Server(ThreadingHTTPServer):
    """The standard threading server, quiet about a client that went away mid-request (cut at its deadline, reset):
    a debug line instead of a traceback on machine 0's stderr."""

    allow_reuse_address = True
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("coordinator: request from %s ended early", client_address, exc_info=True)


def _handler(store: _Store, token: str | None, machines: int | None) -> type[BaseHTTPRequestHandler]:
    """A handler class bound to ``store``, ``token`` and ``machines`` (the server makes one handler per request)."""
    return type("Handler", (_Handler,), {"store": store, "token": token, "machines": machines})


class Coordinator:
    """Machine 0's end: an HTTP server (one address, the given port) holding the plan, the decisions and the other
    machines' reports."""

    def __init__(
        self, port: int, *, token: str | None = None, bind: str = "127.0.0.1", machines: int | None = None
    ) -> None:
        """Serve on ``bind``:``port``; ``token`` defaults to :data:`TOKEN_ENV`; ``machines`` (when known) bounds
        the machine numbers that may speak.

        Raises:
            ChannelError: without a token on an address that is not loopback.
            OSError: when the address cannot be served.
        """
        self.store = _Store()
        token = token or os.environ.get(TOKEN_ENV) or None
        if token is None and not is_loopback(bind):
            raise ChannelError(
                f"machine 0: {TOKEN_ENV} is not set, and the drivers' channel would accept any request reaching "
                f"{bind}:{port}; export the same random value on every machine (hfscale slurm does), or serve on a "
                "loopback address (--channel-bind 127.0.0.1) when every machine's driver runs on this host"
            )
        self.server = _Server((bind, port), _handler(self.store, token, machines))
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
        token = os.environ.get(TOKEN_ENV) or None
        self.credential = None if token is None else machine_credential(token, machine)

    def _request(self, key: str, data: bytes | None = None) -> Any | None:
        headers = {_MACHINE_HEADER: str(self.machine), "Content-Type": "application/json"}
        if self.credential is not None:
            headers[_TOKEN_HEADER] = self.credential
        request = urllib.request.Request(
            self.base + key, data=data, method="PUT" if data is not None else "GET", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            self._last_answer = time.monotonic()  # machine 0 answered, even if with a refusal
            if exc.code == 404:
                return None
            if 400 <= exc.code < 500:  # a retry would be refused again
                why = ""
                with contextlib.suppress(OSError):
                    why = exc.read().decode("utf-8", "replace").strip()
                raise ChannelRefused(
                    f"machine 0's driver at {self.base} refused {key!r} ({exc.code}): {why or exc.reason}"
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
    "MAX_HEADERS",
    "REQUEST_DEADLINE_S",
    "SILENT_AFTER_S",
    "SOCKET_TIMEOUT_S",
    "TOKEN_ENV",
    "Absent",
    "ChannelError",
    "ChannelRefused",
    "Coordinator",
    "Follower",
    "MachineZeroGone",
    "is_loopback",
    "machine_credential",
    "route_address",
]
