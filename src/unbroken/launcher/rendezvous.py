"""Rendezvous rounds over torch's c10d rendezvous, each with a fresh store for its workers.

Membership and group ranks come from torch's ``DynamicRendezvousHandler`` on a c10d TCPStore
(the *job store*, hosted by the agent whose address matches the endpoint, alive for the whole
job; workers get its address as ``UNBROKEN_STORE_ADDR``). On top of each completed round:

- the agent torch ranks 0 draws the round id from a job-wide counter in the job store
  (``unbroken/<rdzv_id>/round``), so every agent and worker agrees on it;
- that agent numbers the nodes: a node keeps its group rank while it is free, so a hot spare
  takes the lost node's and the others' workers keep their ranks (``grouprank``);
- it starts a brand-new TCPStore server on a free port for the round's workers (both stores
  an agent hosts listen where ``listen.bind_address`` says: loopback for a single-node job)
  (``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``) and publishes its
  address under a round-scoped key. A worker of round N can never read a key a worker of
  round N-1 wrote, so no restarted worker dials a dead peer's stale address
  (pytorch/pytorch#135712), whatever prefix the script uses;
- agents exchange their worker counts, so global ranks are contiguous per node.

A single-node job (``--nnodes 1``) runs torch's rendezvous once, at start-up: a restart's round
only draws the next round id and starts a fresh worker store (``_alone``), without the store
traffic of a rendezvous round (tens of milliseconds) or torch's random 0-0.3 s start skew.

Speed of a multi-node round. A lost node is dropped when its keep-alive is
``keep_alive_interval`` x ``keep_alive_max_attempt`` old (``--rdzv-conf``; fractions of a second
are accepted here, torch's own parser takes whole seconds only), and torch looks at the shared
state once a second while nodes gather; ``poll_s`` (``--ft-rdzv-poll-s``) shortens that look.

The store pod is no single point of failure. When the job store lives apart from every agent
(the store pod of ``unbroken k8s render``) and its connection breaks, an agent re-joins the
store at the same endpoint (the replacement pod behind the Service) and restores there what the
store held from its own state: torch's rendezvous state (participants, wait list, keep-alives:
the first agent back writes the copy it holds, the others adopt it) and the round counter (at
least one past the newest round this agent saw). Running agents reconnect in the background and
keep training meanwhile; a round waits for the store (up to the rendezvous timeout). Workers
started after that reach the new store by the same address.

A node that never took part in a round and finds the rendezvous closed (a hot spare, a late
replacement: the job finished without it) gets ``JobOver``, not an error. Each agent names
itself with a random incarnation id (torch's default, a per-process counter, would make a
replacement pod, with its predecessor's hostname and pid, pass for the dead node). Only a
finished job or a failure every node shares closes the rendezvous; a node leaves it otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from unbroken import env as uenv
from unbroken.launcher import departure, grouprank, listen, rdzvconf, storelink
from unbroken.launcher.args import JobSpec
from unbroken.launcher.errors import LauncherError
from unbroken.ledger import NULL, Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)

_CLOSED = ("RendezvousClosedError", "RendezvousGracefulExitError")


@dataclass(frozen=True, kw_only=True)
class RoundInfo:
    """One completed rendezvous round, as this node sees it."""

    round: int
    """The globally agreed round id (0 at the first launch)."""
    group_rank: int
    """This node's rank among the nodes of the round."""
    group_world_size: int
    """Nodes in the round."""
    rank_offset: int
    """Global rank of this node's local rank 0."""
    world_size: int
    """Workers in the round, all nodes together."""
    master_addr: str
    """Host of the round's fresh worker store."""
    master_port: int
    """Port of the round's fresh worker store."""
    store_addr: str
    """host:port of the job store (lives for the whole job)."""
    peers: tuple[str, ...] = ()
    """Every node's peer memory service (``host:port#token``) in group-rank order; () when
    the nodes run none (a single-node job)."""


