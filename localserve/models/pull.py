"""`localserve pull NAME`: a model worth serving, downloaded into models/ from a model hub
(Hugging Face, or $HF_ENDPOINT: a mirror, or a test server). Resumable (a `.part` file is
continued with an HTTP Range request), checked (the hub's sha256, sent as the file's
X-Linked-Etag, or --sha256), with a progress line; offline, one line says what is needed.

NAME is a short name from RECOMMENDED (`localserve models` lists them), or `OWNER/REPO/FILE.gguf`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

CHUNK = 1 << 20
# A file whose size nobody announced (no X-Linked-Size, no Content-Length: a mirror, a proxy)
# is written up to this many bytes (`--max-gb`) and never past the disk's last RESERVE bytes:
# a server that never stops sending must not fill the disk.
UNANNOUNCED_MAX_BYTES = 100 * 10**9
RESERVE = 10**9


@dataclass(frozen=True)
class Recommended:
    name: str
    repo: str
    file: str
    size_gb: float  # the file
    ram_gb: int  # to serve it with an office's context (weights + an 8k-16k cache)
    what: str
    projector: str | None = None  # its mmproj file in the same repo: it reads images


# Q4_K_M quantizations by well-known quantizers: the usual balance of quality and size on CPUs
# and small GPUs. Names as they publish them (written without network access to check them: a
# wrong one is a clear "no such file"); the hub's own sha256 is checked at download.
RECOMMENDED = (
    Recommended("qwen2.5-7b", "bartowski/Qwen2.5-7B-Instruct-GGUF",
                "Qwen2.5-7B-Instruct-Q4_K_M.gguf", 4.7, 8,
                "office chat, summaries, tools; 29 languages"),
    Recommended("llama3.1-8b", "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF",
                "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", 4.9, 8,
                "office chat and tools, English first"),
    Recommended("qwen2.5-coder-7b", "bartowski/Qwen2.5-Coder-7B-Instruct-GGUF",
                "Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf", 4.7, 8,
                "code: editors' chat and completion (fill-in-the-middle)"),
    Recommended("llama3.2-3b", "bartowski/Llama-3.2-3B-Instruct-GGUF",
                "Llama-3.2-3B-Instruct-Q4_K_M.gguf", 2.0, 4,
                "laptops and small machines: quick answers, titles, tags"),
    Recommended("gemma3-4b", "bartowski/google_gemma-3-4b-it-GGUF",
                "google_gemma-3-4b-it-Q4_K_M.gguf", 2.5, 5,
                "small and multilingual; reads images (with its projector, 0.85 GB)",
                "mmproj-google_gemma-3-4b-it-f16.gguf"),
    Recommended("smolvlm-256m", "ggml-org/SmolVLM-256M-Instruct-GGUF",
                "SmolVLM-256M-Instruct-Q8_0.gguf", 0.18, 1,
                "a tiny model that reads images: trying image chats on any machine",
                "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf"),
    Recommended("nomic-embed", "nomic-ai/nomic-embed-text-v1.5-GGUF",
                "nomic-embed-text-v1.5.Q8_0.gguf", 0.14, 1,
                "embeddings for document search (RAG): serve with kind = \"embedding\""),
)


class PullError(Exception):
    """Why a download could not be made; the message is the one line shown."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def resolve(name: str) -> tuple[str, str]:
    """(repo, file) of a short name or of OWNER/REPO/FILE.gguf."""
    for model in RECOMMENDED:
        if model.name == name:
            return model.repo, model.file
    parts = name.split("/")
    if len(parts) == 3 and parts[2].endswith(".gguf"):
        return f"{parts[0]}/{parts[1]}", parts[2]
    names = ", ".join(m.name for m in RECOMMENDED)
    raise PullError(f"'{name}' is neither a recommended model ({names}) nor OWNER/REPO/FILE.gguf")


def projector_of(name: str) -> str | None:
    """A recommended model's projector as `localserve pull` names it (OWNER/REPO/FILE), if it
    has one."""
    found = next((m for m in RECOMMENDED if m.name == name), None)
    return f"{found.repo}/{found.projector}" if found and found.projector else None


def pull(name: str, folder: Path, sha256: str | None = None, out=sys.stderr,
         client: httpx.Client | None = None, max_bytes: int = UNANNOUNCED_MAX_BYTES) -> Path:
    """Download `name` into `folder` (continuing a .part left by an interrupted pull when the
    hub gives a checksum to check it by); the finished file's path. `max_bytes` bounds a file
    whose size was not announced. Raises PullError with the one line to show."""
    repo, file = resolve(name)
    target = folder / file
    if target.exists():
        print(f"{target} is already here", file=out)
        return target
    folder.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    if part.is_symlink():
        raise PullError(f"{part} is a symbolic link; remove it (pull writes only files of its own)")
    url = f"{endpoint()}/{repo}/resolve/main/{file}"
    own = client is None
    client = client or httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30, read=120))
    try:
        expected = _fetch(client, url, part, sha256, out, max_bytes)
    except httpx.HTTPError as exc:
        raise PullError(f"cannot download {url} ({exc.__class__.__name__}: {exc}): pulling needs "
                        f"the internet once (or HF_ENDPOINT naming a mirror); or fetch the file "
                        f"elsewhere and put it in {folder}") from None
    finally:
        if own:
            client.close()
    part.rename(target)
    print(f"{target}: {target.stat().st_size / 1e9:.2f} GB"
          + (", sha256 checked" if expected else ", no checksum given by the hub"), file=out)
    return target


