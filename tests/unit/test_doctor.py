"""``unbroken doctor`` runs its real checks on this machine: a healthy setup passes, and each
deliberately bad input (staging larger than /dev/shm, a bound port, a missing or read-only
checkpoint directory, a full disk's worth of state) fails the check that owns it, with what to
do; bad flag values are one line and exit code 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from unbroken import cli, doctor
from unbroken.doctor import EXIT_FAILED, DoctorConfig, backends, host, memory, storage
from unbroken.ports import ephemeral_range

GB = 1e9


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[doctor.Report, Path]:
    """Every check once, for a small job checkpointing to a fresh directory."""
    d = tmp_path_factory.mktemp("ckpt")
    return doctor.run(DoctorConfig(state_gb=0.001, nproc_per_node=2, checkpoint_dir=d)), d


@pytest.fixture
def bound_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _shm_free_gb() -> float:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize / GB


def test_this_machine_passes_every_check(healthy: tuple[doctor.Report, Path]) -> None:
    report, d = healthy
    by_name = {c.name: c for c in report.checks}
    assert list(by_name) == [name for name, _ in doctor.CHECKS]
    assert report.failed == [], report.format()
    assert report.exit_code == 0
    for name in ("torch", "gloo", "shm", "memory", "memfd", "port", "clock"):
        assert by_name[name].status == "ok", by_name[name]
    assert "all-reduced" in by_name["gloo"].found
    assert "staging needs 0.0 GB" in by_name["memory"].found  # sized: 1 MB x 2 ranks x 3 slots
    assert by_name["checkpoint"].status in ("ok", "warn")  # warn: a file system without flock
    assert "write, fsync and rename work" in by_name["checkpoint"].found
    assert list(d.iterdir()) == []  # the probe cleaned up after itself


def test_the_text_report_has_one_line_per_check(healthy: tuple[doctor.Report, Path]) -> None:
    report, _ = healthy
    lines = report.format().splitlines()
    assert len(lines) == len(doctor.CHECKS) + 1
    assert lines[0].startswith("ok    torch")
    assert lines[-1].startswith("0 failed")


def test_staging_is_state_x_ranks_x_regions_plus_peer_replicas() -> None:
    assert DoctorConfig(state_gb=2, nproc_per_node=4).staging_bytes() == 2 * GB * 4 * 1
    assert DoctorConfig(state_gb=2, nproc_per_node=4, memory_slots=2).staging_bytes() == (
        2 * GB * 4 * 2
    )
    assert DoctorConfig(state_gb=2, nproc_per_node=4, nnodes=2).staging_bytes() == (
        2 * GB * 4 * (2 + 2)
    )
    no_tier = DoctorConfig(state_gb=2, nproc_per_node=4, nnodes=2, memory_tier=False)
    assert no_tier.staging_bytes() == 2 * GB * 4 * 1
    # keep=2 committed + 1 in flight, every rank of every node on the shared file system
    assert DoctorConfig(state_gb=2, nproc_per_node=4, nnodes=2).checkpoint_bytes() == (
        3 * 2 * GB * 8
    )


def test_a_staging_larger_than_dev_shm_is_no_shm_failure_the_arena_is_a_memfd() -> None:
    # The arena is a memfd on the kernel's own tmpfs: /dev/shm's size does not limit it (a
    # 512 MB memfd fills with /dev/shm at 64 MB, measured), so only memory judges the staging.
    too_big = _shm_free_gb() + 1
    check = memory.check_shm(DoctorConfig(state_gb=too_big))
    assert check.status == "ok" and "memfd, not in it" in check.found


def test_a_small_dev_shm_warns_and_says_how_to_give_it_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = tmp_path / "shm"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)])
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        monkeypatch.setattr(memory, "SHM", small)
        check = memory.check_shm(DoctorConfig())
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert check.status == "warn" and f"{small}: 0.1 GB" in check.found
    assert "--shm-size" in check.fix


def test_a_failed_check_makes_the_cli_exit_with_its_own_code(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["doctor", "--checkpoint-dir", str(tmp_path / "nope")]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert any(line.startswith("FAIL  checkpoint") for line in out.splitlines())
    assert "1 failed" in out


def test_a_staging_over_the_memory_limit_fails_the_memory_check() -> None:
    check = memory.check_memory(DoctorConfig(state_gb=1e6))  # a petabyte per rank
    # over a cgroup limit the first save would be OOM-killed: fail; else a warning
    assert check.status == ("fail" if "cgroup limit" in check.found else "warn")
    assert "staging needs" in check.found and "more ranks" in check.fix
    assert "--memory-slots" not in check.fix  # one copy per rank already: no fewer slots
    ring = memory.check_memory(DoctorConfig(state_gb=1e6, memory_slots=3))
    assert "fewer --memory-slots" in ring.fix


def test_json_report_for_machines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["doctor", "--json", "--checkpoint-dir", str(missing)]) == EXIT_FAILED
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is False and got["exit_code"] == EXIT_FAILED
    by_name = {c["name"]: c for c in got["checks"]}
    assert by_name["checkpoint"]["status"] == "fail"
    assert "does not exist" in by_name["checkpoint"]["found"]
    assert "mkdir" in by_name["checkpoint"]["fix"]
    assert by_name["torch"]["status"] == "ok"


def test_a_bound_port_fails(bound_port: int) -> None:
    check = host.check_port(DoctorConfig(port=bound_port))
    assert check.status == "fail"
    assert str(bound_port) in check.found and "in use" in check.found
    assert f":{bound_port}" in check.fix


def test_a_free_port_in_the_ephemeral_range_warns() -> None:
    lo, hi = ephemeral_range() or (0, -1)
    with socket.socket() as s:  # port 0 hands out an ephemeral port; free again once closed
        s.bind(("", 0))
        port = s.getsockname()[1]
    assert lo <= port <= hi
    check = host.check_port(DoctorConfig(port=port))
    assert check.status == "warn" and "ephemeral" in check.found


def test_checkpoint_dir_takes_a_commit_and_locks(tmp_path: Path) -> None:
    check = storage.check_checkpoint_dir(DoctorConfig(checkpoint_dir=tmp_path, state_gb=0.001))
    assert check.status == "ok", check
    assert "flock enforced" in check.found
    assert storage._fs_type(tmp_path) != "?"


def test_a_missing_checkpoint_dir_fails(tmp_path: Path) -> None:
    check = storage.check_checkpoint_dir(DoctorConfig(checkpoint_dir=tmp_path / "a" / "b"))
    assert check.status == "fail" and "does not exist" in check.found


def test_a_file_as_checkpoint_dir_fails(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    check = storage.check_checkpoint_dir(DoctorConfig(checkpoint_dir=tmp_path / "f"))
    assert check.status == "fail" and "not a directory" in check.found


def test_checkpoints_larger_than_the_disk_fail(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free_gb = st.f_bavail * st.f_frsize / GB
    cfg = DoctorConfig(checkpoint_dir=tmp_path, state_gb=free_gb / 3 + 1)  # x (keep 2 + 1)
    check = storage.check_checkpoint_dir(cfg)
    assert check.status == "fail"
    assert "2 kept + 1 in flight" in check.found and "--keep" in check.fix


_CHECK_DIR = (
    "import json, sys; from pathlib import Path; from unbroken.doctor import DoctorConfig, storage; "
    "c = storage.check_checkpoint_dir(DoctorConfig(checkpoint_dir=Path(sys.argv[1]))); "
    "print(json.dumps(c.__dict__))"
)


def test_a_read_only_checkpoint_dir_fails(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        try:
            found = storage.check_checkpoint_dir(DoctorConfig(checkpoint_dir=ro)).__dict__
        finally:
            ro.chmod(0o755)
    else:
        # root writes through permission bits: mount a read-only tmpfs over the directory in a
        # private mount namespace of a child, which the machine never sees.
        script = 'mount -t tmpfs -o ro,size=1m tmpfs "$1" && exec "$2" -c "$3" "$1"'
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(ro)]
            + [sys.executable, _CHECK_DIR],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0 and done.stderr.startswith(("unshare:", "mount:")):
            pytest.skip(f"no private read-only mount here: {done.stderr.strip()}")
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
    assert found["status"] == "fail", found
    assert "cannot take a checkpoint" in found["found"]
    assert "read-write" in found["fix"]


def test_memfd_and_clock_and_torch_pass_here() -> None:
    cfg = DoctorConfig()
    for check in (memory.check_memfd, host.check_clock, backends.check_torch):
        got = check(cfg)
        assert got.status == "ok", got


def test_cgroup_probe_leaves_no_child_behind() -> None:
    from unbroken.faults import slowrank

    check = host.check_cgroup(DoctorConfig())
    mechanism, where = slowrank.probe()
    assert check.status == ("warn" if mechanism == "emulated" else "ok")
    if mechanism != "emulated":
        assert not (Path(where) / f"{slowrank.PREFIX}probe-{os.getpid()}").exists()


def test_more_ranks_than_devices_or_no_device_is_reported() -> None:
    import torch

    check = backends.check_cuda(DoctorConfig(nproc_per_node=1024))
    if torch.cuda.is_available():
        assert check.status == "fail" and "--nproc-per-node 1024" in check.found
    else:
        assert check.status in ("ok", "warn") and "CPU" in check.found


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--port", "-1"],
        ["--state-gb", "-1"],
        ["--state-gb", "nan"],
        ["--state-gb", "inf"],
        ["--nproc-per-node", "0"],
        ["--nnodes", "0"],
        ["--memory-slots", "0"],
        ["--keep", "0"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["doctor", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no check ran
    assert captured.err.startswith("error:") and captured.err.count("\n") == 1
    assert argv[0] in captured.err
