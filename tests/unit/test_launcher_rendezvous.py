"""The c10d rendezvous as unbroken-run builds it: node identity, fast settings, a closed job."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from unbroken.launcher import args as largs
from unbroken.launcher.errors import LauncherError
from unbroken.launcher.rendezvous import C10dRendezvous, JobOver


@pytest.fixture()
def store_port() -> int:
    """A rendezvous store no agent hosts (as the store pod serves it)."""
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    yield int(server.port)
    del server


def _spec(port: int, conf: dict[str, str], nodes: int = 2) -> largs.JobSpec:
    return largs.JobSpec(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=1,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_id="job",
        rdzv_conf=conf,
        is_host=False,
        entry=largs.Entrypoint(kind="script", target="t.py"),
    )


def test_nodes_with_the_same_address_and_pid_are_told_apart(store_port: int) -> None:
    """A replacement pod has its predecessor's hostname and pid: its incarnation id differs."""
    conf = {"keep_alive_interval": "0.25", "keep_alive_max_attempt": "4"}
    a = C10dRendezvous(_spec(store_port, conf), node_addr="ft-0.ft", timeout_s=30, poll_s=0.05)
    b = C10dRendezvous(_spec(store_port, conf), node_addr="ft-0.ft", timeout_s=30, poll_s=0.05)
    na, nb = a.handler._this_node, b.handler._this_node
    assert (na.addr, na.pid) == (nb.addr, nb.pid) == ("ft-0.ft", os.getpid())
    assert na != nb
    settings = a.handler.settings
    assert settings.keep_alive_interval == timedelta(seconds=0.25)
    assert settings.keep_alive_max_attempt == 4
    assert a.handler._state_holder._cache_duration == 0.05
    a.close()
    b.close()


def test_a_node_that_never_joined_finds_the_job_over(store_port: int) -> None:
    done = C10dRendezvous(_spec(store_port, {}), node_addr="ft-0.ft", timeout_s=30)
    done.close()  # the job finished: the rendezvous is closed
    spare = C10dRendezvous(_spec(store_port, {}), node_addr="ft-3.ft", timeout_s=30)
    with pytest.raises(JobOver, match="closed"):
        spare.next_round()
    spare.close()


def test_bad_keep_alive_is_refused(store_port: int) -> None:
    with pytest.raises(LauncherError, match="keep_alive_interval='x' must be a number"):
        C10dRendezvous(_spec(store_port, {"keep_alive_interval": "x"}), node_addr="a", timeout_s=5)


def test_rendezvous_events_are_named_without_inspect_stack(
    store_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch names every rendezvous event with two ``inspect.stack()`` calls (tens of ms of
    CPU each, paid on every compare-and-set of a round); the agent's rendezvous names them by
    walking frames: the same names, and ``inspect.stack`` is never called."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    rdzv = C10dRendezvous(_spec(store_port, {}), node_addr="ft-0.ft", timeout_s=30)
    names: list[str] = []
    monkeypatch.setattr(
        dr, "construct_and_record_rdzv_event", lambda **kw: names.append(kw["name"])
    )

    def forbidden(*a: object, **kw: object) -> None:
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", forbidden)
    rdzv.handler._keep_alive()  # records an event, as every keep-alive does
    assert names == ["DynamicRendezvousHandler._keep_alive"]
    monkeypatch.undo()
    # torch's own answer: inspect.stack()[depth] counted from inside get_method_name
    assert dr.get_method_name(depth=1) == inspect.stack()[0].function
    rdzv.close()
