"""``unbroken bench restart``: fault -> every rank training again, unbroken-run vs torchrun.

Two workers on this machine run the reference script (``unbroken.workload.train``); per trial
one fault hits rank 1 mid-training:

- ``sigkill``: the fault plan's ``sigkill`` (the rank records the fault, then SIGKILLs itself);
- ``sigstop``: the benchmark SIGSTOPs rank 1 once its ledger shows step ``--fault-step`` (a
  hang: the process is alive and silent). unbroken-run detects it by heartbeats with the stated
  steady timeout; torchrun has no hang detection, so its trial ends at ``--hang-cap-s``.

The script runs with ``--no-inprocess`` (its in-process restart layer off) unless
``--inprocess``: this benchmark compares launchers. With ``--ckpt-every``/``--snapshot-every``
the script checkpoints, and each trial also reports the restarted ranks' restore: its
critical path (``restore``: from the last rank's start of its ``ckpt_load`` to the last one's
end; ``restore_path``), how far apart the ranks started it (``wait``: the earlier one waits in
the first all-gather for a model still being built), its tier (``memory`` when the agent kept
the dead rank's snapshots), and of a memory restore the part that reads memory back (``read``:
checking the digests and copying into the live state, the fresh optimizer's new pages faulted
in; the rest is agreeing with the other rank and matching the live state), e.g.
``--launchers unbroken --faults sigkill --model small --snapshot-every 1 --hang-timeout-s
30``. Recovery is measured from the ledger alone:
fault time -> the end of the first step that every rank completes after it
(``goodput.compute``'s ``recovery_s``); ``detect_s`` is the first detection's latency. Both
launchers run the same script, with torchrun given
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its shared-store path otherwise reuses stale keys,
pytorch/pytorch#135712). Trials alternate between launchers so that the load of this shared
machine hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.ledger import events as ev
from unbroken.ledger import goodput, read_events
from unbroken.ledger.events import Event

LAUNCHERS = ("unbroken", "torchrun")
FAULTS = ("sigkill", "sigstop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=5, help="trials per configuration")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset")
    p.add_argument("--model", default="tiny", help="reference model size")
    p.add_argument("--steps", type=int, default=20, help="training steps per trial")
    p.add_argument("--fault-step", type=int, default=8, help="step after which rank 1 fails")
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=2.0,
        help="unbroken-run's steady heartbeat timeout for the sigstop trials",
    )
    p.add_argument(
        "--hang-cap-s",
        type=float,
        default=20.0,
        help="end a trial this long after the fault if it has not recovered",
    )
    p.add_argument("--no-warm-pool", action="store_true", help="unbroken-run without zygote")
    p.add_argument(
        "--inprocess",
        action="store_true",
        help="keep the script's in-process restart layer on (default: --no-inprocess, so that "
        "only the launchers are compared)",
    )
    p.add_argument(
        "--ckpt-every", type=int, default=0, help="the script's durable saves (0: no checkpoints)"
    )
    p.add_argument(
        "--snapshot-every", type=int, default=0, help="the script's memory-only snapshots (0: off)"
    )
    p.add_argument("--dir", default=None, help="keep run directories here (default: temp)")


def _cmd(launcher: str, run_dir: Path, args: argparse.Namespace, plan: Path | None) -> list[str]:
    script = [
        "-m",
        "unbroken.workload.train",
        "--run-dir",
        str(run_dir),
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--log-every",
        "1000",
    ]
    if plan is not None:
        script += ["--faults", str(plan)]
    if not args.inprocess:
        script.append("--no-inprocess")
    if args.ckpt_every:
        script += ["--ckpt-every", str(args.ckpt_every)]
    if args.snapshot_every:
        script += ["--snapshot-every", str(args.snapshot_every)]
    common = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.05",
    ]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, *script]
    ours = [
        "--ft-run-dir",
        str(run_dir),
        "--ft-steady-timeout-s",
        str(args.hang_timeout_s),
        "--ft-initial-timeout-s",
        str(max(60.0, 4 * args.hang_timeout_s)),
        "--ft-stop-grace-s",
        "2",
    ]
    if args.no_warm_pool:
        ours.append("--no-ft-warm-pool")
    return [sys.executable, "-m", "unbroken.launcher.cli", *common, *ours, *script]


def _env(launcher: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _rank1_at(run_dir: Path, step: int) -> int | None:
    """pid of rank 1 of the first attempt once its ledger shows ``step``, else None."""
    events_dir = run_dir / "events"
    pid, reached = None, False
    for f in events_dir.glob("*.jsonl") if events_dir.is_dir() else []:
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("rank") != 1 or rec.get("attempt") != 0:
                continue
            if rec.get("kind") == ev.PROCESS_START:
                pid = rec.get("pid")
            elif rec.get("kind") == ev.STEP and rec.get("step", -1) >= step:
                reached = True
    return pid if reached else None


def _kill_workers(run_dir: Path) -> None:
    """SIGKILL this trial's workers that outlived their launcher (torchrun's run in sessions of
    their own; a stopped one survives its launcher). Matched by the run dir in their argv."""
    for e in read_events(run_dir):
        pid = e.get("pid") if e.kind == ev.PROCESS_START and e.rank >= 0 else None
        if not isinstance(pid, int):
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(run_dir).encode() in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _trial(launcher: str, fault: str, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    plan = None
    if fault == "sigkill":
        plan = run_dir / "plan.yaml"
        plan.write_text(f"faults:\n  - {{step: {args.fault_step}, rank: 1, kind: sigkill}}\n")
    log = run_dir / "launcher.log"
    with open(log, "wb") as out:  # a file, not a pipe: a stopped orphan would hold a pipe open
        proc = subprocess.Popen(
            _cmd(launcher, run_dir, args, plan),
            env=_env(launcher),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    fault_ts: float | None = None
    cap = time.monotonic() + 120.0
    try:
        while proc.poll() is None:
            if fault == "sigstop" and fault_ts is None:
                pid = _rank1_at(run_dir, args.fault_step)
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
                    fault_ts = time.time()
                    cap = time.monotonic() + args.hang_cap_s
            if time.monotonic() > cap:
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_workers(run_dir)
    output = log.read_text(errors="replace")
    events = read_events(run_dir)
    if fault_ts is not None:
        events.append(
            Event(
                kind=ev.FAULT_INJECTED,
                ts=fault_ts,
                rank=1,
                data={"fault": "sigstop", "step": args.fault_step},
            )
        )
    faults = goodput.compute(events).faults if events else []
    f = faults[0] if faults else None
    loads = [e for e in events if e.kind == ev.CKPT_LOAD and e.attempt > 0 and e.rank >= 0]
    return {
        "returncode": proc.returncode,
        "recovery_s": None if f is None else f.recovery_s,
        "detect_s": None if f is None else f.detection_s,
        **restore_path(loads),
        "restore_tier": ",".join(sorted({str(e.get("tier")) for e in loads})) or None,
        "read_s": max(
            (e.get("verify_s", 0.0) + e.get("copy_s", 0.0) for e in loads if "copy_s" in e.data),
            default=None,
        ),
        "output_tail": output[-1500:] if proc.returncode != 0 else "",
    }


def restore_path(loads: list[Event]) -> dict[str, float | None]:
    """The restart's restore as the job waits for it, from the ranks' ``ckpt_load`` records of
    its first restarted attempt: ``restore_s`` from the moment the last rank starts restoring to
    the moment the last one is done (its critical path: a rank that starts earlier waits in the
    first all-gather for the others, still building their models), ``restore_wait_s`` how much
    earlier the first rank started, ``restore_rank_s`` the longest record (that wait included)."""
    if not loads:
        return {"restore_s": None, "restore_wait_s": None, "restore_rank_s": None}
    first = min(e.attempt for e in loads)
    mine = [e for e in loads if e.attempt == first]
    begins = [e.ts - (e.dur_s or 0.0) for e in mine]
    return {
        "restore_s": max(e.ts for e in mine) - max(begins),
        "restore_wait_s": max(begins) - min(begins),
        "restore_rank_s": max(e.dur_s or 0.0 for e in mine),
    }


def _summary(
    launcher: str, fault: str, trials: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    rec = [t["recovery_s"] for t in trials]
    ok = [r for r in rec if r is not None]
    det = [t["detect_s"] for t in trials]
    return {
        "launcher": launcher,
        "fault": fault,
        "trials": len(trials),
        "recovered": len(ok),
        "recovery_s": rec,
        "median_s": statistics.median(ok) if ok else None,
        "max_s": max(ok) if len(ok) == len(rec) and ok else None,
        "detect_s": det,
        "detect_median_s": statistics.median([d for d in det if d is not None])
        if any(d is not None for d in det)
        else None,
        "heartbeat_timeout_s": args.hang_timeout_s if launcher == "unbroken" else None,
        "hang_cap_s": args.hang_cap_s if fault == "sigstop" else None,
        "restore_s": [t.get("restore_s") for t in trials],
        "restore_median_s": _median([t.get("restore_s") for t in trials]),
        "restore_wait_s": [t.get("restore_wait_s") for t in trials],
        "restore_rank_s": [t.get("restore_rank_s") for t in trials],
        "restore_wait_median_s": _median([t.get("restore_wait_s") for t in trials]),
        "read_s": [t.get("read_s") for t in trials],
        "read_median_s": _median([t.get("read_s") for t in trials]),
        "restore_tiers": sorted({t["restore_tier"] for t in trials if t.get("restore_tier")}),
        "model": args.model,
        "warm_pool": launcher == "unbroken" and not args.no_warm_pool,
    }


def _median(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(args: argparse.Namespace) -> int:
    launchers = [x for x in args.launchers.split(",") if x]
    faults = [x for x in args.faults.split(",") if x]
    for x in launchers:
        if x not in LAUNCHERS:
            raise ValueError(f"--launchers: unknown {x!r}; choose from {LAUNCHERS}")
    for x in faults:
        if x not in FAULTS:
            raise ValueError(f"--faults: unknown {x!r}; choose from {FAULTS}")
    root_ctx = tempfile.TemporaryDirectory(dir=args.dir) if args.dir is None else None
    root = Path(root_ctx.name) if root_ctx is not None else Path(args.dir)
    try:
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for fault in faults:
            for i in range(args.trials):
                for launcher in launchers:
                    t = _trial(launcher, fault, root / f"{fault}-{launcher}-{i}", args)
                    results.setdefault((launcher, fault), []).append(t)
                    print(
                        f"  {launcher:<9} {fault:<8} trial {i}: recovery {_fmt(t['recovery_s'])}"
                        f" s, detection {_fmt(t['detect_s'])} s, exit {t['returncode']}"
                        + (
                            f", restore {_fmt(t['restore_s'])} s from {t['restore_tier']}"
                            f" (read {_fmt(t['read_s'])} s, ranks started"
                            f" {_fmt(t['restore_wait_s'])} s apart)"
                            if t["restore_s"] is not None
                            else ""
                        ),
                        flush=True,
                    )
                    if t["recovery_s"] is None and t["output_tail"]:
                        print("    " + t["output_tail"][-600:].replace("\n", "\n    "))
    finally:
        if root_ctx is not None:
            root_ctx.cleanup()
    rows = [_summary(lc, f, ts, args) for (lc, f), ts in results.items()]
    print(
        f"\n{'launcher':<9} {'fault':<8} {'recovered':>9} {'median s':>9} {'max s':>8} "
        f"{'detect s':>9} {'restore s':>9} {'wait s':>7} {'read s':>7} {'tier':<8}  (model "
        f"{args.model}, hang timeout "
        f"{args.hang_timeout_s} s)"
    )
    for r in rows:
        print(
            f"{r['launcher']:<9} {r['fault']:<8} {r['recovered']:>4}/{r['trials']:<4} "
            f"{_fmt(r['median_s']):>9} {_fmt(r['max_s']):>8} {_fmt(r['detect_median_s']):>9} "
            f"{_fmt(r['restore_median_s']):>9} {_fmt(r['restore_wait_median_s']):>7} "
            f"{_fmt(r['read_median_s']):>7} "
            f"{','.join(r['restore_tiers']) or '-':<8}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
