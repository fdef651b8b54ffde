"""The emulated cluster's controllers and network, with containers that are small shell scripts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from unbroken.k8s.emulate import Cluster, EmulationConfig
from unbroken.k8s.emulate.net import netns_unavailable

NETNS = pytest.mark.skipif(netns_unavailable() is not None, reason=f"{netns_unavailable()}")


def _job(script: str, *, completions: int = 2, **spec: Any) -> dict[str, Any]:
    """An Indexed Job whose container runs ``sh -c script`` (the index in $JOB_COMPLETION_INDEX)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "ft", "namespace": "default"},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            **spec,
            "template": {
                "metadata": {"labels": {"app": "ft"}},
                "spec": {
                    "subdomain": "ft",
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "command": ["sh", "-c", script]}],
                },
            },
        },
    }


HEADLESS = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "ft", "namespace": "default"},
    "spec": {"clusterIP": "None", "selector": {"app": "ft"}},
}


def _run(
    tmp_path: Path, docs: list[dict[str, Any]], *, mode: str = "loopback", **cfg: Any
) -> Cluster:
    cluster = Cluster(tmp_path, cfg=EmulationConfig(mode=mode, **cfg))
    try:
        cluster.apply(docs)
        cluster.wait(60)
    finally:
        cluster.close()
    return cluster


def _events(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    return [h for h in cluster.history if h["event"] == kind]


def test_counted_failures_replace_the_pod_until_the_index_budget_then_fail_the_job(
    tmp_path: Path,
) -> None:
    # Index 1 always fails; index 0 succeeds.
    job = _job(
        '[ "$JOB_COMPLETION_INDEX" = 0 ] || exit 1', backoffLimitPerIndex=2, maxFailedIndexes=0
    )
    c = _run(tmp_path, [job], failure_backoff_s=0.05)
    assert c.status() == "Failed"
    assert [h["reason"] for h in _events(c, "job_failed")] == ["MaxFailedIndexesExceeded"]
    starts = [h["index"] for h in _events(c, "pod_started")]
    assert starts.count(1) == 3 and starts.count(0) == 1  # first try + backoffLimitPerIndex
    ips = [h["ip"] for h in _events(c, "pod_started")]
    assert len(set(ips)) == len(ips)  # a new address for every pod
    # The Job controller's back-off doubles per counted failure of the index: 0.05 s, 0.1 s.
    t = [
        h["ts"]
        for h in c.history
        if h["event"] in ("pod_failed", "pod_started") and h["index"] == 1
    ]
    assert t[2] - t[1] >= 0.05 and t[4] - t[3] >= 0.1


def test_a_failjob_exit_code_fails_at_once_and_deletes_the_other_pods(tmp_path: Path) -> None:
    policy = {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]}
    job = _job(
        '[ "$JOB_COMPLETION_INDEX" = 0 ] && exit 3; exec sleep 30',
        backoffLimitPerIndex=5,
        podFailurePolicy=policy,
    )
    t0 = time.monotonic()
    c = _run(tmp_path, [job])
    assert time.monotonic() - t0 < 20  # the sleeping pod was deleted (SIGTERM), not waited for
    assert [h["reason"] for h in _events(c, "job_failed")] == ["PodFailurePolicy"]
    assert len(_events(c, "pod_started")) == 2  # no replacement
    ended = {h["index"]: h["exit_code"] for h in _events(c, "pod_ended")}
    assert ended == {0: 3, 1: 128 + 15}


def test_a_lost_node_is_ignored_by_the_policy_and_replaced_with_a_new_address(
    tmp_path: Path,
) -> None:
    policy = {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            }
        ]
    }
    # The first pod of index 0 sleeps (and is lost); its replacement finds the marker and exits 0.
    marker = tmp_path / "lost"
    script = f'[ "$JOB_COMPLETION_INDEX" = 1 ] && exit 0; [ -e {marker} ] && exit 0; exec sleep 30'
    cluster = Cluster(tmp_path, cfg=EmulationConfig(mode="loopback", pod_start_delay_s=0.2))
    try:
        cluster.apply([_job(script, backoffLimitPerIndex=0, podFailurePolicy=policy)])
        deadline = time.monotonic() + 30
        while not cluster.running(owner="Job/ft") or cluster.running()[0].index != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        marker.touch()
        lost_at = cluster.lose(cluster.pod("ft-0"))
        assert cluster.wait(30) == "Complete"
    finally:
        cluster.close()
    [failed] = _events(cluster, "pod_failed")
    assert (failed["action"], failed["conditions"], failed["exit_code"]) == (
        "Ignore",
        ["DisruptionTarget"],
        137,
    )
    zero = [h for h in _events(cluster, "pod_started") if h["index"] == 0]
    assert len(zero) == 2 and zero[0]["ip"] != zero[1]["ip"]
    assert zero[1]["ts"] - lost_at >= 0.2  # the pod start delay


