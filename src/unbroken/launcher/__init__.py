"""unbroken-run: a torchrun-compatible launcher that restarts killed and hung workers in the job.

Owns the CLI (torchrun's flags plus ``--ft-*``), the agent state machine, the per-round
rendezvous and worker store, the warm process pool (zygote), the heartbeat monitor and its
worker-side client, and the launcher's error file. Builds on torch.distributed.elastic's c10d
rendezvous.

The worker-side client (``client``) imports nothing but the standard library and
``unbroken.env``, so a training step can call it cheaply; importing this package does not
import torch. ``--ft-metrics-port`` serves the dashboard's Prometheus exporter (imported only
then), a multi-node job's agent runs the peer memory service of
``unbroken.checkpoint.tiers.peers``, and ``--ft-node-checks`` runs checks of ``unbroken.doctor``
(imported only then). Imports of ours: ``unbroken.errors``, ``unbroken.version``,
``unbroken.env``, ``unbroken.log``, ``unbroken.ledger``, ``unbroken.checkpoint.tiers.peers``,
``unbroken.dashboard.metrics``, ``unbroken.doctor``.
"""

from unbroken.launcher.client import heartbeat

__all__ = ["heartbeat"]
