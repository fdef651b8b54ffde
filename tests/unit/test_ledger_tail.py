"""LedgerTail reads a growing ledger incrementally and agrees with read_run at every moment."""

from __future__ import annotations

import os
from pathlib import Path

from timelines import faulty_run, write
from unbroken.ledger import events as ev
from unbroken.ledger import read_run
from unbroken.ledger.tail import LedgerTail


def _same(tail: LedgerTail, run_dir: Path) -> None:
    full = read_run(run_dir)
    assert sorted(e.to_json() for e in tail.events) == sorted(e.to_json() for e in full.events)
    assert tail.torn_lines == full.torn_lines
    assert sorted(tail.bad_lines) == sorted(full.bad_lines)


def test_missing_run_dir_is_empty_not_an_error(tmp_path: Path) -> None:
    tail = LedgerTail(tmp_path / "not-yet")
    assert tail.poll() == [] and not tail.exists() and tail.files == 0


def test_appends_are_read_once_and_torn_lines_wait_for_their_newline(tmp_path: Path) -> None:
    events = faulty_run()
    path = write(tmp_path, events[:50])
    tail = LedgerTail(tmp_path)
    assert len(tail.poll()) == 50
    _same(tail, tmp_path)
    read = tail.bytes_read
    assert tail.poll() == [] and tail.bytes_read == read  # nothing new: nothing parsed

    line = events[50].to_json() + "\n"
    with open(path, "a") as f:  # a record cut in the middle of its write
        f.write(line[:20])
    assert tail.poll() == [] and tail.torn_lines == 1
    _same(tail, tmp_path)
    with open(path, "a") as f:
        f.write(line[20:])
    new = tail.poll()
    assert [e.to_json() for e in new] == [events[50].to_json()] and tail.torn_lines == 0
    assert tail.bytes_read == read + len(line.encode())  # only the appended bytes were parsed
    _same(tail, tmp_path)


def test_garbage_lines_are_counted_like_read_run(tmp_path: Path) -> None:
    path = write(tmp_path, faulty_run()[:10])
    with open(path, "ab") as f:
        f.write(b'not json\n[1, 2]\n{"kind": "nope", "ts": 1}\n\xff\xfe\n')
    write(tmp_path, faulty_run()[10:20])
    tail = LedgerTail(tmp_path)
    tail.poll()
    assert len(tail.bad_lines) == 4 and len(tail.events) == 20
    _same(tail, tmp_path)


def test_new_files_are_picked_up_and_a_replaced_file_restarts_the_tail(tmp_path: Path) -> None:
    events = faulty_run()
    write(tmp_path, events[:10], name="a.jsonl")
    tail = LedgerTail(tmp_path)
    tail.poll()
    write(tmp_path, events[10:30], name="b.jsonl")
    assert len(tail.poll()) == 20 and tail.files == 2
    gen = tail.generation
    replacement = tmp_path / "events" / "a.tmp"
    replacement.write_text(events[0].to_json() + "\n")
    os.replace(replacement, tmp_path / "events" / "a.jsonl")  # not an append
    tail.poll()
    assert tail.generation == gen + 1 and len(tail.events) == 21
    _same(tail, tmp_path)


def test_alert_records_parse(tmp_path: Path) -> None:
    from unbroken.ledger.events import Event

    e = Event(kind=ev.ALERT, ts=5.0, rank=ev.WATCHER_RANK, data={"name": "x", "key": "k"})
    write(tmp_path, [e])
    tail = LedgerTail(tmp_path)
    assert [x.kind for x in tail.poll()] == [ev.ALERT]
