"""The reference training script with checkpoints: a run that stops, or is killed, and resumes
from its checkpoint ends with the same final state hash as a run that never stopped."""

from __future__ import annotations

from pathlib import Path

from procs import VENV_BIN, final, run, train_cmd
from unbroken.ledger import events as ev
from unbroken.ledger import goodput, read_events


def test_a_run_stopped_after_a_save_resumes_to_the_same_hash(tmp_path: Path) -> None:
    plain = ["--parallel", "none"]
    ref = run(train_cmd(tmp_path / "ref", nproc=None, steps=12, extra=plain), timeout_s=120)
    assert ref.returncode == 0, ref.output[-3000:]
    ckpt = [*plain, "--ckpt-every", "3", "--ckpt-mode", "sync"]
    first = run(train_cmd(tmp_path / "run", nproc=None, steps=7, extra=ckpt), timeout_s=120)
    assert first.returncode == 0, first.output[-3000:]
    again = run(train_cmd(tmp_path / "run", nproc=None, steps=12, extra=ckpt), timeout_s=120)
    assert again.returncode == 2 and "pass --resume to continue that run" in again.output
    resume = [*ckpt, "--resume"]  # another job continues the run on purpose
    second = run(train_cmd(tmp_path / "run", nproc=None, steps=12, extra=resume), timeout_s=120)
    assert second.returncode == 0, second.output[-3000:]
    assert second.hashes() == ref.hashes()
    assert final(tmp_path / "run")["losses"] == final(tmp_path / "ref")["losses"]
    loads = [e for e in read_events(tmp_path / "run") if e.kind == ev.CKPT_LOAD]
    assert [(e.get("tier"), e.get("step")) for e in loads] == [("none", None), ("disk", 5)]
    steps = [e.get("step") for e in read_events(tmp_path / "run") if e.kind == ev.STEP]
    assert steps == [*range(7), *range(6, 12)]


def test_sigkill_under_torchrun_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    extra = ["--batch-size", "4"]
    ref = run(train_cmd(tmp_path / "ref", nproc=2, steps=16, extra=extra), timeout_s=120)
    assert ref.returncode == 0, ref.output[-3000:]
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 11, rank: 1, kind: sigkill}\n")
    # on_busy=wait: the save at step 9 waits until step 7 is committed, and rank 1 cannot
    # finish step 11 before rank 0 passed step 9 (every step all-reduces), so step 7, perhaps
    # 9, is committed when rank 1 dies.
    ckpt = ["--ckpt-every", "2", "--ckpt-on-busy", "wait", "--faults", str(plan)]
    res = run(
        train_cmd(tmp_path / "run", nproc=2, steps=16, extra=[*extra, *ckpt],
                  torchrun_args=["--max-restarts", "1"]),
        timeout_s=180,
    )  # fmt: skip
    assert res.returncode == 0, res.output[-3000:]
    assert res.hashes() == ref.hashes() and len(res.hashes()) == 2
    rep = goodput.compute(read_events(tmp_path / "run"))
    assert len(rep.faults) == 1
    fault = rep.faults[0]
    assert fault.restore_tier == "disk" and fault.restored_step in (7, 9)
    # Rank 0 records step 11 after its save of step 11 (which waits for step 9's commit), so
    # the fault may come before that record: step 11 then does not count as lost.
    assert 11 - fault.restored_step - fault.steps_lost in (0, 1)
    assert rep.checkpoint_efficiency is not None and 0.0 < rep.checkpoint_efficiency <= 1.0
    assert final(tmp_path / "run")["losses"] == final(tmp_path / "ref")["losses"]


def test_under_plain_torchrun_without_a_run_dir_a_restart_resumes_its_run(tmp_path: Path) -> None:
    """Before: every restart picked a new runs/<timestamp>, so it never resumed and re-fired its
    fault until the restart budget was gone. The default is runs/<TORCHELASTIC_RUN_ID>."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {step: 3, rank: 0, kind: sigkill}\n")
    cmd = [
        str(VENV_BIN / "torchrun"),
        *("--standalone", "--nproc-per-node", "1", "--max-restarts", "2"),
        *("--monitor-interval", "0.1", "-m", "unbroken.workload.train"),
        *("--steps", "6", "--seq-len", "32", "--parallel", "none", "--ckpt-every", "2"),
        *("--ckpt-mode", "sync", "--faults", str(plan)),
    ]
    res = run(cmd, timeout_s=180, cwd=tmp_path)
    assert res.returncode == 0, res.output[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert len(list((run_dir / "faults" / "fired").iterdir())) == 1  # fired once
    loads = [e.get("step") for e in read_events(run_dir) if e.kind == ev.CKPT_LOAD]
    assert loads == [None, 3]  # restored step 3: its save comes before its fault hook
