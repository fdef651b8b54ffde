"""``scripts/gpu_check.sh``, the GPU path's prepared run, as its CPU dry run: every part runs
(doctor, the size benchmark on the device, an exception and a hang recovered in-process with a
fault-free twin to compare hashes with), so the script is ready when a GPU is lent."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from procs import python_shim, worker_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_passes_and_leaves_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    env = worker_env(PY=str(python_shim(tmp_path)))  # its Python commands from the launch server
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "gpu_check: passed on cpu" in res.stdout
    assert "bit-exact after both faults" in res.stdout
    (row,) = json.loads((out / "size.json").read_text())
    assert row["modes"][0]["restore_memory_ok"] and row["modes"][0]["restore_disk_ok"]
    clean = json.loads((out / "clean" / "final.json").read_text())
    faults = json.loads((out / "faults" / "final.json").read_text())
    assert clean["final_state_sha256"] == faults["final_state_sha256"]


def test_bad_arguments_say_what_was_wrong() -> None:
    script = str(ROOT / "scripts" / "gpu_check.sh")
    res = subprocess.run(["bash", script, "--device", "tpu"], capture_output=True, text=True)
    assert res.returncode == 2 and "--device takes cuda or cpu, got tpu" in res.stderr
    res = subprocess.run(["bash", script, "--nope"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown argument --nope" in res.stderr
