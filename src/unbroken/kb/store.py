"""The knowledge base: one SQLite file, a row per run, its faults, and an FTS5 index over both.

Tables: ``runs`` (one row per run directory, keyed by its absolute path; the record as JSON plus
the figures one sorts by), ``faults`` (one row per fault) and ``runs_fts`` (FTS5: the run's name,
its configuration as ``key=value`` text, its fault trace as text, its results as text). Ingesting
a run again replaces its rows. The file is ``$UNBROKEN_KB``, else ``runs/kb.sqlite``.

Queries are FTS5 expressions (``sigkill AND launcher``, ``"ckpt_mode=sync"``, ``hang*``); a query
that is not valid FTS5 syntax is searched again as plain words (each quoted), so ``--ckpt-every``
or ``hang-collective`` just work.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unbroken import env as uenv
from unbroken.kb.extract import RunRecord, extract

ENV_VAR = uenv.UNBROKEN_KB
DEFAULT_PATH = Path("runs") / "kb.sqlite"

_SCHEMA = """
create table if not exists runs (
    id integer primary key,
    path text unique not null,
    name text not null,
    run text not null,
    status text not null,
    started_ts real,
    ingested_ts real not null,
    world_size integer,
    training_goodput real,
    infra_goodput real,
    faults integer,
    record text not null
);
create table if not exists faults (
    run_id integer not null references runs(id) on delete cascade,
    idx integer not null,
    kind text, rank integer, step integer, cause text, detector text, layer text,
    detection_s real, recovery_s real, steps_lost integer, restore_tier text, message text
);
create virtual table if not exists runs_fts using fts5(name, config, faults, results);
"""


def default_path() -> Path:
    """Where the knowledge base is when no path is given.

    Returns:
        ``UNBROKEN_KB``, else ``runs/kb.sqlite`` (relative to the working directory).
    """
    return Path(uenv.lookup(ENV_VAR) or DEFAULT_PATH)


@dataclass(frozen=True)
class Hit:
    """One search result."""

    id: int
    """The run's id in the knowledge base."""
    name: str
    """The run directory's name."""
    path: str
    """Absolute path of the run directory."""
    status: str
    """ok, failed or running."""
    training_goodput: float | None
    """The run's training goodput (None: not computed)."""
    faults: int
    """Faults in its trace."""
    snippet: str
    """The matching text, matches in brackets."""


def _text(d: dict[str, Any]) -> str:
    return "\n".join(f"{k}={v}" for k, v in sorted(d.items()))


def _fault_text(faults: list[dict[str, Any]]) -> str:
    lines = []
    for f in faults:
        parts = [f"{k}={f[k]}" for k in ("kind", "cause", "detector", "layer", "restore_tier")]
        parts += [f"rank={f['rank']}", f"steps_lost={f['steps_lost']}", str(f.get("message", ""))]
        lines.append(" ".join(parts))
    return "\n".join(lines)


def _quoted(query: str) -> str:
    return " ".join('"' + w.replace('"', '""') + '"' for w in query.split())


