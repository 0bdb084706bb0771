"""`--host` as llama-server reads it (its own test suite's test_basic starts it with
`--host 127.0.0.1,::1`): addresses separated by commas, and UNIX socket paths ending in .sock,
each bound before "listening on" is printed."""

import socket

import httpx
import pytest

from conftest import RunningServer
from localserve.common.config import SettingsError
from localserve.common.net import listen_addresses, local_only
from localserve.listen import bind_all


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_server_answers_on_every_address_and_removes_its_socket_file(tmp_path):
    path = tmp_path / "localserve.sock"
    hosts = ["127.0.0.1", *(["::1"] if ipv6_loopback() else []), str(path)]
    srv = RunningServer("--host", ",".join(hosts), "-c", "512", "-np", "1", log_name="listen")
    try:
        srv.wait_ready()
        urls = [f"http://{'[::1]' if h == '::1' else h}:{srv.port}" for h in hosts[:-1]]
        clients = [httpx.Client(base_url=url) for url in urls] + [httpx.Client(
            transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost")]
        for client in clients:
            with client:
                assert client.get("/health").status_code == 200
                answer = client.post("/v1/completions", timeout=60, json={
                    "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).json()
                assert answer["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert f"listening on unix:{path}" in log and f"listening on http://127.0.0.1:{srv.port}" in log
    assert not path.exists()


def test_addresses_are_read_as_llama_server_reads_them():
    assert listen_addresses(" 127.0.0.1, ::1,,127.0.0.1 ") == ["127.0.0.1", "::1"]
    assert listen_addresses("0.0.0.0") == ["0.0.0.0"]
    assert local_only("127.0.0.1,::1,/run/localserve.sock")
    assert not local_only("127.0.0.1,0.0.0.0")  # the key warning and the Host guard ask this


def test_a_taken_address_is_named_and_the_ones_bound_before_it_are_let_go():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(SettingsError, match="--host localhost --port .*cannot listen there"):
        bind_all("127.0.0.1,localhost", port)  # the same address twice
    for sock in bind_all("127.0.0.1", port):  # the first was closed
        sock.close()


def test_a_stale_socket_file_is_replaced_but_a_live_one_or_another_file_is_not(tmp_path):
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(stale))  # a server that died without removing its file
    for sock in bind_all(str(stale), 0):
        sock.close()
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(live))
        other.listen()
        with pytest.raises(SettingsError, match="another server is listening on that socket"):
            bind_all(str(live), 0)
    notes = tmp_path / "notes.sock"
    notes.write_text("mine")
    with pytest.raises(SettingsError, match="exists and is not a socket"):
        bind_all(str(notes), 0)
    assert notes.read_text() == "mine"


def test_a_socket_file_is_private_whatever_the_umask_and_its_server_removes_only_its_own(tmp_path):
    """Hardening round 7, case 6: under umask 000 a keyless server's socket was anyone's; a
    stopping server removed the socket file of a newer one on the same path."""
    import os

    from localserve.listen import remove_unix_sockets

    path = str(tmp_path / "office.sock")
    old = os.umask(0)
    try:
        first = bind_all(path, 0)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600
    for sock in first:
        sock.close()
    os.unlink(path)  # a newer server (another process) found it stale and made its own
    with socket.socket(socket.AF_UNIX) as newer:
        newer.bind(path)
        remove_unix_sockets(path)  # ...then the first one exits
        assert os.path.exists(path)
    remove_unix_sockets(path)
    assert os.path.exists(path)
