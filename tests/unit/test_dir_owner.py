"""One owner per directory: run and checkpoint directories belong to one job; another job is
refused with a message naming the owner, and nothing of the first is touched; a checkpoint of
another run or another model is restored only on purpose."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import Checkpointer, CheckpointError, layout
from unbroken.env import WorkerEnv
from unbroken.ledger import owner
from unbroken.ledger.owner import DirectoryOwned, claim
from unbroken.workload import rundir, train

SRC = Path(__file__).resolve().parents[2] / "src"

HOLDER = """
import sys
from unbroken.ledger.owner import claim
c = claim(sys.argv[1], job=sys.argv[2], takeover=False, hint="h")
print("held", flush=True)
sys.stdin.read()
"""


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def holder(tmp_path: Path):
    """A process of job "first" holding ``tmp_path/dir``; ``stop()`` ends it (a crash: its
    locks die with it)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "dir"), "first"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"

    def stop() -> None:
        proc.kill()
        proc.wait()

    proc.stop = stop  # type: ignore[attr-defined]
    yield proc
    stop()


def test_a_second_job_is_refused_with_the_owner_named_and_nothing_touched(
    tmp_path: Path, holder: subprocess.Popen
) -> None:
    root = tmp_path / "dir"
    (root / "step-3").mkdir()
    (root / "step-3" / "COMMITTED").write_text("x")
    before = _snapshot(root)
    with pytest.raises(DirectoryOwned) as e:
        claim(root, job="second", takeover=True, hint="use another directory")
    msg = str(e.value)
    assert "job 'first'" in msg and f"pid {holder.pid}" in msg
    assert socket.gethostname() in msg and "since 20" in msg and "use another directory" in msg
    assert e.value.running and e.value.owner.job == "first"
    assert _snapshot(root) == before
    # Another process of the same job shares the directory.
    same = claim(root, job="first", takeover=False, hint="")
    assert same.record.pid == holder.pid
    same.release()


def test_a_crashed_owner_holds_nothing_but_its_directory_is_taken_only_on_purpose(
    tmp_path: Path, holder: subprocess.Popen
) -> None:
    root = tmp_path / "dir"
    holder.stop()  # type: ignore[attr-defined]
    with pytest.raises(DirectoryOwned, match="no longer running; refusing .* pass --resume") as e:
        claim(root, job="second", takeover=False, hint="pass --resume")
    assert not e.value.running
    taken = claim(root, job="second", takeover=True, hint="")
    assert taken.record.job == "second" and taken.record.previous == ["first"]
    assert json.loads((root / owner.RECORD).read_text())["job"] == "second"
    taken.release()
    assert (root / owner.RECORD).stat().st_mode & 0o777 == 0o600


def test_a_checkpointer_of_another_run_is_refused_while_one_runs(tmp_path: Path) -> None:
    """Before: two jobs shared one checkpoint directory, and one's retention and restore
    sweep deleted the other's checkpoints."""
    w = torch.arange(4.0)
    with Checkpointer(tmp_path / "ckpt", run="a", mode="sync", keep=1) as ck:
        ck.save(5, {"w": w})
        before = _snapshot(tmp_path / "ckpt" / "step-5")
        with pytest.raises(DirectoryOwned, match="in use by job 'a'"):
            Checkpointer(tmp_path / "ckpt", run="b", eager_writer=False)
        # The same run (another rank, an in-process restart) shares it.
        Checkpointer(tmp_path / "ckpt", run="a", eager_writer=False).close()
    assert _snapshot(tmp_path / "ckpt" / "step-5") == before


def test_restoring_another_runs_checkpoint_is_a_choice(tmp_path: Path) -> None:
    w = torch.arange(6.0)
    with Checkpointer(tmp_path / "ckpt", run="a", mode="sync") as ck:
        ck.save(2, {"w": w})
    manifest = json.loads((tmp_path / "ckpt" / "step-2" / layout.MANIFEST).read_text())
    assert manifest["run"] == "a" and manifest["tensors"]["w"] == [6]
    target = torch.zeros(6)
    with (
        Checkpointer(tmp_path / "ckpt", run="b", eager_writer=False) as ck,
        pytest.raises(CheckpointError, match="written by run 'a', not by this run 'b'"),
    ):
        ck.restore({"w": target})
    assert torch.equal(target, torch.zeros(6)) and layout.committed_steps(tmp_path / "ckpt") == [2]
    with Checkpointer(tmp_path / "ckpt", run="b", allow_foreign=True, eager_writer=False) as ck:
        assert ck.restore({"w": target}) == 2
    assert torch.equal(target, w)


def test_a_checkpoint_of_another_shape_names_the_mismatched_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    small = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with Checkpointer(tmp_path / "ckpt", run="a", mode="sync") as ck:
        ck.save(0, {"model": small})
    big = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    kept = {k: v.clone() for k, v in big.state_dict().items()}
    with (
        Checkpointer(tmp_path / "ckpt", run="a", eager_writer=False) as ck,
        pytest.raises(CheckpointError) as e,
    ):
        ck.restore({"model": big})
    msg = str(e.value)
    assert "1 tensors differ: model.0.weight: checkpoint [3, 4], this state [3, 5]" in msg
    assert "Nothing was loaded" in msg
    assert all(torch.equal(v, kept[k]) for k, v in big.state_dict().items())


def test_the_reference_scripts_run_dir_is_the_jobs_across_restarts() -> None:
    """Before: under torchrun without --run-dir every restart picked runs/<timestamp>, never
    resumed, and re-fired its fault until the restart budget was gone."""
    base = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    dirs = {
        rundir.default_run_dir(
            WorkerEnv.from_environ(
                {**base, "TORCHELASTIC_RUN_ID": "job/7", "TORCHELASTIC_RESTART_COUNT": n}
            )
        )
        for n in ("0", "1", "2")
    }
    assert dirs == {Path("runs") / "job_7"}
    # torchrun with --rdzv-id left at "none": the agent (the workers' parent) names the job.
    none = WorkerEnv.from_environ({**base, "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2"})
    assert rundir.job_identity(none) == rundir.job_identity(none)
    assert f"-p{os.getppid()}-" in rundir.job_identity(none)
    # A process started by hand is a job of its own.
    alone = WorkerEnv.from_environ({})
    assert rundir.job_identity(alone).endswith(
        f"-p{os.getpid()}-{rundir._start_ticks(os.getpid())}"
    )


def test_the_reference_script_refuses_another_jobs_run_dir_unless_resumed(
    tmp_path: Path, holder: subprocess.Popen
) -> None:
    run_dir = tmp_path / "dir"
    argv = ["--run-dir", str(run_dir), "--steps", "0"]
    assert train.main(argv) == 2  # the holder runs: refused
    assert not (run_dir / "events").exists()
    holder.stop()  # type: ignore[attr-defined]
    assert train.main(argv) == 2  # it ended: continued only on purpose
    args = argparse.Namespace(job="mine", resume=True, ckpt_every=1, ckpt_dir=None)
    claims = rundir.claim_dirs(args, run_dir)
    assert [c.record.job for c in claims] == ["mine", "mine"]
    assert claims[0].record.previous == ["first"]
    for c in claims:
        c.release()
