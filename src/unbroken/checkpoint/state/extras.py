"""What a Checkpointer adds to the state it is given, and keeps of it.

- The process's random number generators (``CheckpointConfig.rng``, on by default): every
  save, snapshot and note holds them under ``RNG_KEY`` (per rank), and a restore sets them
  back, so a resumed run draws what the uninterrupted one would have (its batches, dropout,
  sampling). A state that already holds ``RNG_KEY`` (a rescued note: its generators as they
  were at the note) keeps its own.
- The last state given, for ``final_digest`` (``digest``): ``close`` records a ``final_state``
  ledger record with this rank's digest of it (the script's state, the generators left out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unbroken.checkpoint.config import CheckpointConfig
from unbroken.checkpoint.state.digest import local_digest
from unbroken.checkpoint.state.resolve import PerRank
from unbroken.checkpoint.state.rng import NotedRng, capture_rng_state, restore_rng_state
from unbroken.ledger import Recorder
from unbroken.ledger import events as ev

RNG_KEY = "unbroken_rng"
"""Where the generators go in a checkpoint (``<RNG_KEY>.rank<R>``)."""


class RngState:
    """This process's generators as a Stateful."""

    def __init__(self) -> None:
        self._noted = NotedRng()

    def note_state(self) -> dict[str, Any]:
        """The state for a note (``rescue``): kept without a copy, the same object while no
        generator moved (``rng.NotedRng``)."""
        return self._noted.capture()

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)


class StateExtras:
    """A Checkpointer's additions to the states it is given (see the module docstring)."""

    def __init__(self, config: CheckpointConfig) -> None:
        self._rng = PerRank(RngState()) if config.rng else None
        self._keep = config.final_digest
        self.last: Mapping[str, Any] | None = None
        self._made: tuple[Mapping[str, Any], dict[str, Any]] | None = None

    def full(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` with the generators added (the same mapping again for the same state)."""
        if self._keep:
            self.last = state
        if self._rng is None or RNG_KEY in state:
            return state
        made = self._made
        if made is not None and made[0] is state and all(k in made[1] for k in state):
            return made[1]
        full = {**state, RNG_KEY: self._rng}
        self._made = (state, full)
        return full

    def record_digest(self, ledger: Recorder, step: int | None) -> None:
        """With ``final_digest``: the ``final_state`` record of the last state given."""
        if self._keep and self.last is not None:
            # The script's own state: the generators also move with whatever else the process
            # runs (a launcher's worker draws no number that in-process restart does).
            ledger.emit(ev.FINAL_STATE, step=step, digest=local_digest(self.last))
