"""The drivers' channel trusts only what it must: each machine writes its own keys only, under its own credential;
no request holds a thread; nothing reachable from the network runs without a token.

Every request here is sent by hand (``http.client`` or a raw socket), as a misbehaving or hostile client would.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

import hfscale.sweep.channel as channel
from hfscale.sweep.channel import (
    MAX_HEADERS,
    TOKEN_ENV,
    ChannelError,
    ChannelRefused,
    Coordinator,
    Follower,
    machine_credential,
    route_address,
)

TOKEN = "s3cret"


@pytest.fixture
def served(monkeypatch):
    """Machine 0's channel for three machines, with a token, on loopback; yields it and its port."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    coordinator = Coordinator(0, token=TOKEN, machines=3)  # port 0: the kernel's choice, no race for it
    coordinator.publish("plan", {"recipe": "r"})
    try:
        yield coordinator, coordinator.server.server_address[1]
    finally:
        coordinator.close()


def _send(port: int, method: str, key: str, headers: dict[str, str], body: bytes | None = None) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.putrequest(method, "/" + key)
        for name, value in headers.items():
            connection.putheader(name, value)
        if body is not None:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        return connection.getresponse().status
    finally:
        connection.close()


def _as(machine: int, credential_of: int | None = None) -> dict[str, str]:
    """Headers claiming ``machine`` with the credential of ``credential_of`` (default: its own)."""
    owner = machine if credential_of is None else credential_of
    return {"X-Hfscale-Machine": str(machine), "X-Hfscale-Token": machine_credential(TOKEN, owner)}


def _threads_started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_a_machine_writes_only_its_own_keys_and_reads_only_machine_0s(served, monkeypatch):
    coordinator, port = served
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    follower = Follower("127.0.0.1", port, 1)
    assert follower.put("ready/5/1", True) and follower.put("alive/1", 1.0) and follower.get("plan") == {"recipe": "r"}
    # The audit's writes: machine 1 writing machine 2's report and machine 3's heartbeat.
    for key in ("report/5/2", "alive/3", "env/2", "ready/0/0", "plan", "start/0"):
        with pytest.raises(ChannelRefused):
            follower.put(key, {"status": "ok"})
    assert all(coordinator.value(k) is None for k in ("report/5/2", "alive/3", "env/2", "ready/0/0", "start/0"))
    assert coordinator.value("plan") == {"recipe": "r"}
    # Reading another machine's report is refused too; its own keys and machine 0's are readable.
    coordinator.publish("report/5/2", {"status": "ok"})
    with pytest.raises(ChannelRefused):
        follower.get("report/5/2")
    assert follower.get("ready/5/1") is True
    with pytest.raises(ChannelRefused, match=r"refused 'report/5/2' \(403\): machine 1 may write only its own keys"):
        follower.put_until("report/5/2", {"status": "ok"})  # a refusal is final: no retry, no "machine 0 is gone"
    monkeypatch.setenv(TOKEN_ENV, "another")
    with pytest.raises(ChannelRefused, match="not machine 1's credential: set the same HFSCALE_SWEEP_TOKEN"):
        Follower("127.0.0.1", port, 1).get("plan")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(ChannelRefused, match=r"machine 3 is not one of this sweep's machines \(1 to 2\)"):
        Follower("127.0.0.1", port, 3).get("plan")


def test_a_machine_cannot_speak_for_another_one(served):
    coordinator, port = served
    # Machine 1's credential, claiming machine 2; the shared token itself; machine 0; a machine beyond the plan.
    for headers in (
        _as(2, credential_of=1),
        {"X-Hfscale-Machine": "2", "X-Hfscale-Token": TOKEN},
        _as(0),
        _as(3),
        {"X-Hfscale-Machine": "-1", "X-Hfscale-Token": machine_credential(TOKEN, 1)},
        {"X-Hfscale-Token": machine_credential(TOKEN, 1)},
    ):
        assert _send(port, "PUT", "alive/2", headers, b"1") == 403, headers
    assert coordinator.value("alive/2") is None
    assert coordinator.silent_for(2) is None  # a refused request does not count as machine 2 speaking
    assert _send(port, "PUT", "alive/2", _as(2), b"1") == 204 and coordinator.value("alive/2") == 1


