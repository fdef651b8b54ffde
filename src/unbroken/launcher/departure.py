"""A node leaving a multi-node job: at its end (the exit barrier), or on purpose (its
preemption told to the other nodes, and its exit from torch's rendezvous without closing it).

A SIGTERM to one agent of a multi-node job (its pod evicted: a node drained, spot capacity
reclaimed) is a preemption of the *job*: the agent writes a round-scoped key in the job store,
the other agents see it at their next membership check and pass the SIGTERM on to their own
workers, so every rank saves the step they agree on (``unbroken.checkpoint.preempt``). The
signalled node then leaves the rendezvous (torch's exit operation: it is no longer a
participant) instead of closing it (which would end the job for every node), and the others
start the next round without it at once: with a hot spare, or the replacement pod, restored
from the step just saved. When every pod is stopped (the job deleted), every agent is
signalled and every rank saves the same step as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


def key(rdzv_id: str, round_: int) -> str:
    """The job-store key a preempted node of round ``round_`` sets."""
    return f"unbroken/{rdzv_id}/preempted/{round_}"


def announce(store: Any, rdzv_id: str, round_: int) -> None:
    """Set the preemption key of round ``round_`` (best effort: an error is logged)."""
    try:
        store.add(key(rdzv_id, round_), 1)
    except Exception as e:
        logger.warning("could not tell the other nodes of the preemption: %s", e)


def leave(handler: Any, timeout_s: float) -> None:
    """Remove this node from the participants of torch's rendezvous (``handler``, a
    ``DynamicRendezvousHandler``) and stop its keep-alives, leaving the rendezvous open."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    try:
        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + timeout_s)
    except Exception as e:
        logger.warning("could not leave the rendezvous: %s", e)


def exit_barrier(store: Any, rdzv_id: str, round_: int, nodes: int, timeout_s: float) -> None:
    """Wait until the ``nodes`` nodes of round ``round_`` finished (so the store host leaves
    last), up to ``timeout_s``; a store error or the timeout is logged."""
    barrier = f"unbroken/{rdzv_id}/exit/{round_}"
    deadline = time.monotonic() + timeout_s
    try:
        done = int(store.add(barrier, 1))
        while done < nodes and time.monotonic() < deadline:
            time.sleep(0.05)
            done = int(store.add(barrier, 0))
    except Exception as e:
        logger.warning("exit barrier of round %d failed: %s", round_, e)
        return
    if done < nodes:
        logger.warning(
            "exit barrier: only %d of %d nodes finished within %.0f s", done, nodes, timeout_s
        )
