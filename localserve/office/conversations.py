"""Conversations of the web page, kept server-side per identity in <state-dir>/conversations.db
(SQLite, WAL), so a member sees their history from any browser and never anyone else's.

A conversation is stored whole (title, the messages as JSON, settings) and replaced on each
save; the page saves after every exchange. Ids are the client's, within its owner's own
namespace: the same id from two keys names two conversations, so a save never tells one key
whether another uses an id. Bounded per conversation and per owner in bytes
(and in count); deleting gives the space back (incremental vacuum). Owner = the API key's name, or "local" on a
no-key (loopback, one desktop user) server.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from localserve.common.private_state import private_dir, private_file

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT, body TEXT NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_owner ON conversations (owner, updated);
"""
# The client's id within its owner's namespace (rows stored before it was added: their id).
NAMES = """
ALTER TABLE conversations ADD COLUMN name TEXT;
UPDATE conversations SET name = id;
"""
MAX_CONVERSATIONS = 1000  # per owner; the oldest go first
MAX_CONVERSATION_BYTES = 2 * 1024 * 1024  # one conversation as stored (JSON)
MAX_OWNER_BYTES = 64 * 1024 * 1024  # all of one owner's conversations
MAX_TOTAL_BYTES = 1024 * 1024 * 1024  # everyone's, in one store (N keys x 64 MiB otherwise)


def scoped(owner: str, conversation_id: str) -> str:
    """The row's key: the client's id within its owner's namespace."""
    return hashlib.sha256(f"{owner}\0{conversation_id}".encode()).hexdigest()


class TooLarge(ValueError):
    """A save that would pass a byte bound; the message says which and by how much."""


class Conversations:
    def __init__(self, state_dir: Path, file_name: str = "conversations.db"):
        self.path = private_file(private_dir(state_dir) / file_name)
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=5)
        if self._db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # deletes give space back
            self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            self._db.execute("VACUUM")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(conversations)")}
        if "name" not in columns:
            with self._db:
                self._db.executescript(NAMES)
        self._db.execute("CREATE INDEX IF NOT EXISTS conversations_name ON conversations "
                         "(owner, name)")
        self._lock = threading.Lock()
        # Bytes stored, per owner and in all (a save checks its bounds without summing
        # the owner's rows under the lock: a flooder's saves must not hold everyone's reads).
        self._bytes: dict[str, int] = dict(self._db.execute(
            "SELECT owner, SUM(length(body)) FROM conversations GROUP BY owner").fetchall())

    def room(self, owner: str) -> int:
        """Bytes `owner` may still store (their bound, and everyone's)."""
        return max(0, min(MAX_OWNER_BYTES - self._bytes.get(owner, 0),
                          MAX_TOTAL_BYTES - sum(self._bytes.values())))

    def list(self, owner: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT name, title, updated FROM conversations WHERE owner = ? "
                                    "ORDER BY updated DESC", (owner,)).fetchall()
        return [{"id": i, "title": t, "updated": u} for i, t, u in rows]

    def get(self, owner: str, conversation_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT name, title, body, created, updated FROM conversations "
                                   "WHERE owner = ? AND name = ?", (owner, conversation_id)).fetchone()
        if row is None:
            return None
        return {"id": row[0], "title": row[1], **json.loads(row[2]), "created": row[3],
                "updated": row[4]}

    def save(self, owner: str, conversation_id: str | None, title: str, body: dict) -> str:
        conversation_id = conversation_id or uuid.uuid4().hex
        now = time.time()
        text = json.dumps(body)
        if len(text) > MAX_CONVERSATION_BYTES:
            raise TooLarge(f"this conversation is {len(text)} bytes; one may be at most "
                           f"{MAX_CONVERSATION_BYTES}")
        with self._lock, self._db:
            found = self._db.execute("SELECT id, length(body) FROM conversations WHERE owner = ? "
                                     "AND name = ?", (owner, conversation_id)).fetchone()
            row_id = found[0] if found else scoped(owner, conversation_id)
            replaced = found[1] if found else 0
            others = self._bytes.get(owner, 0) - replaced
            if others + len(text) > MAX_OWNER_BYTES:
                raise TooLarge(f"your conversations take {others} bytes, and this one {len(text)} "
                               f"more; the limit is {MAX_OWNER_BYTES}: delete some first")
            if sum(self._bytes.values()) - replaced + len(text) > MAX_TOTAL_BYTES:
                raise TooLarge(f"this server's store is full ({MAX_TOTAL_BYTES} bytes for "
                               f"everyone): ask its admin")
            self._db.execute(
                "INSERT INTO conversations (id, owner, title, body, created, updated, name) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET title = "
                "excluded.title, body = excluded.body, updated = excluded.updated",
                (row_id, owner, title[:200], text, now, now, conversation_id))
            dropped = self._db.execute(
                "DELETE FROM conversations WHERE owner = ? AND id NOT IN (SELECT id FROM "
                "conversations WHERE owner = ? ORDER BY updated DESC LIMIT ?) "
                "RETURNING length(body)", (owner, owner, MAX_CONVERSATIONS)).fetchall()
            self._bytes[owner] = others + len(text) - sum(n for (n,) in dropped)
        return conversation_id

    def delete(self, owner: str, conversation_id: str) -> bool:
        with self._lock, self._db:
            cur = self._db.execute("DELETE FROM conversations WHERE owner = ? AND name = ? "
                                   "RETURNING length(body)", (owner, conversation_id))
            gone = cur.fetchall()
            self._bytes[owner] = self._bytes.get(owner, 0) - sum(n for (n,) in gone)
        with self._lock:
            self._db.executescript("PRAGMA incremental_vacuum;")  # execute() frees one page only
        return bool(gone)

    def export(self, owner: str) -> str:
        """All of one owner's conversations as one JSON text (at most MAX_OWNER_BYTES of
        bodies): call it on a worker thread."""
        return json.dumps([self.get(owner, c["id"]) for c in self.list(owner)], indent=1)
