"""What ``unbroken bench scale`` made us change, proven to change no result: the report with
other ranks' steps folded (same ``RunReport``), and the commit merge without GC passes (same
records, same metadata, the collector's state restored)."""

from __future__ import annotations

import gc
import json
import pickle
import random
from pathlib import Path

import pytest
from test_goodput import random_run

from unbroken import cli
from unbroken.bench import scale_commit, scale_ledger
from unbroken.checkpoint import layout
from unbroken.checkpoint.persisting import commit
from unbroken.ledger import goodput, read_run
from unbroken.ledger.events import STEP, Event


def _write(run_dir: Path, events: list[Event]) -> None:
    by_proc: dict[tuple[int, int], list[str]] = {}
    for e in events:
        by_proc.setdefault((e.rank, e.attempt), []).append(e.to_json())
    (run_dir / "events").mkdir(parents=True)
    for (rank, attempt), lines in by_proc.items():
        (run_dir / "events" / f"r{rank}-a{attempt}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("seed", range(12))
def test_a_folded_report_equals_the_unfolded_one(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    events = random_run(rng, ranks=rng.randint(2, 4), faults=rng.randint(0, 4))
    if seed % 3 == 1:  # other ranks resume last, under other run ids and iterations
        events += [
            Event(
                kind=STEP,
                ts=e.ts + 5.0,
                rank=e.rank,
                run=f"other-{seed}",
                iteration=7,
                attempt=e.attempt + 3,
                data=dict(e.data),
            )
            for e in events
            if e.kind == STEP and e.rank == 2
        ]
    _write(tmp_path, events)
    ref = 0 if seed % 2 else 1
    full = read_run(tmp_path)
    folded = read_run(tmp_path, fold_steps_except=ref)
    assert folded.digest is not None and folded.digest.count > 0
    assert len(folded.events) < len(full.events)
    assert not any(e.kind == STEP and e.rank != ref for e in folded.events)
    expected = goodput.compute(full.events, reference_rank=ref)
    got = goodput.compute(folded.events, reference_rank=ref, digest=folded.digest)
    assert got == expected


def test_the_synthetic_scale_run_reports_the_same_folded(tmp_path: Path) -> None:
    records = scale_ledger.write_run(tmp_path, ranks=6, steps=400)
    folded = read_run(tmp_path, fold_steps_except=0)
    assert folded.digest is not None
    assert len(folded.events) + folded.digest.count == records
    rep = goodput.compute(folded.events, digest=folded.digest)
    assert rep == goodput.compute(read_run(tmp_path).events)
    assert len(rep.faults) == len(scale_ledger.FAULTS) and rep.num_iterations == 3


def test_cli_report_json_is_unchanged_by_folding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scale_ledger.write_run(tmp_path, ranks=3, steps=300)
    assert cli.main(["report", str(tmp_path), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    expected = goodput.compute(read_run(tmp_path).events).to_dict()
    assert doc == json.loads(json.dumps(expected))


def _partial(root: Path, n: int) -> Path:
    part = layout.partial_dir(root, scale_commit.STEP)
    part.mkdir(parents=True)
    for r in range(n):
        rec, data = scale_commit._record(r, n, 4)
        (part / layout.data_file(r)).write_bytes(data)
        (part / layout.done_record(r)).write_bytes(pickle.dumps(rec))
    return part


@pytest.mark.parametrize("enabled", [True, False])
def test_the_merge_reads_the_same_records_and_restores_gc(tmp_path: Path, enabled: bool) -> None:
    n = 8
    part = _partial(tmp_path, n)
    raw = [pickle.loads((part / layout.done_record(r)).read_bytes()) for r in range(n)]
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        records = commit.wait_for_ranks(part, world_size=n, deadline=1e12, at=lambda _: None)
        assert gc.isenabled() is enabled
        assert records == raw
        expected = commit.build_metadata(raw, checkpoint_id="x")
        commit.publish(tmp_path, step=scale_commit.STEP, records=records, keep=1, at=lambda _: 0)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(layout.step_dir(tmp_path, scale_commit.STEP)).read_metadata()
    assert md.state_dict_metadata == expected.state_dict_metadata
    assert md.storage_data == expected.storage_data
    assert layout.verify(layout.step_dir(tmp_path, scale_commit.STEP)) is None


def test_gc_is_restored_when_the_merge_fails(tmp_path: Path) -> None:
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), layout.gc_paused():
        assert not gc.isenabled()
        raise ZeroDivisionError
    assert gc.isenabled()