class KnowledgeBase:
    """A connection to the knowledge base file; use as a context manager or call ``close()``.

    Args:
        path: The SQLite file (None: ``default_path()``).
        create: Create it when missing (False: a missing file is an error).

    Raises:
        FileNotFoundError: When ``path`` is missing and not ``create``.
        ValueError: When ``path`` is not a knowledge base.
        RuntimeError: When this Python's sqlite3 has no FTS5.
    """

    def __init__(self, path: str | Path | None = None, *, create: bool = True) -> None:
        self.path = Path(path) if path is not None else default_path()
        if not create and not self.path.is_file():
            raise FileNotFoundError(
                f"no knowledge base at {self.path}: ingest runs first (unbroken kb ingest "
                f"RUN_DIR...) or point {ENV_VAR} / --db at one"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=10)
            self.db.executescript(_SCHEMA)
        except sqlite3.OperationalError as e:
            if "fts5" in str(e):
                raise RuntimeError(
                    "this Python's sqlite3 has no FTS5: use a Python built with a recent SQLite"
                ) from None
            raise ValueError(f"{self.path}: not a knowledge base ({e})") from None
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{self.path}: not a knowledge base ({e})") from None
        self.db.execute("pragma foreign_keys = on")

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self.db:
            yield self.db

    def ingest(self, run_dir: str | Path) -> RunRecord:
        """Extract and store one run (replacing an earlier ingest of the same directory).

        Args:
            run_dir: The run directory.

        Returns:
            What was stored.

        Raises:
            FileNotFoundError: As ``extract``.
            ValueError: As ``extract``.
        """
        rec = extract(run_dir)
        res = rec.results
        with self._tx() as db:
            old = db.execute("select id from runs where path = ?", (rec.path,)).fetchone()
            if old is not None:
                db.execute("delete from runs_fts where rowid = ?", (old[0],))
                db.execute("delete from faults where run_id = ?", (old[0],))
                db.execute("delete from runs where id = ?", (old[0],))
            cur = db.execute(
                "insert into runs (path, name, run, status, started_ts, ingested_ts, world_size,"
                " training_goodput, infra_goodput, faults, record)"
                " values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.path,
                    rec.name,
                    rec.run,
                    rec.status,
                    rec.started_ts,
                    time.time(),
                    rec.config.get("final.world_size", rec.config.get("train.world_size")),
                    res.get("training_goodput"),
                    res.get("infra_goodput"),
                    len(rec.faults),
                    json.dumps(asdict(rec), default=str),
                ),
            )
            run_id = cur.lastrowid
            for f in rec.faults:
                db.execute(
                    "insert into faults values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        run_id,
                        f["index"],
                        f["kind"],
                        f["rank"],
                        f["step"],
                        f["cause"],
                        f["detector"],
                        f["layer"],
                        f["detection_s"],
                        f["recovery_s"],
                        f["steps_lost"],
                        f["restore_tier"],
                        f.get("message", ""),
                    ),
                )
            db.execute(
                "insert into runs_fts (rowid, name, config, faults, results) values (?, ?, ?, ?, ?)",
                (
                    run_id,
                    f"{rec.name} {rec.run} {rec.path}",
                    _text(rec.config),
                    _fault_text(rec.faults),
                    _text({k: v for k, v in rec.results.items() if v is not None}),
                ),
            )
        return rec

    def search(self, query: str, *, limit: int = 20) -> list[Hit]:
        """Search the runs.

        Args:
            query: An FTS5 query (not one: its words, each quoted).
            limit: At most this many hits.

        Returns:
            The runs matching, best first.

        Raises:
            ValueError: For an empty query.
        """
        if not query.strip():
            raise ValueError("empty search: give words to look for, e.g. 'sigkill launcher'")
        sql = (
            "select runs.id, runs.name, runs.path, runs.status, runs.training_goodput,"
            " runs.faults, snippet(runs_fts, -1, '[', ']', '...', 10)"
            " from runs_fts join runs on runs.id = runs_fts.rowid"
            " where runs_fts match ? order by bm25(runs_fts) limit ?"
        )
        try:
            rows = self.db.execute(sql, (query, limit)).fetchall()
        except sqlite3.OperationalError:  # not FTS5 syntax: search the words as they are
            rows = self.db.execute(sql, (_quoted(query), limit)).fetchall()
        return [Hit(*row) for row in rows]

    def runs(self) -> list[dict[str, Any]]:
        """Every run stored.

        Returns:
            Newest first: id, name, path, status, started_ts, training_goodput, infra_goodput
                and faults of each.
        """
        cols = "id, name, path, status, started_ts, training_goodput, infra_goodput, faults"
        rows = self.db.execute(f"select {cols} from runs order by started_ts desc").fetchall()
        keys = [c.strip() for c in cols.split(",")]
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def get(self, ref: str) -> RunRecord:
        """One stored run.

        Args:
            ref: Its id, path or name (the newest of that name).

        Returns:
            Its record.

        Raises:
            LookupError: When none matches.
        """
        row = None
        if ref.isdigit():
            row = self.db.execute("select record from runs where id = ?", (int(ref),)).fetchone()
        if row is None:
            path = str(Path(ref).resolve())
            row = self.db.execute("select record from runs where path = ?", (path,)).fetchone()
        if row is None:
            row = self.db.execute(
                "select record from runs where name = ? order by started_ts desc limit 1", (ref,)
            ).fetchone()
        if row is None:
            raise LookupError(
                f"no run {ref!r} in the knowledge base {self.path}: give an id, a path or a name "
                "from 'unbroken kb search' (or ingest it first)"
            )
        return RunRecord(**json.loads(row[0]))
