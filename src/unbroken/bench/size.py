"""``unbroken bench size``: checkpoint and restore at gigabytes per rank, against the machine's
own limits measured in the same run.

One process (a gloo group of one) holds a synthetic per-rank state of each size (``--sizes``,
GB): flat fp32 shards of ``--shard-mib`` each, as an FSDP rank holds its parameters' and
optimizer state's shards, every shard filled from its own seed. For each size:

- **limits**: one plain copy of the state into already-touched memory (``memcpy``; the floor of
  a snapshot) and into fresh memory (``first touch``: what a new arena pays once); writing it
  to a file in ``--dir`` and fsyncing (``write+fsync``); reading that file back with the page
  cache dropped when this process may drop it (``read``; else the figure says "cached"). On a
  shared host these move by half within seconds, so a stall or a restore from memory is set
  against a plain copy timed just before it (``Floors``), the median of those ratios reported;
  a persist against the plain write+fsyncs of the same bytes timed on either side of it (the
  disk here takes 2-5 x as long for the same bytes from one try to the next, and a persist
  right after another is slower than one after a pause: the neighbours share its state), also
  reported against the fastest write+fsync of the run (best of two at the start, and those).
- **ours** (``Checkpointer``, its defaults: async, memory tier): the arena laid out ahead on
  the stager thread (what ``maybe_save`` does at its first step that is no save; timed to its
  end), then ``keep`` + ``--saves`` saves, each waited for; the stall is how long ``save``
  blocked, persist is save to durable (the medians over the saves after the first ``keep`` + 1:
  a long job's, which write over the files of retired checkpoints); then a restore from
  disk (a fresh Checkpointer without the memory tier, page cache dropped) and ``RESTORES``
  from the memory tier (what an in-process restart does: the arena kept by ``abort``; the
  median), each checked against the seeds. Host memory is the memory the staging arena takes
  over the state's. Then the peer tier: a snapshot replicated to the next node's peer service
  (two services on loopback), and a fresh Checkpointer with nothing in its memory restoring it
  from there (where memory allows).
- **dcp-async**: ``dcp.async_save`` with a reused ``DefaultStager`` staging on a thread (its
  best mode on a CPU), the stall being until staging completes (the state may change only
  then), persist until the upload completes; restore with ``dcp.load`` from disk. Host memory
  is the growth of this process's resident memory over the state's.
- **dcp-async-pinned** (pinned staging, as torchtitan's ``async_with_pinned_mem``): needs CUDA;
  without it, the row says so.

``--device cuda`` puts the state in GPU memory: staging is then a device-to-host copy, its floor
a copy into pinned host memory, and the pinned DCP row runs (``scripts/gpu_check.sh``).

Targets (issue "Real sizes"): stall <= 1.2 x the memcpy floor, persist >= 0.8 x write+fsync,
restore from memory >= 0.8 x memcpy bandwidth; the table says which are met.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken.bench.size_limits import Floors, Shards, drop_page_cache, limits, timed
from unbroken.checkpoint.persisting import forkserver

GB = 1e9
RESTORES = 3
"""Restores from memory per size (the median is reported)."""
TARGET_STALL = 1.2
TARGET_PERSIST = 0.8
TARGET_RESTORE = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes", default="0.25,1,4", help="state per rank in GB, comma-separated (0.25,1,4)"
    )
    p.add_argument("--saves", type=int, default=5, help="saves per size and mode (default 5)")
    p.add_argument("--shard-mib", type=int, default=64, help="MiB per tensor of the state")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the state lives (cuda: staging is a device-to-host copy)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        sizes = [float(x) for x in str(args.sizes).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--sizes takes GB per rank, e.g. 0.25,1,4; got {args.sizes!r}") from None
    if not sizes or min(sizes) <= 0:
        raise SystemExit(f"--sizes needs sizes > 0 GB, got {args.sizes!r}")
    if args.saves < 2:
        raise SystemExit(
            f"--saves must be >= 2 (the first save faults the arena in), got {args.saves}"
        )
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu")
    base = Path(args.dir) if args.dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    rows = []
    with (
        tempfile.TemporaryDirectory(dir=base, prefix="bench-size-") as tmp,
        forkserver.serving(),  # writers fork from a small process, as under unbroken.run
    ):
        _init_group(Path(tmp))
        try:
            for gb in sizes:
                root = Path(tmp) / f"{gb:g}GB"
                rows.append(
                    measure(
                        int(gb * GB), root, saves=args.saves, shard=args.shard_mib, device=device
                    )
                )
                shutil.rmtree(root, ignore_errors=True)
        finally:
            dist.destroy_process_group()
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _init_group(tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(60))


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# --- the modes -------------------------------------------------------------------------------
def ours(state: Shards, root: Path, *, saves: int, floors: Floors) -> dict[str, Any]:
    """Our Checkpointer's stalls, persists, arena and restores (memory, disk), each with its
    floor (``Floors``)."""
    from unbroken.checkpoint import Checkpointer

    sd = {"model": state}
    ck = Checkpointer(root, every_steps=saves + 1)
    # A long job's saves write over the files of the checkpoints ``keep`` retires (``layout``:
    # recycled): the first ``keep`` saves after the first write new files, and are timed but
    # left out of the steady figures.
    warm = ck.config.keep
    t0 = time.perf_counter()
    ck.maybe_save(0, sd)  # a step that is no save: the arena laid out on the stager thread
    ck.wait_staged()
    ahead_s = time.perf_counter() - t0
    stalls, persists, copies, disks = [], [], [], [floors.disk_s()]
    for step in range(saves + warm):
        copies.append(floors.copy_s())
        t0 = time.perf_counter()
        ck.save(step, sd)
        stalls.append(time.perf_counter() - t0)
        if not ck.wait():
            raise RuntimeError(f"our save of step {step} failed: {ck.storage.last_error}")
        persists.append(time.perf_counter() - t0)
        disks.append(floors.disk_s())  # between two persists: their floor (``_judged``)
    arena = ck.staging_bytes
    ck.abort()  # the arena goes to the memory tier, as in an in-process restart
    state.scramble()
    drop_page_cache()
    ck = Checkpointer(root, every_steps=1, memory_tier=False)  # leaves the memory tier be
    disk_s, step = timed(lambda: ck.restore(sd))
    disk_ok = step == saves + warm - 1 and state.intact()
    ck.close()
    mem_s, mem_floor_s, mem_ok = [], [], True
    for _ in range(RESTORES):
        state.scramble()
        mem_floor_s.append(floors.copy_s())
        ck = Checkpointer(root, every_steps=1)
        took, step = timed(functools.partial(ck.restore, sd))
        mem_s.append(took)
        mem_ok = mem_ok and step == saves + warm - 1 and state.intact()
        ck.abort()  # the arena stays in the memory tier for the next restore
    Checkpointer(root, every_steps=1).close()  # takes the arena the last abort kept, frees it
    return {
        "mode": "ours",
        "steady_from": 1 + warm,
        "stall_s": stalls,
        "persist_s": persists,
        "host_bytes": arena,
        "floor_copy_s": copies,
        "floor_disk_s": disks,
        "prepared_ahead_s": ahead_s,
        "restore_memory_s": statistics.median(mem_s),
        "restore_memory_over_memcpy": statistics.median(
            f / r for f, r in zip(mem_floor_s, mem_s, strict=True)
        ),
        "restore_memory_ok": mem_ok,
        "restore_disk_s": disk_s,
        "restore_disk_ok": disk_ok,
    }


def ours_peer(state: Shards, root: Path) -> dict[str, Any]:
    """A snapshot replicated to the next node's peer service (two services on loopback stand
    for two nodes) and a fresh Checkpointer with nothing in its own memory restoring it from
    there: how long the replica took after the snapshot, and the restore."""
    from unbroken.checkpoint import CheckpointConfig, Checkpointer
    from unbroken.checkpoint.tiers.peers import PeerService
    from unbroken.ledger import Ledger, read_events

    # the state, our arena, the replica (2 regions) and the arena it is fetched into
    need = state.nbytes * (1 + CheckpointConfig().memory_slots + 2 + 1)
    avail = _available()
    if avail is not None and need > 0.8 * avail:
        return {"skipped": f"needs {need / GB:.1f} GB of memory here, {avail / GB:.1f} available"}
    sd = {"model": state}
    services = [PeerService(host="127.0.0.1", bind="127.0.0.1") for _ in range(2)]
    addrs = tuple(str(s.peer) for s in services)
    ledger = Ledger(root / "run", run="bench-size", rank=0)
    try:
        ck = Checkpointer(root, every_steps=1, peers=addrs, peer_index=0, ledger=ledger)
        ck.save(0, sd)  # durable; step 1 is in memory only, so a restore of 1 is the peer's
        ck.wait()
        t0 = time.perf_counter()
        ck.snapshot(1, sd)
        while 1 not in next(iter(services[1].held().values()), []):
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("the snapshot never reached the next node's peer service")
            time.sleep(0.001)
        replicate_s = time.perf_counter() - t0
        ck.close()  # its arena freed: nothing of it stays in this process's memory
        state.scramble()
        t0 = time.perf_counter()  # a new Checkpointer fetches the peer's copy as it starts
        ck = Checkpointer(root, every_steps=1, peers=addrs, peer_index=1, ledger=ledger)
        step = ck.restore(sd)
        peer_s = time.perf_counter() - t0
        ok = step == 1 and state.intact()
        ck.close()
    finally:
        for s in services:
            s.close()
        ledger.close()
    tiers = [e.get("tier") for e in read_events(root / "run") if e.kind == "ckpt_load"]
    return {"replicate_s": replicate_s, "restore_s": peer_s, "ok": ok and tiers == ["peer"]}


def _available() -> float | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024.0
    return None


def dcp_async(
    state: Shards, root: Path, *, saves: int, pinned: bool, floors: Floors
) -> dict[str, Any]:
    """``dcp.async_save`` with a reused stager: stalls (to staged), persists, restore (disk)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    mode = "dcp-async-pinned" if pinned else "dcp-async"
    if pinned and not torch.cuda.is_available():
        return {"mode": mode, "skipped": "pinned staging needs CUDA; none here"}
    stager = DefaultStager(StagingOptions(pinned, False, True, pinned))
    rss0 = _rss()
    stalls, persists, copies, disks = [], [], [], [floors.disk_s()]
    try:
        for step in range(saves):
            copies.append(floors.copy_s())
            t0 = time.perf_counter()
            resp: Any = dcp.async_save(  # an AsyncSaveResponse, with a stager
                {"model": state.state_dict()},
                checkpoint_id=root / mode / f"step-{step}",
                async_stager=stager,
            )
            resp.staging_completion.result()
            stalls.append(time.perf_counter() - t0)
            resp.upload_completion.result()
            persists.append(time.perf_counter() - t0)
            disks.append(floors.disk_s())
        host = max(0, _rss() - rss0)
    finally:
        stager.close()
    gc.collect()
    state.scramble()
    drop_page_cache()
    load_s, _ = timed(
        lambda: dcp.load(
            {"model": state.state_dict()}, checkpoint_id=root / mode / f"step-{saves - 1}"
        )
    )
    return {
        "mode": mode,
        "stall_s": stalls,
        "persist_s": persists,
        "floor_copy_s": copies,
        "floor_disk_s": disks,
        "host_bytes": host,
        "restore_memory_s": None,
        "restore_disk_s": load_s,
        "restore_disk_ok": state.intact(),
    }


