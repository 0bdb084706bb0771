"""`localserve pull` against a local HTTP server shaped like the hub (no network here): the hub
answers with a 302 carrying X-Linked-Etag and X-Linked-Size, and the storage server it points
to answers without them. A whole download checked by that sha256, a resumed one, tampered,
partial and endless ones, a missing file, no network at all."""

import hashlib
import io
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from localserve.cli import main
from localserve.models.pull import PullError, pull, resolve

BLOB = bytes(range(256)) * 4096  # 1 MiB
NAME = "owner/Repo-GGUF/model-Q4_K_M.gguf"


class Hub(BaseHTTPRequestHandler):
    """/owner/...: the hub's 302 with the file's checksum and size; /cdn/...: the bytes."""
    served: dict = {}  # path -> bytes the storage server sends
    digests: dict = {}  # path -> the sha256 the hub announces
    ranges: list = []
    restart_ranges = False  # a storage server that answers a Range with 206 from byte 0
    endless = False  # a storage server that never stops sending
    unsized = False  # a mirror whose redirect announces no size

    def do_GET(self):
        if not self.path.startswith("/cdn"):
            return self._redirect()
        path = self.path.removeprefix("/cdn")
        body = self.served.get(path)
        start = 0
        if (asked := self.headers.get("Range")) is not None:
            self.ranges.append(asked)
            start = int(asked.removeprefix("bytes=").rstrip("-"))
        if start >= len(body) and start:
            self.send_response(416)
            self.end_headers()
            return
        sent_from = 0 if self.restart_ranges else start
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {sent_from}-{len(body) - 1}/{len(body)}")
        if not self.endless:
            self.send_header("Content-Length", str(len(body) - sent_from))
        self.end_headers()
        self.wfile.write(body[sent_from:])
        while self.endless:
            try:
                self.wfile.write(BLOB)
            except OSError:
                return

    def _redirect(self):
        if self.path not in self.served:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(302)
        self.send_header("Location", "/cdn" + self.path)
        self.send_header("X-Linked-Etag", f'"{self.digests.get(self.path, "")}"')
        if not self.unsized:
            self.send_header("X-Linked-Size", str(len(BLOB)))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    path = "/owner/Repo-GGUF/resolve/main/model-Q4_K_M.gguf"
    Hub.served, Hub.digests, Hub.ranges = {path: BLOB}, {path: hashlib.sha256(BLOB).hexdigest()}, []
    Hub.restart_ranges = Hub.endless = Hub.unsized = False
    yield path
    Hub.endless = False
    server.shutdown()


def test_a_whole_download_is_checked_by_the_redirects_checksum(hub, tmp_path):
    out = io.StringIO()
    path = pull(NAME, tmp_path, out=out)
    assert path.read_bytes() == BLOB and "sha256 checked" in out.getvalue()
    assert not list(tmp_path.glob("*.part")) and "%" in out.getvalue()


def test_tampered_bytes_behind_the_redirect_are_refused_and_deleted(hub, tmp_path):
    Hub.served[hub] = BLOB[:-1] + b"\x00"  # the storage server's bytes differ from the hub's sha
    with pytest.raises(PullError, match="sha256"):
        pull(NAME, tmp_path, out=io.StringIO())
    assert not list(tmp_path.iterdir())


def test_an_interrupted_download_is_continued_from_its_part_file(hub, tmp_path):
    (tmp_path / "model-Q4_K_M.gguf.part").write_bytes(BLOB[:300_000])
    path = pull(NAME, tmp_path, out=io.StringIO())
    assert Hub.ranges == ["bytes=300000-"] and path.read_bytes() == BLOB


@pytest.mark.parametrize("partial", [b"another file's start" * 1000, BLOB + b"garbage"])
def test_a_part_file_that_fails_the_check_is_fetched_again_from_the_start(hub, tmp_path, partial):
    """Another file's partial (resumed, then failing the check), or one longer than the file
    (the hub answers 416): both are deleted and the file fetched whole."""
    (tmp_path / "model-Q4_K_M.gguf.part").write_bytes(partial)
    out = io.StringIO()
    assert pull(NAME, tmp_path, out=out).read_bytes() == BLOB
    assert "starting over" in out.getvalue()


def test_a_206_that_restarts_at_byte_0_is_not_appended(hub, tmp_path):
    Hub.restart_ranges = True
    (tmp_path / "model-Q4_K_M.gguf.part").write_bytes(BLOB[:300_000])
    assert pull(NAME, tmp_path, out=io.StringIO()).read_bytes() == BLOB


def test_a_body_longer_than_announced_stops_at_the_announced_size(hub, tmp_path):
    Hub.endless = True
    with pytest.raises(PullError, match="more than"):
        pull(NAME, tmp_path, out=io.StringIO())
    assert (tmp_path / "model-Q4_K_M.gguf.part").stat().st_size <= len(BLOB)


def test_an_endless_body_of_no_announced_size_stops_at_max_gb(hub, tmp_path, capsys):
    """A mirror that announces no size (no X-Linked-Size, no Content-Length) and never stops:
    the pull stops at --max-gb with one line saying so, never writing past it."""
    Hub.endless = Hub.unsized = True
    assert main(["pull", NAME, "--dir", str(tmp_path), "--max-gb", "0.003"]) == 1
    assert "announced no size" in capsys.readouterr().err
    assert (tmp_path / "model-Q4_K_M.gguf.part").stat().st_size <= 3_000_000


def test_a_part_file_that_is_a_symlink_is_never_written_through(hub, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, tmp_path / "model-Q4_K_M.gguf.part")
    with pytest.raises(PullError, match="symbolic link"):
        pull(NAME, tmp_path, out=io.StringIO())
    assert victim.read_bytes() == b"keep me"


def test_missing_files_and_no_network_say_so_in_one_line(hub, tmp_path, monkeypatch, capsys):
    with pytest.raises(PullError, match="no such file"):
        pull("owner/Repo-GGUF/other.gguf", tmp_path, out=io.StringIO())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert main(["pull", NAME, "--dir", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "needs the internet once" in error


def test_short_names_resolve_and_unknown_ones_list_the_choices():
    assert resolve("llama3.2-3b")[1].endswith(".gguf")
    with pytest.raises(PullError, match="qwen2.5-7b"):
        resolve("gpt-5")
