"""Connection hygiene and keys that fail closed, on the real server: slow header senders
are cut off and cannot crowd out normal clients; a key file that yields no key, or cannot be
read as text, stops start-up; non-ASCII keys match."""

import resource
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import ROOT, running, wait_for

N_SLOW = 1100  # more sockets than a 1,024 open-files limit allows


def low_open_files_limit():
    """In the server's child process: the common default soft limit of 1,024 files."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))


def own_open_files_at_least(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"this machine allows only {hard} open files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def trickle(port: int, stop: threading.Event, opened: list, n: int = N_SLOW):
    """Open n sockets and send each one's headers a byte at a time, until stopped."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"z" * 200
    socks = []
    try:
        for _ in range(n):
            if stop.is_set():
                return
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        opened.append(len(socks))
        i = 0
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(request[i % len(request):i % len(request) + 1])
                except OSError:
                    pass  # closed by the server: that is the point
            i += 1
            stop.wait(0.2)
    finally:
        for s in socks:
            s.close()


def test_slow_header_senders_cannot_crowd_out_a_normal_client():
    own_open_files_at_least(N_SLOW + 200)
    with running("-c", "1024", "-np", "1", "-t", "2", "--header-timeout", "3",
                 preexec_fn=low_open_files_limit, log_name="slowloris") as srv:
        stop, opened = threading.Event(), []
        slow = threading.Thread(target=trickle, args=(srv.port, stop, opened))
        slow.start()
        try:
            wait_for(lambda: opened, timeout=60, what="the slow sockets to open")
            assert opened == [N_SLOW]
            served = []

            def a_normal_client_is_answered_until_the_header_deadline_has_struck():
                """One /health and one completion per call, while the slow sockets trickle;
                done once 8 rounds passed and the server has closed slow header-senders."""
                assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
                r = httpx.post(srv.url + "/v1/completions", timeout=60,
                               json={"prompt": f"Count: {len(served)}", "max_tokens": 2})
                assert r.status_code == 200, r.text
                served.append(r)
                return len(served) >= 8 and "no complete headers within" in srv.log()

            wait_for(a_normal_client_is_answered_until_the_header_deadline_has_struck,
                     timeout=120, interval=0, what="the header deadline to close slow sockets")
        finally:
            stop.set()
            slow.join(timeout=30)
        log = srv.log()
    assert log.count("Traceback") == 0, log[-3000:]
    assert "out of system resource" not in log  # the open-files limit was raised to the hard one
    assert "closed the connection waiting longest" in log or "--header-timeout" in log


def only_1024_open_files():
    """In the server's child process: a hard limit of 1,024 files, which it cannot raise."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_a_burst_past_the_open_files_limit_does_not_hold_a_normal_client_until_the_deadline():
    """3,000 slow sockets at once against a server that may open 1,024 files: asyncio accepts
    its whole backlog in one turn, runs out of files and used to pause accepting for 1 s at
    every try, so a normal client queued behind the burst was answered only once the header
    deadline closed the slow sockets (10.7 s with the 10 s default). Out of files, the server
    now sheds the connections waiting longest and accepts again at once."""
    burst = 3000
    own_open_files_at_least(burst + 200)
    with running("-c", "512", "-np", "1", "-t", "2", "--header-timeout", "120",
                 preexec_fn=only_1024_open_files, log_name="fd-burst") as srv:
        stop, opened = threading.Event(), []
        slow = threading.Thread(target=trickle, args=(srv.port, stop, opened, burst))
        slow.start()
        try:
            wait_for(lambda: opened, timeout=60, what="the slow sockets to open")
            assert httpx.get(srv.url + "/health", timeout=100).status_code == 200
            log = srv.log()
        finally:
            stop.set()
            slow.join(timeout=30)
    assert "out of system resource" in log  # the burst did run the server out of files
    assert "no complete headers within" not in log  # answered before any header deadline
    assert "closed the connections waiting longest for their headers or body" in log
    assert log.count("Traceback") == 0, log[-3000:]


def test_a_client_that_never_finishes_its_headers_is_closed():
    with running("-c", "512", "-np", "1", "-t", "2", "--header-timeout", "1",
                 log_name="header-timeout") as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            started = time.monotonic()
            assert s.recv(1024) == b""  # closed by the server, not by our 10 s timeout
            assert time.monotonic() - started < 8


def start_refused(*args):
    return subprocess.run([sys.executable, "-m", "localserve", "up", "--port", "1", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_key_file_without_keys_refuses_to_start(tmp_path):
    empty = tmp_path / "keys.txt"
    empty.write_text("# alice:to-be-added\n\n   \n")
    run = start_refused("--host", "0.0.0.0", "--api-key-file", str(empty))
    assert run.returncode == 2 and "no keys in it" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_key_file_that_is_not_utf8_is_named_clearly(tmp_path):
    latin = tmp_path / "keys.txt"
    latin.write_bytes("bob:n\xf8kkel-secret\n".encode("latin-1"))
    run = start_refused("--api-key-file", str(latin))
    assert run.returncode == 2 and "not UTF-8" in run.stderr and "Traceback" not in run.stderr


def test_non_ascii_keys_match_and_loose_key_files_are_warned_about(tmp_path):
    keyfile = tmp_path / "keys.txt"
    key = "bøb-nøkkel-секрет"
    keyfile.write_text(f"bob:{key}\n", encoding="utf-8")
    keyfile.chmod(0o644)
    with running("-c", "512", "-np", "1", "-t", "2", "--api-key-file", str(keyfile),
                 "--api-key", "cli-key-12345678", log_name="utf8-keys") as srv:
        ok = httpx.get(srv.url + "/v1/models", headers={"X-Api-Key": key.encode("utf-8")})
        assert ok.status_code == 200
        wrong = httpx.get(srv.url + "/v1/models", headers={"X-Api-Key": key.encode("latin-1", "replace")})
        assert wrong.status_code == 401
        log = srv.log()
    assert "can be read by other users" in log and "chmod 600" in log
    assert "visible to every user of this machine" in log
