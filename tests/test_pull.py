"""`localserve pull` against a local HTTP server standing in for the hub (no network here):
a whole download checked by the hub's sha256, a resumed one, a corrupted one, a missing file,
no network at all."""

import hashlib
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from localserve.cli import main
from localserve.pull import PullError, pull, resolve

BLOB = bytes(range(256)) * 4096  # 1 MiB


class Hub(BaseHTTPRequestHandler):
    served: dict = {}  # path -> bytes
    digests: dict = {}  # path -> the sha256 to announce
    ranges: list = []

    def do_GET(self):
        body = self.served.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        start = 0
        if (asked := self.headers.get("Range")) is not None:
            self.ranges.append(asked)
            start = int(asked.removeprefix("bytes=").rstrip("-"))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.send_header("X-Linked-Etag", f'"{self.digests.get(self.path, "")}"')
        self.end_headers()
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture()
def hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    path = "/owner/Repo-GGUF/resolve/main/model-Q4_K_M.gguf"
    Hub.served, Hub.digests, Hub.ranges = {path: BLOB}, {path: hashlib.sha256(BLOB).hexdigest()}, []
    yield path
    server.shutdown()


def test_a_whole_download_is_checked_and_lands_in_the_folder(hub, tmp_path):
    out = io.StringIO()
    path = pull("owner/Repo-GGUF/model-Q4_K_M.gguf", tmp_path, out=out)
    assert path.read_bytes() == BLOB and "sha256 checked" in out.getvalue()
    assert not list(tmp_path.glob("*.part")) and "%" in out.getvalue()


def test_an_interrupted_download_is_continued_from_its_part_file(hub, tmp_path):
    (tmp_path / "model-Q4_K_M.gguf.part").write_bytes(BLOB[:300_000])
    path = pull("owner/Repo-GGUF/model-Q4_K_M.gguf", tmp_path, out=io.StringIO())
    assert Hub.ranges == ["bytes=300000-"] and path.read_bytes() == BLOB


def test_a_corrupted_download_is_refused_and_deleted(hub, tmp_path):
    Hub.digests[hub] = "0" * 64
    with pytest.raises(PullError, match="sha256"):
        pull("owner/Repo-GGUF/model-Q4_K_M.gguf", tmp_path, out=io.StringIO())
    assert not list(tmp_path.iterdir())


def test_missing_files_and_no_network_say_so_in_one_line(hub, tmp_path, monkeypatch, capsys):
    with pytest.raises(PullError, match="no such file"):
        pull("owner/Repo-GGUF/other.gguf", tmp_path, out=io.StringIO())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert main(["pull", "owner/Repo-GGUF/model-Q4_K_M.gguf", "--dir", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "needs the internet once" in error


def test_short_names_resolve_and_unknown_ones_list_the_choices():
    assert resolve("llama3.2-3b")[1].endswith(".gguf")
    with pytest.raises(PullError, match="qwen2.5-7b"):
        resolve("gpt-5")
