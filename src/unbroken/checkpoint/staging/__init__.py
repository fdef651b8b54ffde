"""A save's blocking part: the copy of a state into shared memory, and the snapshot it leaves.

``staging.Staging`` copies each save's tensors into a region of the arena (``arena``: a memfd
shared with the writer process and, under ``unbroken-run``, held by the node agent), laid out
as a ring of snapshots (``memory``), and seals the region so that the memory tier can restore
it. ``rescue`` snapshots a step a fault interrupted, from the live state as the process unwinds.

``memory`` (the ring's format and its read-back) lives here rather than in ``tiers``: the copy
writes every byte of it, and ``tiers`` builds a ``Staging`` on the ring it adopts, so a ring
in ``tiers`` would make the two packages import each other.

Staging imports neither persisting (the writer is reached through the ``WriterLink`` a
Checkpointer hands in, and reads what staging left in the arena), nor the tiers, nor the
restore. Imports of ours: ``unbroken.checkpoint.layout`` (the restricted unpickler a ring's
metadata is read with), ``unbroken.checkpoint.state``.
"""