def test_jobset_restarts_every_pod_then_fails_by_its_rule(tmp_path: Path) -> None:
    count = tmp_path / "count"
    script = f'echo "$RESTART $JOB_COMPLETION_INDEX" >> {count}; [ "$JOB_COMPLETION_INDEX" = 1 ] && exit 1; exec sleep 30'
    job = _job(script, backoffLimit=0)["spec"]
    job["template"]["spec"]["containers"][0]["env"] = [
        {
            "name": "RESTART",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
                }
            },
        }
    ]
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "js", "namespace": "default"},
        "spec": {
            "failurePolicy": {"maxRestarts": 2},
            "replicatedJobs": [{"name": "node", "template": {"spec": job}}],
        },
    }
    c = _run(tmp_path, [jobset])
    assert c.status() == "Failed"
    assert [h["restart"] for h in _events(c, "jobset_restart")] == [1, 2]
    assert sorted(count.read_text().split("\n")[:-1]) == [
        f"{r} {i}" for r in range(3) for i in range(2)
    ]
    hosts = {h["hostname"] for h in _events(c, "pod_started")}
    assert hosts == {"js-node-0-0", "js-node-0-1"}
    # A FailJobSet rule on the child's failure reason ends it without a restart.
    jobset["spec"]["failurePolicy"]["rules"] = [
        {"name": "stop", "action": "FailJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]}
    ]
    count.unlink()
    c = _run(tmp_path / "2", [jobset])
    assert c.status() == "Failed" and not _events(c, "jobset_restart")


def test_a_deployment_pod_is_replaced_whenever_it_ends(tmp_path: Path) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "store", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "template": {
                "metadata": {"labels": {"app": "store"}},
                "spec": {"containers": [{"name": "s", "command": ["sh", "-c", "sleep 0.1"]}]},
            },
        },
    }
    cluster = Cluster(tmp_path, cfg=EmulationConfig(mode="loopback"))
    try:
        cluster.apply([deployment, _job("exit 0", completions=1)])
        cluster.wait(30)
        time.sleep(0.5)
    finally:
        cluster.close()
    assert (
        len([h for h in _events(cluster, "pod_started") if h["owner"] == "Deployment/store"]) >= 3
    )


@NETNS
def test_pods_have_their_own_hostname_and_find_each_other_by_name_after_a_replacement(
    tmp_path: Path,
) -> None:
    """Each pod is a network namespace with its hostname; the hosts file maps the headless
    Service's names to the pods' current addresses and follows a replacement's new address."""
    out = tmp_path / "out"
    out.mkdir()
    script = (
        f'echo "$(hostname) $(hostname -f)" > {out}/$(hostname).name; '
        '[ "$JOB_COMPLETION_INDEX" = 1 ] && exec sleep 30; '
        f"while true; do getent hosts ft-1.ft > {out}/seen.tmp && mv {out}/seen.tmp {out}/seen; "
        f"[ -e {out}/stop ] && exit 0; sleep 0.05; done"
    )
    policy = {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            }
        ]
    }
    cluster = Cluster(tmp_path, cfg=EmulationConfig(mode="netns"))
    try:
        cluster.apply([HEADLESS, _job(script, backoffLimitPerIndex=0, podFailurePolicy=policy)])
        deadline = time.monotonic() + 30

        def seen() -> str:
            return (out / "seen").read_text().split()[0] if (out / "seen").exists() else ""

        def ip() -> str | None:
            return next((p.ip for p in cluster.running() if p.hostname == "ft-1"), None)

        while seen() != ip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        old = seen()
        cluster.lose(cluster.pod("ft-1"))
        while seen() in ("", old) or seen() != ip():
            assert time.monotonic() < deadline, seen()
            time.sleep(0.05)
        (out / "stop").touch()
        cluster.lose(cluster.pod("ft-1"))  # the sleeping replacement: a lost node too
        deadline = time.monotonic() + 30
        while cluster.status() is None and len(cluster.running(owner="Job/ft")) > 1:
            time.sleep(0.05)
    finally:
        cluster.close()
    assert (out / "ft-0.name").read_text().split() == ["ft-0", "ft-0.ft.default.svc.cluster.local"]
    assert (out / "ft-1.name").read_text().split()[0] == "ft-1"
    ips = [h["ip"] for h in _events(cluster, "pod_started") if h["hostname"] == "ft-1"]
    assert ips[0] == old and ips[1] != old and ips[1].startswith("10.210.")


SERVE = "import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1].split('=')[1]))); s.listen(); c, _ = s.accept(); c.sendall(b'hi'); c.close()"
DIAL = (
    "import socket,sys,time\n"
    "host, port = sys.argv[1].rsplit(':', 1)\n"
    "for _ in range(200):\n"
    "    try: c = socket.create_connection((host, int(port)), timeout=1); break\n"
    "    except OSError: time.sleep(0.05)\n"
    "print(sys.argv[1], c.recv(2).decode())\n"
)


def test_loopback_mode_writes_addresses_and_free_ports_where_names_and_ports_are(
    tmp_path: Path,
) -> None:
    """Without namespaces, a pod reaches another by the name in its arguments: the emulation
    writes the peer's loopback address and a free host port for the declared container port."""
    import sys

    job = _job("exit 0")
    job["spec"]["template"]["spec"]["containers"] = [
        {
            "name": "main",
            "command": [
                "sh",
                "-c",
                f'[ "$JOB_COMPLETION_INDEX" = 0 ] && exec {sys.executable} -c "$0" "$2"; '
                f'exec {sys.executable} -c "$1" "$3"',
                SERVE,
                DIAL,
                "--port=29500",
                "ft-0.ft:29500",
            ],
            "ports": [{"containerPort": 29500}],
        }
    ]
    c = _run(tmp_path, [HEADLESS, job])
    assert c.status() == "Complete"
    [dialer] = [p for p in c.pods if p.index == 1]
    assert dialer.log is not None
    target, answer = dialer.log.read_text().split()
    host, port = target.rsplit(":", 1)
    assert answer == "hi" and host == next(p.ip for p in c.pods if p.index == 0)
    assert host.startswith("127.210.") and int(port) != 29500