def measure(
    nbytes: int, root: Path, *, saves: int, shard: int, device: str = "cpu"
) -> dict[str, Any]:
    """Every figure of one state size (see the module docstring)."""
    state = Shards(nbytes, shard, device)
    lim = limits(state, root)
    floors = Floors(state, root / "floors")
    modes = [ours(state, root / "ours", saves=saves, floors=floors)]
    gc.collect()
    modes.append(dcp_async(state, root, saves=saves, pinned=False, floors=floors))
    gc.collect()
    modes.append(dcp_async(state, root, saves=saves, pinned=True, floors=floors))
    floors.close()
    gc.collect()
    modes[0]["peer"] = ours_peer(state, root / "peer")
    out = {
        "state_bytes": state.nbytes,
        "tensors": len(state.tensors),
        "limits": lim,
        "modes": modes,
    }
    # The disk's best in this run: a write+fsync of the same bytes took 2-4 x as long from one
    # try to the next here, and a limit is the fastest it went.
    timed = [n_s for m in modes for n_s in m.get("floor_disk_s", [])]
    lim["write_fsync_Bps"] = max(lim["write_fsync_Bps"], state.nbytes / min(timed, default=1e9))
    for m in modes:
        if "skipped" not in m:
            m.update(_judged(m, state.nbytes, lim["write_fsync_Bps"]))
    return out


