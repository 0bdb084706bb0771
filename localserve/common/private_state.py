"""The state folder holds chat text, usage and (with a disk cache) prompts' KV state: as
private as the text itself. Folders are made 0700 and files 0600; a folder or file found
looser (made by an older version, or by hand) is tightened, with a log line saying so."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("localserve")


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty if missing; either way leave it readable by its owner only.
    SQLite gives its -wal and -shm files the database file's mode."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    _tighten(path, 0o600)
    return path


def _tighten(path: Path, mode: int) -> None:
    current = stat.S_IMODE(path.stat().st_mode)
    if current & 0o077:
        log.warning("%s was readable by others (mode %o); making it %o", path, current, mode)
        os.chmod(path, mode)