def _fetch(client: httpx.Client, url: str, part: Path, sha256: str | None, out,
           max_bytes: int) -> str | None:
    """Download into `part` and check it; the sha256 it was checked against (None: none was
    given). A resumed .part that fails the check (another file's partial, a server that
    answered the Range wrongly) is deleted and the file fetched once more from byte 0."""
    resumed = part.exists() and part.stat().st_size > 0
    for attempt in range(2):
        expected = _download(client, url, part, out, attempt == 0, max_bytes) or sha256
        if sha256 and expected and sha256 != expected:
            raise PullError(f"--sha256 {sha256} differs from the hub's {expected}")
        digest = _sha256(part) if expected else None
        if digest == expected:
            return expected
        part.unlink()
        if not resumed or attempt:
            raise PullError(f"{part.name.removesuffix('.part')}: the download's sha256 is {digest}, "
                            f"the hub says {expected}; the partial file was deleted, pull again")
        print("the partial download did not match the hub's checksum; starting over", file=out)
    raise AssertionError("unreachable")  # pragma: no cover


def _download(client: httpx.Client, url: str, part: Path, out, resume: bool,
              max_bytes: int) -> str | None:
    """Fetch into `part`, continuing what it holds when `resume` and the hub names a checksum
    to check the whole by; the hub's sha256 of the file, if given. Never writes more than the
    hub said the file holds (or `max_bytes` and the disk's room less RESERVE when it said
    nothing), nor through a symlink, nor into a disk without room for it."""
    have = part.stat().st_size if resume and part.exists() else 0
    with client.stream("GET", url, headers={"Range": f"bytes={have}-"} if have else {}) as response:
        expected, size = _announced(response)
        if have and (expected is None or not _continues(response, have)):
            response.close()  # cannot be checked, or not a continuation: start over
            return _download(client, url, part, out, False, max_bytes)
        if response.status_code == 416 and have:  # nothing past the .part: checked after
            return expected
        if response.status_code == 404:
            raise PullError(f"no such file on the hub: {url}")
        response.raise_for_status()
        total = size if size is not None else have + int(response.headers.get("content-length") or 0)
        _check_room(part.parent, total - have)
        limit = total or min(max_bytes, have + shutil.disk_usage(part.parent).free - RESERVE)
        progress = Progress(total, have, out)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                     | (os.O_APPEND if have else os.O_TRUNC), 0o644)
        with os.fdopen(fd, "wb") as fh:
            for chunk in response.iter_bytes(CHUNK):
                if progress.have + len(chunk) > limit:
                    raise PullError(_too_long(total, limit, part))
                fh.write(chunk)
                progress.add(len(chunk))
        progress.done()
        return expected


def _too_long(total: int, limit: int, part: Path) -> str:
    if total:
        return (f"the hub sent more than the {total} bytes it announced; the partial file "
                f"{part} is left to be checked on the next pull")
    return (f"the server announced no size and sent more than {limit / 1e9:.2f} GB (--max-gb, "
            f"or the disk's free space less {RESERVE / 1e9:.0f} GB); the partial file {part} "
            f"is left (delete it, or pull again with a larger --max-gb)")


def _continues(response: httpx.Response, have: int) -> bool:
    """A 206 that starts at byte `have`, or a 416 (nothing past `have`)."""
    if response.status_code == 416:
        return True
    span = response.headers.get("content-range", "")
    return response.status_code == 206 and span.startswith(f"bytes {have}-")


def _check_room(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise PullError(f"the file needs {need / 1e9:.2f} GB more and {folder} has "
                        f"{free / 1e9:.2f} GB free")


def _announced(response: httpx.Response) -> tuple[str | None, int | None]:
    """The hub's sha256 (X-Linked-Etag, 64 hex digits) and size (X-Linked-Size) of the file.
    The hub sends them on its redirect to the storage server, not on the storage server's
    answer (huggingface_hub reads them from the redirect too): the first response that has
    them, from the first hop on."""
    for hop in (*response.history, response):
        tag = (hop.headers.get("x-linked-etag") or "").strip('"').removeprefix("W/").strip('"')
        if len(tag) == 64 and all(c in "0123456789abcdefABCDEF" for c in tag):
            size = hop.headers.get("x-linked-size", "")
            return tag.lower(), int(size) if size.isdigit() else None
    size = next((h.headers["x-linked-size"] for h in (*response.history, response)
                 if h.headers.get("x-linked-size", "").isdigit()), None)
    return None, int(size) if size else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


class Progress:
    """One line, rewritten at most twice a second: percent, bytes, speed."""

    def __init__(self, total: int, have: int, out):
        self.total, self.have, self.out = total, have, out
        self.started, self.shown, self.fresh = time.monotonic(), 0.0, 0

    def add(self, n: int) -> None:
        self.have += n
        self.fresh += n
        now = time.monotonic()
        if now - self.shown >= 0.5:
            self.shown = now
            self._show(now)

    def _show(self, now: float) -> None:
        speed = self.fresh / max(now - self.started, 1e-6) / 1e6
        share = f"{100 * self.have / self.total:5.1f}%" if self.total else "     "
        print(f"\r{share}  {self.have / 1e9:6.2f} / {self.total / 1e9:.2f} GB  {speed:6.1f} MB/s",
              end="", file=self.out, flush=True)

    def done(self) -> None:
        self._show(time.monotonic())
        print(file=self.out)


def recommended_table() -> str:
    lines = [f"{'name':<18}{'file':>8}{'RAM':>6}  what for"]
    lines += [f"{m.name:<18}{m.size_gb:>6.1f}GB{m.ram_gb:>4}GB  {m.what}" for m in RECOMMENDED]
    return "\n".join(lines)
