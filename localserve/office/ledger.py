"""The office's ledger: who used how much, kept in one SQLite file (WAL) under --state-dir.

One row per finished request (key name, endpoint, model, token counts, finish reason, queue
time, duration, status, time) and one per audit event (401s, quota refusals, key changes).
Never a prompt or an answer. The engine loop only puts a dict on a queue; a writer thread
inserts in batches twice a second, so a crash loses at most the last half second, and a
full disk, a read-only or deleted file costs a logged warning, never a request.
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from collections import defaultdict
from pathlib import Path

from localserve.engine.finish import FinishReason
from localserve.common.private_state import private_dir, private_file

log = logging.getLogger("localserve.office.ledger")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    ts REAL NOT NULL, key TEXT, endpoint TEXT, model TEXT,
    prompt_tokens INTEGER, cached_tokens INTEGER, completion_tokens INTEGER,
    finish_reason TEXT, queue_s REAL, duration_s REAL, status INTEGER);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TABLE IF NOT EXISTS audit (ts REAL NOT NULL, event TEXT, key TEXT, detail TEXT);
"""
# The statements, in one place. `pragma: no mutate`: SQL keywords are read in any case, so
# mutation testing's change of case is no change (scripts/mutation).
TOTALS_SINCE = ("SELECT key, SUM(prompt_tokens + completion_tokens) "  # pragma: no mutate
                "FROM requests WHERE ts >= ? GROUP BY key")  # pragma: no mutate
INSERT_REQUEST = ("INSERT INTO requests VALUES (:ts, :key, :endpoint, "  # pragma: no mutate
                  ":model, :prompt_tokens, :cached_tokens, "  # pragma: no mutate
                  ":completion_tokens, :finish_reason, :queue_s, "  # pragma: no mutate
                  ":duration_s, :status)")  # pragma: no mutate
INSERT_AUDIT = "INSERT INTO audit VALUES (:ts, :event, :key, :detail)"  # pragma: no mutate
TRIM_AUDIT = ("DELETE FROM audit WHERE rowid <= "  # pragma: no mutate
              "(SELECT MAX(rowid) FROM audit) - ?")  # pragma: no mutate
AUDIT_SINCE = ("SELECT ts, event, key, detail FROM audit "  # pragma: no mutate
               "WHERE ts >= ? ORDER BY ts")  # pragma: no mutate
USAGE = ("SELECT {group} AS g, SUM(prompt_tokens), SUM(cached_tokens), "  # pragma: no mutate
         "SUM(completion_tokens), COUNT(*), "  # pragma: no mutate
         "SUM(finish_reason = 'refused') FROM requests "  # pragma: no mutate
         "WHERE {where} GROUP BY g ORDER BY g")  # pragma: no mutate
FILTERS = (("ts >= ?", "since"), ("ts < ?", "until"), ("key = ?", "key"),  # pragma: no mutate
           ("model = ?", "model"))  # pragma: no mutate
FLUSH_S = 0.5
MAX_AUDIT_ROWS = 100_000  # about 20 MB: details are short (see api/auth.py RefusalLog)
GROUPS = {"key": "key", "model": "model", "day": "date(ts, 'unixepoch', 'localtime')"}


def default_state_dir() -> Path:
    """Without --state-dir: systemd's StateDirectory= ($STATE_DIRECTORY, its first folder),
    else the user's data folder."""
    given = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if given:
        return Path(given)
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "localserve"


def state_dir(settings) -> Path:
    """Where the ledger, conversations and disk cache live: --state-dir, else the default."""
    return Path(settings.state_dir) if settings.state_dir else default_state_dir()


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=5, check_same_thread=False)  # pragma: no mutate
    db.execute("PRAGMA journal_mode=WAL")  # pragma: no mutate
    db.execute("PRAGMA synchronous=NORMAL")  # pragma: no mutate
    db.executescript(SCHEMA)
    return db


