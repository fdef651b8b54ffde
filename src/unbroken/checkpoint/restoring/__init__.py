"""The restore from disk (``restore``), and where the restore flow as a whole is told.

The restore flow, from its entry in ``Checkpointer.restore`` (``checkpointer``):

1. When it was built, the Checkpointer adopted the arena a tier held, if any
   (``tiers.tiers.staging_for``: this process's, the node keeper's through ``tiers.keeper``,
   or a peer's through ``tiers.peers``); one from the keeper is warmed and checked on a thread
   meanwhile (``tiers.tiers.Warm``).
2. ``Checkpointer.restore`` adds the random generators to the state (``state.extras``).
3. Memory first, ``tiers.tiers.restore_recorded``: every rank's held steps gathered
   (``staging.memory.read``), the newest matched with the live state
   (``staging.memory.prepare``: the template of ``state.resolve.template_for_load``, a fresh
   optimizer's state from ``state.freshopt``), its digests checked when another process wrote
   it (``staging.memory.verify``), agreed by all ranks, copied in
   (``staging.memory.Pending.apply``); a step that fails anywhere gives way to the next older
   one every rank holds.
4. Else disk, ``restore.restore_recorded``: rank 0 removes the leftovers of interrupted saves
   and lists the committed steps (``layout``); each rank checks its share of the files against
   the manifest, and a checkpoint that fails is moved aside and the next older one tried;
   its owner and tensor shapes are checked against the live state, then
   ``torch.distributed.checkpoint.load`` reads and reshards into the template of
   ``state.resolve.template_for_load`` and ``state.resolve.apply_loaded`` hands it to the live
   objects.
5. Either records a ``ckpt_load`` interval in the ledger, with its tier (memory, peer, disk).

The restore from disk reads what persisting wrote through ``layout`` only: it imports neither
staging nor persisting, nor the tiers. Imports of ours: ``unbroken.ledger``,
``unbroken.checkpoint.config``, ``unbroken.checkpoint.layout``, ``unbroken.checkpoint.state``.
"""
