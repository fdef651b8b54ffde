"""What a checkpoint holds: a training state in DCP's terms, in both directions.

A state (a dict of modules, optimizers, ``Stateful`` objects, tensors, ``PerRank`` values)
becomes write items for a save and a load plan for a restore (``resolve``). With it: what one
save keeps for the next (``savecache``: the cache a Checkpointer holds; ``reuse``: the model's
and optimizers' items, reused while they check out), the shortcuts around DCP's walks where a
model's keys need no renaming (``naming``) and for a fresh optimizer's state (``freshopt``),
and what a Checkpointer adds to the state it is given (``extras``: the random generators of
``rng``, and the digest of ``digest``).

The save (``staging``, ``persisting``) and the restore (``tiers``, ``restoring``) both build on
it, so it imports none of them. Imports of ours: ``unbroken.ledger``,
``unbroken.checkpoint.config``.
"""
