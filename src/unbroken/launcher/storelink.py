"""The agent's connection to a job store it does not host (the rendezvous store pod): made to
fail rather than hang when the store goes silent, made again when it is lost, and the new store
given back what the old one held.

``unbroken.launcher.rendezvous`` decides when (its docstring: "The store pod is no single point
of failure"); this module does the connecting and the restoring. Imports of ours:
``unbroken.launcher.listen``.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from unbroken.launcher import listen

logger = logging.getLogger(__name__)


def connection_broke(e: BaseException, dist: Any) -> bool:
    """``e``, or an exception it was raised from, says a store connection broke."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, (RendezvousConnectionError, dist.DistNetworkError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def restore(handler: Any, store: Any, run_id: str, last_round: int | None) -> tuple[int, int]:
    """Make ``store`` (a new connection to the endpoint) ``handler``'s store and restore in it
    what this agent knows: torch's rendezvous state (the first agent back writes its copy, the
    others adopt that one) and the round counter (past ``last_round``).

    Args:
        handler: torch's ``DynamicRendezvousHandler`` of this agent.
        store: The new connection.
        run_id: The rendezvous id.
        last_round: The newest round this agent saw (None: none).

    Returns:
        (participants, nodes waiting) in the state now in the store.
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    backend = C10dRendezvousBackend(store, run_id)
    with handler._heartbeat_lock:
        holder = handler._state_holder
        holder._backend = backend
        holder._token = None  # the store is new: expect no state, write ours
        # No node could send a keep-alive while the store was away: count every node of our
        # copy alive from now (a dead one expires after the usual keep-alives).
        now = datetime.now(timezone.utc)
        for node in holder.state.last_heartbeats:
            holder.state.last_heartbeats[node] = now
        holder.mark_dirty()
        holder.sync()  # the first agent back writes its copy; the others adopt that one
        handler._store = store
        state = holder.state
    if last_round is not None:
        key, want = f"unbroken/{run_id}/round", last_round + 1
        current = int(store.add(key, 0))
        while current < want:
            current = int(store.compare_set(key, str(current), str(want)))
    return len(state.participants), len(state.wait_list) + len(state.redundancy_list)


CONNECT_S = 0.25


class Reconnect:
    """Connect to the job store's endpoint in a thread, retrying until it answers or
    ``timeout_s`` passed: an agent keeps training while the store's pod is replaced."""

    def __init__(
        self, host: str, port: int, dist: Any, timeout_s: float, read: timedelta, silent_s: float
    ) -> None:
        self._host, self._port = host, port
        self._silent_s = silent_s
        self._dist = dist
        self._timeout = read
        self._deadline = time.monotonic() + timeout_s
        self._done = threading.Event()
        self._store: Any = None
        threading.Thread(target=self._run, name="unbroken-rdzv-reconnect", daemon=True).start()

    def _run(self) -> None:
        try:
            while time.monotonic() < self._deadline:
                try:
                    # A short connect timeout: torch backs off between its own attempts, we
                    # retry at once (a replacement pod answers the moment it listens).
                    before = listen.open_fds()
                    store = self._dist.TCPStore(
                        self._host,
                        self._port,
                        is_master=False,
                        multi_tenant=True,
                        timeout=timedelta(seconds=CONNECT_S),
                    )
                    listen.fail_when_silent(before, self._port, self._silent_s)
                    store.set_timeout(self._timeout)
                    self._store = store
                    return
                except Exception as e:  # noqa: BLE001 - not up yet: try again
                    logger.debug("rendezvous store not reachable yet: %s", e)
                    time.sleep(0.1)
        finally:
            self._done.set()

    def failed(self) -> bool:
        """Gave up: no connection within the timeout."""
        return self._done.is_set() and self._store is None

    def poll(self) -> Any:
        """The new connection once it is made, else ``None``."""
        return self._store if self._done.is_set() else None

    def wait(self, timeout_s: float) -> Any:
        """The new connection; ``None`` when none was made in time."""
        self._done.wait(timeout_s)
        return self._store
