"""The prompt cache's disk tier (--cache-disk MiB, files under <state-dir>/prompt-cache): what
the RAM tier evicts, and everything it holds at a clean shutdown or unload, is written to
files, so a returning colleague's document survives a restart.

A file holds one sequence: a header line of JSON (format, the model's fingerprint, scope,
token ids, state size and CRC-32) and the state's bytes. Anything foreign (another model,
cache type or llama.cpp), truncated or corrupted is logged and deleted, never loaded. KV state
is as sensitive as the text it encodes: files are 0600 in a 0700 folder, and a removed key's
files are deleted with it (PromptCache.drop_scope).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import uuid
import zlib
from pathlib import Path

from localserve.common.private_state import private_dir

log = logging.getLogger("localserve.cache")
FORMAT = "localserve-prompt-cache/1"


class DiskTier:
    def __init__(self, folder: Path, max_bytes: int, fingerprint: str):
        self.folder = private_dir(folder)
        self.max_bytes, self.fingerprint = max_bytes, fingerprint

    def write(self, scope: str | None, tokens: list[int], state) -> tuple[Path, int] | None:
        """Write one sequence; (its file, its size on disk), or None if the disk refused."""
        header = json.dumps({"format": FORMAT, "model": self.fingerprint, "scope": scope,
                             "tokens": tokens, "state_bytes": len(memoryview(state)),
                             "crc32": zlib.crc32(state)}).encode() + b"\n"
        path = self.folder / f"{uuid.uuid4().hex}.cache"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)
                fh.write(state)
        except OSError as exc:
            log.warning("prompt cache: could not write %s (%s); keeping it in RAM only", path, exc)
            path.unlink(missing_ok=True)
            return None
        return path, len(header) + len(memoryview(state))

    def read(self, path: Path) -> tuple[dict, bytes] | None:
        """(header, state) of a sound file of this model; None (logged, file deleted) else."""
        try:
            with open_regular(path) as fh:
                header = json.loads(fh.readline(1 << 24))
                state = fh.read()
            problem = self._problem(header, state)
        except (OSError, ValueError) as exc:
            problem = f"unreadable ({exc.__class__.__name__})"
        if problem:
            log.warning("prompt cache: skipped and deleted %s: %s", path.name, problem)
            discard(path)
            return None
        return header, state

    def _problem(self, header, state: bytes) -> str | None:
        return self._header_problem(header, len(state)) or (
            "corrupted" if zlib.crc32(state) != header.get("crc32") else None)

    def _header_problem(self, header, state_bytes: int) -> str | None:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            return "not a prompt cache file"
        if header.get("model") != self.fingerprint:
            return "made for another model, cache type or llama.cpp"
        if state_bytes != header.get("state_bytes"):
            return "truncated"
        tokens = header.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return "no token list"
        return None

    def scan(self) -> list[tuple[Path, dict, int]]:
        """Every file whose header is sound, oldest first: (path, header, size); the others
        are deleted. The state's checksum is checked when it is read (read())."""
        found = []
        for path in sorted(self.folder.glob("*.cache"), key=lambda p: p.lstat().st_mtime):
            if not stat.S_ISREG(path.lstat().st_mode):  # a folder, FIFO or link planted here
                log.warning("prompt cache: skipped %s: not a regular file", path.name)
                continue
            try:
                with open_regular(path) as fh:
                    header = json.loads(fh.readline(1 << 24))
                    start = fh.tell()
                    size = os.fstat(fh.fileno()).st_size
                problem = self._header_problem(header, size - start)
            except (OSError, ValueError) as exc:
                problem = f"unreadable ({exc.__class__.__name__})"
            if problem:
                log.warning("prompt cache: skipped and deleted %s: %s", path.name, problem)
                discard(path)
            else:
                found.append((path, header, size))
        return found


def open_regular(path: Path):
    """Open a regular file for reading without ever blocking or following a link: a FIFO
    or a folder put in the cache's place is an OSError, not a hang or a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(f"{path.name} is not a regular file")
    return os.fdopen(fd, "rb")


def discard(path: Path) -> None:
    """Delete a file of the cache's; something else in its place is left alone."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
