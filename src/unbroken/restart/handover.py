"""The node agent's handover of a worker to the next round: after another node is lost, this
process leaves ``fn`` and takes its rank in the next round in-process, instead of being stopped
and replaced by a new process that would start cold.

``unbroken-run`` gives each worker of a multi-node job a key prefix in the job store
(``UNBROKEN_HANDOVER``); the keys below it are this worker's, for this round:

- ``ready``: written here once the worker listens, so the agent knows it can be handed over
  (a script without in-process restart never writes it, and is stopped as before);
- ``hold``: written by the agent when a node of the round is lost; ``fn`` is interrupted as
  for a peer's fault (its process group's connections closed, so a collective waiting on the
  lost node fails at once), without a fault of its own: the agent records the loss. Written
  here (``release``) when the worker leaves the round otherwise, which ends the listening;
- ``next``: written by the agent once the next round has formed: the worker's environment in it
  (``{"env": {...}, "unset": [...]}``), or ``{"stop": why}`` when the agent could not hand the
  worker over (it then stops it).

``unbroken.job`` applies the new environment and runs ``fn`` again as a process of the new
round: its warm caches (imported modules, the sharding plans of its model's shapes) come along.

Imports of ours: ``unbroken.errors``, ``unbroken.env``, ``unbroken.ledger``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from unbroken.env import HANDOVER_HOLD as HOLD
from unbroken.env import HANDOVER_NEXT as NEXT
from unbroken.env import HANDOVER_READY as READY
from unbroken.env import RANK, RESTART_COUNT
from unbroken.errors import Preempted
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev

logger = logging.getLogger(__name__)

RELEASE = "release"
_FOREVER = timedelta(days=7)
_SLICE = timedelta(seconds=0.25)


class NewRound(Exception):  # noqa: N818 - a control-flow signal, as StopIteration
    """This worker was handed over to the next round: apply ``env`` (and unset ``unset``), then
    run ``fn`` again as a process of that round."""

    def __init__(self, env: Mapping[str, str], unset: tuple[str, ...] = ()) -> None:
        super().__init__(f"handed over to round {env.get('UNBROKEN_ROUND', '?')}")
        self.env = dict(env)
        self.unset = unset

    def apply(self, ledger: Recorder) -> None:
        """This process becomes a worker of the round: its environment changed, its ledger
        going on under its rank and attempt there (no second ``process_start``: the process
        did not start again)."""
        for name in self.unset:
            os.environ.pop(name, None)
        os.environ.update(self.env)
        rank, attempt = int(self.env.get(RANK, "0")), int(self.env.get(RESTART_COUNT, "0"))
        ledger.set_context(rank=rank, attempt=attempt, iteration=0)
        ledger.emit(ev.RESTART_END, layer="launcher", handover=True)
        logger.info("handed over to round %d as rank %d", attempt, rank)


def _leaving(why: str) -> Preempted:
    """Leave instead of going on (the agent stops this worker): nothing to save or wait for."""
    stop = Preempted(why)
    stop.unwound = True
    return stop


def parse_next(raw: bytes) -> NewRound | Preempted:
    """The agent's ``next`` value as what the worker does with it.

    Args:
        raw: The value.

    Returns:
        ``NewRound`` to go on in the next round, ``Preempted`` to leave (the agent stops us).

    Raises:
        ValueError: When the value is not one the agent writes.
    """
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"a handover is a JSON object, got {raw[:80]!r}")
    if "stop" in value:
        return _leaving(f"not handed over to the next round: {value['stop']}")
    env, unset = value.get("env"), value.get("unset", [])
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError(f"a handover's env maps names to strings, got {raw[:80]!r}")
    if not isinstance(unset, list) or not all(isinstance(k, str) for k in unset):
        raise ValueError(f"a handover's unset lists names, got {raw[:80]!r}")
    return NewRound(env, tuple(unset))


class Handover:
    """Listens for the agent's ``hold`` on a connection of its own (one thread, blocked in the
    store: no polling), and waits for its ``next``."""

    def __init__(
        self, connect: Callable[[], Any], prefix: str, *, on_pause: Callable[[str], None]
    ) -> None:
        """``connect()``: a new store connection (the listener blocks on one of its own);
        ``on_pause(why)`` is called from the listening thread when the agent pauses us."""
        self.client = connect()
        self._listener = connect()
        self.prefix = prefix
        self.on_pause = on_pause
        self.paused: str | None = None
        """Why the agent paused this worker (None: it has not)."""
        self._released = False
        self.client.set(prefix + READY, "1")
        self._thread = threading.Thread(target=self._listen, name="unbroken-handover", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        key = self.prefix + HOLD
        try:
            self._listener.wait([key], _FOREVER)
            raw = self._listener.get(key)
        except Exception as e:  # noqa: BLE001 - the agent then stops this worker as before
            if not self._released:
                logger.warning("the handover listener lost the store: %s", e)
            return
        if raw == RELEASE.encode():
            return
        try:
            why = str(json.loads(raw).get("why", "a node was lost"))
        except (ValueError, AttributeError):
            why = "a node was lost"
        self.paused = why
        self.on_pause(why)

    def leave(
        self, ledger: Recorder, *, round_: int, stopping: Callable[[], bool]
    ) -> NewRound | Preempted:
        """After a pause, once ``fn`` and its process group are gone: record the restart's
        begin (the agent's round, so that the report counts one restart with the agent's) and
        wait for the next round (``next_round``)."""
        ledger.emit(
            ev.RESTART_BEGIN, layer="launcher", cause="handover", round=round_, why=self.paused
        )
        logger.info("handed over to the next round (%s)", self.paused)
        return self.next_round(stopping=stopping)

    def next_round(self, *, stopping: Callable[[], bool]) -> NewRound | Preempted:
        """After a pause, once ``fn`` has left: wait for the agent's ``next``.

        Args:
            stopping: Asked between waits: True leaves with ``Preempted``.

        Returns:
            What ``parse_next`` makes of the agent's answer.
        """
        key = self.prefix + NEXT
        while True:
            if stopping():
                return _leaving("asked to stop while waiting for the next round")
            try:
                self.client.wait([key], _SLICE)
            except Exception:  # noqa: BLE001 - a timeout, or the store lost (asked below)
                try:
                    if not self.client.check([key]):
                        continue
                except Exception as e:  # noqa: BLE001 - the agent stops this worker
                    return _leaving(f"lost the store while waiting for the next round: {e}")
            try:
                return parse_next(self.client.get(key))
            except ValueError as e:
                return _leaving(f"a malformed handover: {e}")

    def close(self) -> None:
        """Stop listening and close both connections (idempotent)."""
        if self._released:
            return
        self._released = True
        if self.paused is None:
            try:
                self.client.set(self.prefix + HOLD, RELEASE)
            except Exception as e:  # noqa: BLE001 - the listener ends with the store's loss
                logger.warning("could not release the handover listener: %s", e)
        self._thread.join(5.0)
        if self._thread.is_alive():
            logger.warning("the handover listener did not stop")
            return
        self.client = self._listener = None