def _judged(m: dict[str, Any], n: int, disk_Bps: float) -> dict[str, Any]:
    """Steady figures (medians over the saves from ``steady_from``: after the first, and for
    ours after the saves that write new files before retention recycles any), the stall's ratio
    the median of the saves' own (each to the copy timed just before it: ``Floors``), the
    persist's to the disk's best in the run (``disk_Bps``) and, the verdict's figure, to the plain
    write+fsyncs timed on either side of it (the median of each persist's ratio to their mean:
    the same disk in the same state, where the best of a run is one lucky try)."""
    later = slice(m.get("steady_from", 1), None)
    pairs = list(zip(m["stall_s"], m["floor_copy_s"], strict=True))[later]
    disks = m["floor_disk_s"]
    around = [(before + after) / 2 for before, after in itertools.pairwise(disks)]
    out: dict[str, Any] = {
        "stall_median_s": statistics.median(m["stall_s"][later]),
        "stall_first_s": m["stall_s"][0],
        "stall_over_floor": statistics.median(s / c for s, c in pairs),
        "persist_median_s": statistics.median(m["persist_s"][later]),
        "persist_over_disk": (n / statistics.median(m["persist_s"][later])) / disk_Bps,
        "persist_over_adjacent": statistics.median(
            d / p for d, p in list(zip(around, m["persist_s"], strict=True))[later]
        ),
        "host_over_state": m["host_bytes"] / n,
    }
    out["stall_target_met"] = out["stall_over_floor"] <= TARGET_STALL
    out["persist_target_met"] = out["persist_over_adjacent"] >= TARGET_PERSIST
    if m.get("restore_memory_s") is not None:
        out["restore_target_met"] = m["restore_memory_over_memcpy"] >= TARGET_RESTORE
    return out


