"""When a durable save is due: every ``every_steps`` steps, or at an interval that adapts; and
when a memory snapshot is, between them (``snapshots``: at the interval a share of step time
allows).

``CheckpointConfig.due`` answers for a fixed interval. With ``CheckpointConfig.adaptive``,
``adaptive.AdaptiveSaves`` (driven by ``Checkpointer.maybe_save``) asks the Young/Daly policy
of ``interval``, fed with each save's blocking and persist times (the ``CheckpointStats`` of
``persisting.inflight``) and the job's failures (``node``).

It decides steps only, and imports no phase of a save or a restore but those statistics.
Imports of ours: ``unbroken.ledger``, ``unbroken.checkpoint.config``,
``unbroken.checkpoint.node``, ``unbroken.checkpoint.persisting.inflight``.
"""
