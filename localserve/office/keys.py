"""API keys as the operator writes them: --api-key values and a key file of
'name:key[:role][:models=a,b]' lines. Read at start-up and on SIGHUP; checked per request in
api/auth.py. A file that yields no key stops start-up (keys fail closed)."""

from __future__ import annotations

import logging
import stat
import time
from pathlib import Path
from typing import NamedTuple

from localserve.common.config import Settings, SettingsError

log = logging.getLogger("localserve")


ROLES = ("admin", "user")
MODELS = "models="  # the key file's last field naming the models a key may use


class KeyHolder(NamedTuple):
    """Whom a key names: a colleague's name, role, and the models (names or aliases) the key
    may use, None for every model (an intern's key kept off the 70B that would evict all)."""

    name: str
    role: str
    models: frozenset[str] | None = None


def load_keys(settings: Settings) -> dict[str, KeyHolder]:
    """{key: holder}. --api-key values are the operator's: admins named key-1, key-2... with
    every model; a key file gives its own names, roles (user unless it says admin) and models."""
    keys = {key: KeyHolder(f"key-{i}", "admin") for i, key in enumerate(settings.api_keys, 1)}
    if settings.api_key_file:
        keys.update(read_key_file(Path(settings.api_key_file)))
    return keys


def read_key_file(path: Path) -> dict[str, KeyHolder]:
    """'name:key', 'name:key:role' lines (role admin or user, default user), either ending
    with ':models=a,b' to limit the key to those models; '#' comments. Refuses a file that
    yields no key at all."""
    if not path.is_file():
        raise SettingsError(f"--api-key-file {path}: no such file")
    try:
        text = _settled_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(f"--api-key-file {path}: not UTF-8 text (byte {exc.start}); save it "
                            f"as UTF-8") from None
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--api-key-file %s can be read by other users of this machine: "
                    "chmod 600 %s", path, path)
    keys, lines = {}, {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = (part.strip() for part in line.partition(":"))
        key, models = _models_field(key)
        role = "user"
        head, colon, tail = key.rpartition(":")
        if colon and tail.strip() in ROLES:
            key, role = head.strip(), tail.strip()
        if not sep or not name or len(key) < 8 or models == frozenset():
            raise SettingsError(f"--api-key-file {path}, line {n}: expected 'name:key' or "
                                f"'name:key:role' with a key of at least 8 characters, "
                                f"optionally ending ':models=NAME,NAME'")
        if key in keys:
            raise SettingsError(f"--api-key-file {path}, line {n}: '{name}' has the same key as "
                                f"'{keys[key][0]}' on line {lines[key]}; each colleague needs a "
                                f"key of their own (one of them would silently be the other)")
        keys[key], lines[key] = KeyHolder(name, role, models), n
    if not keys:
        raise SettingsError(f"--api-key-file {path}: no keys in it (only blank or '#' lines); "
                            f"refusing to start without the authentication it was meant to give. "
                            f"Add lines 'name:key'.")
    return keys


def _models_field(key: str) -> tuple[str, frozenset[str] | None]:
    """The key without a trailing ':models=a,b' field, and the names in that field (None
    without one: every model)."""
    head, colon, tail = key.rpartition(":")
    if not colon or not tail.strip().startswith(MODELS):
        return key, None
    names = tail.strip()[len(MODELS):].split(",")
    return head.strip(), frozenset(name.strip() for name in names if name.strip())


def _settled_bytes(path: Path, tries: int = 20) -> bytes:
    """The file's bytes once two reads 50 ms apart agree: a SIGHUP sent while an editor is
    rewriting the file in place must not load half of it (and lock out the other half)."""
    data = path.read_bytes()
    for _ in range(tries):
        time.sleep(0.05)
        again = path.read_bytes()
        if again == data:
            return data
        data = again
    raise SettingsError(f"--api-key-file {path}: it kept changing while being read; send "
                        f"SIGHUP again once it is saved")
