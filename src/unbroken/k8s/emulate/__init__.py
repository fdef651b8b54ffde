"""An emulated Kubernetes on one machine: it runs rendered manifests, and says it is an emulation.

- ``net``: pods as network namespaces with their own address, hostname and PID namespace, DNS
  as per-pod hosts files (root); or, anywhere, as process trees on loopback addresses;
- ``dns``: the names the cluster DNS gives (headless and ClusterIP Services), as hosts files or,
  on loopback, written into the containers' arguments;
- ``pod``: one pod, its container's process and how it ends (deleted, or its node lost);
- ``workloads``: the controllers' semantics: an Indexed Job (``podFailurePolicy``,
  ``backoffLimitPerIndex``, ``maxFailedIndexes``, ``backoffLimit``, replacement pods with new
  addresses after a delay), a JobSet (``failurePolicy``: rules, ``maxRestarts``, recreate
  everything), a Deployment (one pod, replaced whenever it ends);
- ``link``: a degraded link between pods (every packet delayed, some dropped), emulated in
  user space through TUN devices, since this kernel has no ``netem``;
- ``cluster``: ``Cluster`` applies manifests, runs the controllers' loop, loses nodes and
  degrades links on request, and records what happened (``history``); ``config``: how it
  behaves (``EmulationConfig``).

Used by the multi-node tests, ``unbroken bench k8s`` and the baseline of ``unbroken bench
recovery`` (Kubernetes alone). It is not Kubernetes: no scheduler, no kubelet, no API server;
what it emulates is listed above and in each module.
"""

from unbroken.k8s.emulate.cluster import Cluster
from unbroken.k8s.emulate.config import EmulationConfig

__all__ = ["Cluster", "EmulationConfig"]
