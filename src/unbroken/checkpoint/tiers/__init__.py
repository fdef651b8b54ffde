"""The memory tiers: snapshots that outlive their process and their node, and restores from them.

A Checkpointer starts on the arena ``tiers.staging_for`` adopts: its own process's, kept by a
failed iteration (``staging.memory``), else the one the node agent's keeper held for its rank
(``keeper``), else one a peer node's service holds (``peers``: every node replicates each
sealed snapshot to the next). A restore tries memory first (``tiers.restore_recorded``: the
newest step every rank holds whose copies pass their checks), then disk (``restoring``).

The tiers build on staging (the arena, its ring, a ``Staging`` on the adopted arena) and on
the state (a fresh optimizer's state); they import neither persisting nor restoring.
Imports of ours: ``unbroken.ledger``, ``unbroken.checkpoint.config``,
``unbroken.checkpoint.layout``, ``unbroken.checkpoint.staging``, ``unbroken.checkpoint.state``.
"""