class Ledger:
    def __init__(self, state_dir: Path):
        self.path = private_file(private_dir(state_dir) / "ledger.db")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._warned = False
        self._db = connect(self.path)
        self._day, self._month = time.strftime("%Y-%m-%d"), time.strftime("%Y-%m")
        self.today = self._totals_since(self._day)  # key -> tokens today, for quotas
        self.month = self._totals_since(self._month + "-01")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._writer = threading.Thread(  # pragma: no mutate
            target=self._write_loop, name="localserve-ledger", daemon=True)  # pragma: no mutate
        self._writer.start()

    # ---- called from the engine loop and the HTTP side (cheap: a queue put) -----------
    def record(self, row: dict) -> None:
        with self._lock:
            self._roll_day()
            tokens = row["prompt_tokens"] + row["completion_tokens"]
            self.today[row["key"]] += tokens
            self.month[row["key"]] += tokens
        self._queue.put(("requests", row))

    def audit(self, event: str, key: str | None, detail: str = "") -> None:
        self._queue.put(("audit", {"ts": time.time(), "event": event, "key": key,
                                   "detail": detail}))

    def tokens_used(self, key: str) -> tuple[int, int]:
        """(today, this month): prompt + completion tokens of finished requests."""
        with self._lock:
            self._roll_day()
            return self.today[key], self.month[key]

    def close(self) -> None:
        self._stop.set()
        self._writer.join(timeout=5)  # pragma: no mutate

    # ---- the writer thread ----------------------------------------------------------
    def _roll_day(self) -> None:
        day, month = time.strftime("%Y-%m-%d"), time.strftime("%Y-%m")
        if day != self._day:
            self._day, self.today = day, defaultdict(int)
        if month != self._month:
            self._month, self.month = month, defaultdict(int)

    def _totals_since(self, date: str) -> defaultdict:
        start = time.mktime(time.strptime(date, "%Y-%m-%d"))
        rows = self._db.execute(TOTALS_SINCE, (start,)).fetchall()
        return defaultdict(int, {k: int(n or 0) for k, n in rows})

    def _write_loop(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        batch = {"requests": [], "audit": []}
        while True:
            try:
                table, row = self._queue.get_nowait()
            except queue.Empty:
                break
            batch[table].append(row)
        if not batch["requests"] and not batch["audit"]:
            return
        try:
            with self._db:
                self._db.executemany(INSERT_REQUEST, batch["requests"])
                self._db.executemany(INSERT_AUDIT, batch["audit"])
                if batch["audit"]:  # the oldest audit rows go: the table stays bounded
                    self._db.execute(TRIM_AUDIT, (MAX_AUDIT_ROWS,))
            self._warned = False
        except sqlite3.Error as exc:  # full disk, read-only or deleted file: never fail a request
            if not self._warned:
                log.warning("could not write the ledger %s (%s); usage of %d requests is lost "
                            "until it is writable again", self.path, exc, len(batch["requests"]))
                self._warned = True


def usage(path: Path, since: float | None = None, until: float | None = None,
          group_by: str = "key", key: str | None = None, model: str | None = None) -> list[dict]:
    """Rows {group: ..., prompt_tokens, cached_tokens, completion_tokens, requests} from the
    ledger file (read-only; the server need not run). `key` limits it to one key's rows,
    `model` to one model's (servers started without --state-dir share one ledger)."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}")
    if not path.is_file():
        return []
    where, args = ["1=1"], []
    given = {"since": since, "until": until, "key": key, "model": model}
    for clause, name in FILTERS:
        value = given[name]
        if value is not None:
            where.append(clause)
            args.append(value)
    db = _read_only(path)
    try:
        rows = db.execute(USAGE.format(group=GROUPS[group_by], where=" AND ".join(where)),
                          args).fetchall()
    finally:
        db.close()
    return [{group_by: g, "prompt_tokens": p or 0, "cached_tokens": c or 0,
             "completion_tokens": o or 0, "requests": n, "refused": r or 0}
            for g, p, c, o, n, r in rows]


def _read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)  # pragma: no mutate


def audit_log(path: Path, since: float | None = None) -> list[dict]:
    if not path.is_file():
        return []
    db = _read_only(path)
    try:
        rows = db.execute(AUDIT_SINCE, (since or 0,)).fetchall()
    finally:
        db.close()
    return [{"ts": ts, "event": e, "key": k, "detail": d} for ts, e, k, d in rows]


def refusal_row(key: str | None, endpoint: str, status: int, why: str) -> dict:
    """A request refused before any work (400, 413, 429...): a `requests` row with no tokens,
    finish_reason 'refused', its status, and why in the model column's place, so that
    `localserve usage` shows whose requests fail, and why."""
    return {"ts": time.time(), "key": key or "anonymous", "endpoint": endpoint,
            "model": why[:MAX_WHY], "prompt_tokens": 0, "cached_tokens": 0,
            "completion_tokens": 0, "finish_reason": "refused", "queue_s": 0.0,
            "duration_s": 0.0, "status": status}


MAX_WHY = 80


def request_row(key: str | None, endpoint: str, model: str, prompt_tokens: int,
                cached_tokens: int, completion_tokens: int, finish_reason: str, queue_s: float,
                duration_s: float) -> dict:
    """One `requests` row; the status follows from how the request finished."""
    return {"ts": time.time(), "key": key or "anonymous", "endpoint": endpoint, "model": model,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "completion_tokens": completion_tokens, "finish_reason": finish_reason,
            "queue_s": round(queue_s, 4), "duration_s": round(duration_s, 4),
            "status": FinishReason(finish_reason).status}


class LedgerObserver:
    """EngineObserver: one ledger row per finished request (on the loop thread: a queue put)."""

    def __init__(self, ledger: Ledger, model_id):
        self.ledger, self.model_id = ledger, model_id  # model_id: () -> str

    def on_step(self, plan, seconds: float) -> None:
        pass

    def on_event(self, request, event) -> None:
        if not event.finished:
            return
        now = time.monotonic()
        self.ledger.record(request_row(
            request.user, request.endpoint, self.model_id(), event.prompt_tokens,
            event.cached_tokens, event.completion_tokens, str(event.finish_reason),
            queue_s=(request.admitted_time or now) - request.arrival_time,
            duration_s=now - request.arrival_time))