# --- the table -------------------------------------------------------------------------------
def render(rows: list[dict[str, Any]]) -> str:
    """The figures as text: per size, its limits, then one line per mode."""
    lines = []
    for r in rows:
        n, lim = r["state_bytes"], r["limits"]
        cold = "cache dropped" if lim["read_cold"] else "cached: could not drop the page cache"
        lines += [
            f"state {n / GB:.2f} GB per rank ({r['tensors']} tensors)",
            f"  limits: memcpy {lim['memcpy_Bps'] / GB:.2f} GB/s at the start (first touch "
            f"{lim['first_touch_Bps'] / GB:.2f}), write+fsync {lim['write_fsync_Bps'] / GB:.2f} "
            f"GB/s (the run's best), read {lim['read_Bps'] / GB:.2f} GB/s ({cold})",
            "  mode              stall s (x floor)  first stall s  persist s (x disk: next "
            "to it / best)  restore mem s (x memcpy)  restore disk s  host mem x state  "
            "restores exact",
        ]
        for m in r["modes"]:
            if "skipped" in m:
                lines.append(f"  {m['mode']:<17} not run: {m['skipped']}")
                continue
            mem = (
                f"{m['restore_memory_s']:.3f} ({m['restore_memory_over_memcpy']:.2f})"
                if m.get("restore_memory_s") is not None
                else "-"
            )
            exact = all(m.get(k, True) for k in ("restore_memory_ok", "restore_disk_ok"))
            lines.append(
                f"  {m['mode']:<17} {m['stall_median_s']:.3f} ({m['stall_over_floor']:.2f})"
                f"{'':>5} {m['stall_first_s']:>9.3f}  {m['persist_median_s']:>9.3f} "
                f"({m['persist_over_adjacent']:.2f} / {m['persist_over_disk']:.2f})"
                f"{'':>13}  {mem:>22}  {m['restore_disk_s']:>14.3f}  "
                f"{m['host_over_state']:>16.2f}  {'yes' if exact else 'NO'}"
            )
            if "prepared_ahead_s" in m:
                lines.append(
                    f"  {'':<17} arena laid out ahead on a thread (by maybe_save before its first "
                    f"save): {m['prepared_ahead_s']:.3f} s"
                )
            peer = m.get("peer")
            if peer is not None:
                lines.append(
                    f"  {'':<17} peer tier: not run: {peer['skipped']}"
                    if "skipped" in peer
                    else f"  {'':<17} peer tier: replicated {peer['replicate_s']:.3f} s after "
                    f"the snapshot, restored from it in {peer['restore_s']:.3f} s "
                    f"({n / peer['restore_s'] / GB:.2f} GB/s), exact: "
                    f"{'yes' if peer['ok'] else 'NO'}"
                )
        lines.append("")
    lines.append(
        f"targets: stall <= {TARGET_STALL} x memcpy floor; persist >= {TARGET_PERSIST} x "
        f"write+fsync; restore from memory >= {TARGET_RESTORE} x memcpy bandwidth (stall and "
        "restore: the median of their ratios to a copy timed just before each; persist: to "
        "the write+fsyncs timed on either side of each)"
    )
    return "\n".join(lines)