class PeerPort(Protocol):
    """This node's peer memory service (``unbroken.checkpoint.tiers.peers.PeerService``)."""

    @property
    def peer(self) -> object: ...  # its address, as str() gives it: host:port#token
    def begin_round(self, round_: int) -> None: ...


def _split(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, default_port
    return host.strip("[]"), int(port)


class JobOver(LauncherError):
    """The rendezvous is closed: the job finished without this node (a spare, a late pod)."""


class C10dRendezvous:
    """torch's c10d rendezvous plus the round id, the worker store and the exit barrier."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        node_addr: str,
        timeout_s: float,
        poll_s: float = 1.0,
        peers: PeerPort | None = None,
        ledger: Recorder = NULL,
    ) -> None:
        # torch's shared store is the stale-key source
        uenv.set_for_torch(uenv.TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1")
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
            create_backend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousSettings,
            RendezvousTimeout,
            _BackendRendezvousStateHolder,
            _NodeDesc,
        )

        self._dist = dist
        self.spec = spec
        self.node_addr = node_addr
        self.timeout_s = timeout_s
        self.peers = peers
        self.ledger = ledger
        self._host = socket.gethostname()
        conf: dict[str, Any] = dict(spec.rdzv_conf)
        conf.setdefault("join_timeout", str(max(1, int(timeout_s))))
        timeouts = {k: rdzvconf.seconds(conf, f"{k}_timeout") for k in rdzvconf.TIMEOUTS}
        keep_alive_s = rdzvconf.seconds(conf, "keep_alive_interval") or 5.0
        attempts = int(conf.pop("keep_alive_max_attempt", 3))
        # Between rounds a store call that takes longer than a node's keep-alive window is a
        # store gone silent (its pod lost with its link): give up on the call, re-join.
        self._op_timeout = timedelta(seconds=min(30.0, max(2.0, keep_alive_s * attempts)))
        if spec.is_host is not None:
            conf["is_host"] = spec.is_host
        params = RendezvousParameters(
            backend="c10d",
            endpoint=spec.rdzv_endpoint,
            run_id=spec.rdzv_id,
            min_nodes=spec.min_nodes,
            max_nodes=spec.max_nodes,
            local_addr=node_addr,
            **conf,
        )
        # torch names a node (address, pid, a per-process counter): a replacement pod has the
        # same hostname and, in a container, the same pid as the node it replaces, and would
        # be taken for it. A random incarnation id instead of the counter keeps them apart.
        node = _NodeDesc(node_addr, os.getpid(), int.from_bytes(os.urandom(4), "big") >> 1)
        settings = RendezvousSettings(
            spec.rdzv_id,
            spec.min_nodes,
            spec.max_nodes,
            RendezvousTimeout(
                *(None if v is None else timedelta(seconds=v) for v in timeouts.values())
            ),
            keep_alive_interval=timedelta(seconds=keep_alive_s),
            keep_alive_max_attempt=attempts,
        )
        self._hosted = True  # until the job store is known to be another's (re-joinable)
        self._read_timeout = timedelta(seconds=60)
        try:
            if str(conf.get("store_type", "tcp")).strip().lower() == "tcp":
                store = self._job_store(dist, params)
                backend = C10dRendezvousBackend(store, spec.rdzv_id)
            else:
                backend, store = create_backend(params)
            # The shared state is cached for a second between two reads; look as often as polled.
            holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=poll_s)  # type: ignore[arg-type]
            self.handler = DynamicRendezvousHandler(node, settings, backend.name, store, holder)
        except Exception as e:
            raise LauncherError(
                f"cannot reach the c10d rendezvous at {spec.rdzv_endpoint}: {e}; check "
                "--rdzv-endpoint and that the host agent (or the store pod) is up"
            ) from e
        self._undo_polls = rdzvconf.fast_polls(poll_s) if poll_s != 1.0 else None
        rdzvconf.cheap_event_names()
        self.job_store: Any = store  # a TCPStore (mypy sees the Store base)
        host, _ = _split(spec.rdzv_endpoint)
        self.store_addr = f"{host}:{getattr(store, 'port', 0)}"
        self._worker_store: Any = None
        self._rounds = 0
        self._joined = False
        self._group_rank = -1  # ours in the last round (stable_ranks)
        self._members: set[Any] = set()
        self._last_round: int | None = None
        self._reconnect: storelink.Reconnect | None = None
        self._lost_at: float | None = None

    def _job_store(self, dist: Any, params: Any) -> Any:
        """The job store, as torch's c10d backend makes it (host it when this agent is the
        endpoint's, else connect), except that a hosted one listens on ``listen.bind_address``
        of the endpoint, not on every interface."""
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        host, port = _split(self.spec.rdzv_endpoint)
        timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60)))
        self._read_timeout = timeout
        is_host = self.spec.is_host
        if is_host is None:
            is_host = _matches_machine_hostname(host)
        self._hosted = False
        if is_host:
            bind = listen.bind_address(host, single_node=self.spec.max_nodes == 1)
            try:
                store = listen.listening_store(
                    dist, host, port, bind=bind, timeout=timeout, multi_tenant=True
                )
                self._hosted = True
                return store
            except (RuntimeError, ValueError, TimeoutError, OSError):
                if self.spec.is_host is not None:
                    raise
                # Guessed from the hostname: another agent on this machine may host it.
        before = listen.open_fds()
        store = dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
        if not listen.fail_when_silent(before, port, self._op_timeout.total_seconds()):
            logger.warning(
                "found no connection to the rendezvous store to guard: if its pod is lost "
                "silently, this agent may wait on it until the store timeout"
            )
        return store

    # --- the job store lost and re-joined -------------------------------------------------
    def _store_lost(self, e: BaseException) -> bool:
        """``e`` says the job store's connection broke (not a timeout, not a closed round),
        and the store is one this agent can re-join (it does not host it)."""
        return not self._hosted and storelink.connection_broke(e, self._dist)

    def _reconnecting(self, e: BaseException) -> storelink.Reconnect:
        if self._lost_at is None:
            self._lost_at = time.monotonic()
            self.ledger.emit(
                ev.RDZV_STORE, state="lost", endpoint=self.spec.rdzv_endpoint, host=self._host
            )
        if self._reconnect is None or self._reconnect.failed():
            logger.warning(
                "the rendezvous store at %s is lost (%s): re-joining it (or its replacement)",
                self.spec.rdzv_endpoint,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            self._reconnect = self._new_reconnect()
        return self._reconnect

    def _new_reconnect(self) -> storelink.Reconnect:
        return storelink.Reconnect(
            *_split(self.spec.rdzv_endpoint),
            self._dist,
            self.timeout_s,
            self._read_timeout,
            self._op_timeout.total_seconds(),
        )

    def _rejoin(self, store: Any) -> None:
        """Use ``store`` (a new connection to the endpoint) as the job store and restore in it
        what this agent knows: torch's rendezvous state and the round counter."""
        participants, waiting = storelink.restore(
            self.handler, store, self.spec.rdzv_id, self._last_round
        )
        self.job_store = store
        self._reconnect = None
        outage_s = time.monotonic() - (self._lost_at or time.monotonic())
        self._lost_at = None
        self.ledger.emit(
            ev.RDZV_STORE,
            state="rejoined",
            endpoint=self.spec.rdzv_endpoint,
            host=self._host,
            outage_s=round(outage_s, 3),
            participants=participants,
        )
        logger.warning(
            "re-joined the rendezvous store at %s (round counter past %s, %d participant(s), "
            "%d waiting)",
            self.spec.rdzv_endpoint,
            self._last_round,
            participants,
            waiting,
        )

    def _wait_rejoin(self, e: BaseException) -> None:
        """Block until the job store is re-joined (up to the rendezvous timeout); raise ``e``'s
        error when it is not."""
        store = self._reconnecting(e).wait(self.timeout_s)
        if store is None:
            raise LauncherError(
                f"lost the rendezvous store at {self.spec.rdzv_endpoint} and could not reach it "
                f"again within {self.timeout_s:.0f} s: check that its pod (or host agent) is up"
            ) from e
        self._rejoin(store)

    def next_round(self) -> RoundInfo:
        """Join the next round (blocks until it completes or times out); a lost job store is
        re-joined first (its replacement, once it is up)."""
        self._worker_store = None  # the previous round's store dies with its workers
        self._rounds += 1
        if self._reconnect is not None:
            self._wait_rejoin(RuntimeError("the store was lost while training"))
        try:
            info = self._next_round()
        except Exception as e:
            if not self._store_lost(e):
                raise
            self._wait_rejoin(e)
            info = self._next_round()
        self._last_round = info.round
        return info

    def _next_round(self) -> RoundInfo:
        if self.spec.max_nodes == 1 and self._rounds > 1:
            return self._alone()
        try:
            info = self.handler.next_rendezvous()
        except Exception as e:
            # Closed: the job ended. For a node that never took part (a spare) that is the end.
            if not self._joined and type(e).__name__ in _CLOSED:
                raise JobOver(f"the rendezvous {self.spec.rdzv_id!r} is closed: {e}") from e
            raise
        self._joined = True
        rstore: Any = info.store  # a PrefixStore (mypy's Store base lacks multi_set)
        torch_rank, group_world = info.rank, info.world_size
        timeout = timedelta(seconds=self.timeout_s)
        rstore.set_timeout(timeout)
        mine = (self.spec.nproc_per_node, self.peers.peer if self.peers else "", self._group_rank)
        names = ("nproc", "peer", "was")
        rstore.multi_set([f"unbroken/{n}/{torch_rank}" for n in names], [str(v) for v in mine])
        if torch_rank == 0:
            published: dict[str, Any] = self._open_round()
            was = rstore.multi_get([f"unbroken/was/{i}" for i in range(group_world)])
            published["ranks"] = grouprank.stable_ranks([int(v) for v in was])
            rstore.set("unbroken/round", json.dumps(published))
        else:
            published = json.loads(rstore.get("unbroken/round"))
        self._members = set(self._state().participants) if self._state() is not None else set()
        ranks = [int(r) for r in published["ranks"]]  # torch's order -> ours
        group_rank = self._group_rank = ranks[torch_rank]
        keys = [f"unbroken/{n}/{i}" for n in names[:2] for i in range(group_world)]
        got = [bytes(v).decode() for v in rstore.multi_get(keys)]
        counts, peers = [0] * group_world, [""] * group_world
        for i, r in enumerate(ranks):
            counts[r], peers[r] = int(got[i]), got[group_world + i]
        if self.peers is not None:
            self.peers.begin_round(int(published["round"]))
        self.job_store.set_timeout(self._op_timeout)
        return RoundInfo(
            round=int(published["round"]),
            group_rank=group_rank,
            group_world_size=group_world,
            rank_offset=sum(counts[:group_rank]),
            world_size=sum(counts),
            master_addr=str(published["master_addr"]),
            master_port=int(published["master_port"]),
            store_addr=self.store_addr,
            peers=tuple(peers) if all(peers) and group_world > 1 else (),
        )

    def _alone(self) -> RoundInfo:
        """A later round of a single-node job: no other node can join (``--nnodes 1``), so
        torch's rendezvous round (tens of milliseconds of store traffic on every restart) is
        skipped; the round id and a fresh worker store are made as for any round."""
        published = self._open_round()
        return RoundInfo(
            round=published["round"],
            group_rank=0,
            group_world_size=1,
            rank_offset=0,
            world_size=self.spec.nproc_per_node,
            master_addr=self.node_addr,
            master_port=published["master_port"],
            store_addr=self.store_addr,
        )

    def _open_round(self) -> dict[str, Any]:
        """What group rank 0 does for every round: draw the next round id and start the
        round's fresh worker store; returns what the other nodes are told of them."""
        round_id = int(self.job_store.add(f"unbroken/{self.spec.rdzv_id}/round", 1)) - 1
        self._worker_store = listen.listening_store(
            self._dist,
            self.node_addr,
            0,
            bind=listen.bind_address(self.node_addr, single_node=self.spec.max_nodes == 1),
            timeout=timedelta(seconds=self.timeout_s),
        )
        return {
            "round": round_id,
            "master_addr": self.node_addr,
            "master_port": int(self._worker_store.port),
        }

    def _state(self) -> Any:
        # torch has no public query for "a node of my round left"; read the handler's synced
        # state, and treat a changed shape as "nothing known".
        return getattr(getattr(self.handler, "_state_holder", None), "state", None)

    def membership(self) -> tuple[int, list[str]]:
        """(nodes waiting to join, nodes of this round gone from the rendezvous).

        A node is gone when its keep-alive expired (torch removed it from the participants, the
        wait list and the redundancy list); a node re-joining sits on the wait list instead.
        Store errors count as "nothing changed": a dead store host shows up as worker failures.
        """
        if self._reconnect is not None:  # the store is lost: re-join it once it answers
            store = self._reconnect.poll()
            if store is None:
                if self._reconnect.failed():  # still gone: keep trying while training goes on
                    self._reconnect = self._new_reconnect()
                return 0, []
            try:
                self._rejoin(store)
            except Exception as e:
                if not self._store_lost(e):
                    raise
                self._reconnect = None
                self._reconnecting(e)  # lost again before it was restored: once more
                return 0, []
        if self.handler._heartbeat_lock.locked():  # a keep-alive is under way: look next time
            return 0, []
        try:
            waiting = int(self.handler.num_nodes_waiting())  # syncs the state
            state = self._state()
            if state is None:
                return waiting, []
            known = set(state.participants) | set(state.wait_list) | set(state.redundancy_list)
            return waiting, sorted(str(n) for n in self._members - known)
        except Exception as e:
            if self._store_lost(e):
                self._reconnecting(e)
            else:
                logger.warning("could not read the rendezvous state: %s", e)
            return 0, []

    def announce_preemption(self, info: RoundInfo) -> None:
        """Tell the other nodes of round ``info`` that this one is preempted (``departure``)."""
        if info.group_world_size > 1:
            departure.announce(self.job_store, self.spec.rdzv_id, info.round)

    def peer_preempted(self, round_: int) -> bool:
        """Whether a node of round ``round_`` announced its preemption (store errors: no)."""
        if self._reconnect is not None:
            return False
        try:
            return bool(self.job_store.check([departure.key(self.spec.rdzv_id, round_)]))
        except Exception as e:
            if self._store_lost(e):
                self._reconnecting(e)
            return False

    def leave(self) -> None:
        """Leave the rendezvous without closing it (``departure``): the others go on. The
        round's worker store stays up (this node's workers may still be saving with it)."""
        departure.leave(self.handler, min(5.0, self.timeout_s))
        self._undo()

    def exit_barrier(self, info: RoundInfo) -> None:
        """Wait until every node of the round finished (so the store host leaves last)."""
        if info.group_world_size <= 1:
            return
        try:
            if self._reconnect is not None:
                self._wait_rejoin(RuntimeError("the store was lost while training"))
        except Exception as e:
            logger.warning("exit barrier of round %d failed: %s", info.round, e)
            return
        departure.exit_barrier(
            self.job_store, self.spec.rdzv_id, info.round, info.group_world_size, self.timeout_s
        )

    def close(self) -> None:
        """Close the rendezvous for every node (the job is over) and stop keep-alives."""
        self._worker_store = None
        try:
            self.handler.shutdown()
        except Exception as e:
            logger.warning("rendezvous shutdown failed: %s", e)
        self._undo()

    def _undo(self) -> None:
        if self._undo_polls is not None:
            self._undo_polls()
            self._undo_polls = None