def test_malformed_and_oversized_requests_store_nothing(served):
    coordinator, port = served
    assert _send(port, "PUT", "env/1", _as(1), b"{not json") == 400
    assert _send(port, "PUT", "env/1", {**_as(1), "Content-Length": "many"}) == 411
    assert _send(port, "PUT", "env/1", {**_as(1), "Content-Length": str(channel.MAX_BODY_BYTES + 1)}) == 413
    many = {f"X-Pad-{i}": "x" for i in range(MAX_HEADERS)}
    assert _send(port, "PUT", "env/1", {**_as(1), **many}, b"{}") == 431
    assert _send(port, "DELETE", "env/1", _as(1)) == 501
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert b"Error code: 400" in raw.recv(4096)  # not HTTP: answered as HTTP/0.9, the error page only
    assert coordinator.value("env/1") is None


def test_a_slow_or_silent_client_holds_no_thread(served, monkeypatch):
    coordinator, port = served
    monkeypatch.setattr(channel._Handler, "timeout", 0.5)
    monkeypatch.setattr(channel, "REQUEST_DEADLINE_S", 1.5)
    before = set(threading.enumerate())
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)
    silent.sendall(b"PUT /alive/1 HTTP/1.0\r\n")  # then nothing: a half-sent request
    dripping = socket.create_connection(("127.0.0.1", port), timeout=10)
    start = time.monotonic()
    try:
        dripping.sendall(b"PUT /alive/1 HTTP/1.0\r\n")
        with pytest.raises(OSError):  # one header byte every 0.3 s: under the socket timeout, cut at the deadline
            while time.monotonic() - start < 6:
                dripping.sendall(b"X")
                time.sleep(0.3)
        assert time.monotonic() - start < 4
        assert silent.recv(64) == b""  # closed by machine 0 after its socket timeout, no answer
    finally:
        silent.close()
        dripping.close()
    deadline = time.monotonic() + 5
    while _threads_started_since(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _threads_started_since(before) == []
    assert coordinator.value("alive/1") is None


def test_no_token_is_refused_unless_the_channel_listens_on_loopback(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ChannelError, match=f"{TOKEN_ENV} is not set.*--channel-bind 127.0.0.1"):
        Coordinator(0, bind="0.0.0.0")
    coordinator = Coordinator(0, bind="127.0.0.1", machines=2)  # every driver on this host
    try:
        port = coordinator.server.server_address[1]
        assert _send(port, "PUT", "alive/1", {"X-Hfscale-Machine": "1"}, b"1") == 204
        assert _send(port, "PUT", "alive/2", {"X-Hfscale-Machine": "1"}, b"1") == 403  # still its own keys only
    finally:
        coordinator.close()


def test_the_default_address_is_the_one_that_routes_to_machine_0():
    assert route_address(None) == "127.0.0.1"
    assert route_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ChannelError, match="--channel-bind"):
        route_address("no-such-host.invalid")
    with pytest.raises(ChannelError, match="--channel-bind"):
        route_address("a..b")  # not even encodable as a host name (UnicodeError inside)


def test_a_host_name_that_routes_to_loopback_on_machine_0_serves_every_interface(monkeypatch):
    """Debian maps the machine's own name to 127.0.1.1 in /etc/hosts, while the other machines resolve it to its
    network address: binding 127.0.1.1 would leave them waiting, so machine 0 serves on every interface (which
    needs the token)."""
    import hfscale.sweep.machines as machines

    monkeypatch.setattr(machines, "route_address", lambda host: "127.0.1.1" if host == "node-a" else "10.0.0.5")
    assert machines._default_bind("node-a") == "0.0.0.0"
    assert machines._default_bind("10.0.0.5") == "10.0.0.5"
    monkeypatch.setattr(machines, "route_address", lambda host: "127.0.0.1")
    assert machines._default_bind("127.0.0.1") == "127.0.0.1"  # every driver on this host: loopback stays


def test_the_channel_takes_every_machine_of_the_job_not_only_those_of_the_runs_left(monkeypatch):
    """A 3-machine job whose remaining runs span 2 machines: machine 2's driver still reads the plan."""
    from hfscale.launch.group import LaunchInfo
    from hfscale.launch.plan import SweepSettings
    from hfscale.sweep.machines import _serve

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    launch = LaunchInfo(machine_rank=0, num_machines=3, master_addr="127.0.0.1", channel_bind="127.0.0.1")
    coordinator = _serve(0, SweepSettings(num_machines=3), launch, ())
    try:
        coordinator.publish("plan", {"recipe": "r"})
        port = coordinator.server.server_address[1]
        assert Follower("127.0.0.1", port, 2).get("plan") == {"recipe": "r"}
        with pytest.raises(ChannelRefused, match=r"\(1 to 2\)"):
            Follower("127.0.0.1", port, 3).get("plan")
    finally:
        coordinator.close()
