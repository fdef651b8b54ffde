"""A save's background part: the rank's writer process writes, fsyncs, checksums and commits.

The save flow, from its entry in ``Checkpointer.save`` (``checkpointer``) to ``step-N/``:

1. ``Checkpointer.maybe_save``: a durable save is due every ``every_steps`` steps (or when
   ``schedule.adaptive`` says so); else a memory-only ``snapshot`` when one is due, else a
   ``note`` of the step (``staging.rescue``).
2. ``Checkpointer.save`` adds the random generators to the state (``state.extras``); when the
   last save is still persisting it skips this one or waits (``inflight``).
3. ``inflight.Inflight.start_writer``: the rank's writer process, started once (``client``:
   forked from the trainer, or from the small copy of it ``forkserver`` keeps, or run as
   ``python -m unbroken.checkpoint.persisting.writer``); the two talk over a Unix socket
   (``protocol``).
4. ``state.resolve.resolve_for_save``: the state as DCP write items, reused from the last save
   where nothing changed (``state.savecache``, ``state.reuse``).
5. ``staging.staging.Staging``: a region of the shared arena (``staging.arena``, one snapshot
   per rank the ranks agree to replace, or a ring: ``staging.memory``); a new layout or arena
   goes to the writer first; the tensors that may change before ``optimizer.step`` are copied
   at once, the rest on the stager thread (``overlap``); the region is then sealed for the
   memory tier (and, in a multi-node job, sent to the next node by ``tiers.peers``). The
   trainer's blocking time ends here.
6. ``inflight.Inflight.send``: the "save" message, once the copy is done.
7. ``writer.Writer``: this rank's DCP data file in ``step-N.partial/`` (named by ``layout``),
   its CRC-32 computed on the way ("written": the arena's region is free again), fsynced, then
   its done record; ``hooks`` may slow or stop it (fault injection, tests).
8. ``commit.publish``, in rank 0's writer: every rank's done record merged into DCP's
   ``.metadata``, the manifest, the rename to ``step-N/``, ``COMMITTED``, then retention
   (``layout.retain``).
9. ``inflight``: the writer's replies, heard on the reader thread of ``client``, recorded in
   the ledger (``ckpt_persist``, ``ckpt_commit``); a failure, a timeout or the writer's death
   is raised by the Checkpointer's next call.

The writer process imports little (``writer.preload``): persisting imports neither the state,
the tiers nor the restore, and of staging only ``arena``, whose slots the layout message
carries. Imports of ours: ``unbroken.log``, ``unbroken.ledger``, ``unbroken.mask``,
``unbroken.checkpoint.config``, ``unbroken.checkpoint.layout``,
``unbroken.checkpoint.staging.arena``.
"""
