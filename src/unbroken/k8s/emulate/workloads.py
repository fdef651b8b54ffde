"""The controllers' semantics, as the emulated cluster applies them.

``JobRun`` (an Indexed Job; also a JobSet's child):
- one pod per completion index, hostname ``<prefix>-<index>``, all at once;
- a pod that exits 0 completes its index; the Job completes when every index has;
- a pod that fails is judged by ``podFailurePolicy`` (rules in order; ``onExitCodes`` with
  In/NotIn and an optional container name, ``onPodConditions``): FailJob fails the Job
  (reason ``PodFailurePolicy``) and deletes its other pods; Ignore replaces the pod without
  counting; FailIndex fails the index; Count (or no rule) counts a failure of the index;
- with ``backoffLimitPerIndex``, an index with more counted failures than that fails; more
  failed indexes than ``maxFailedIndexes`` fail the Job (``MaxFailedIndexesExceeded``);
  without it, more failures in all than ``backoffLimit`` (default 6) fail the Job
  (``BackoffLimitExceeded``);
- a replaced pod is created again, same hostname, new address, after the Job controller's
  back-off (``failure_backoff_s`` doubled per counted failure of the index, capped; none for
  an ignored one) and then the pod start delay (``pod_start_delay_s``): the old pod is gone
  first (``podReplacementPolicy: Failed``).

``JobSetRun``: its replicated Jobs as ``JobRun`` children (pod hostnames
``<jobset>-<rjob>-<j>-<index>``, subdomain ``network.subdomain`` or the JobSet's name, served by
a headless Service the JobSet owns). A failed child Job is judged by ``failurePolicy.rules``
(first match on ``onJobFailureReasons``; none: RestartJobSet): FailJobSet ends it; a restart
deletes every pod and, once they are gone, recreates every child Job (annotation
``jobset.sigs.k8s.io/restart-attempt`` counts up), at most ``maxRestarts`` times.

``DeploymentRun``: ``replicas`` pods (named ``<name>-<n>``), each replaced after the start delay
whenever it ends, until the cluster closes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from unbroken.k8s.emulate.pod import Pod

if TYPE_CHECKING:
    from unbroken.k8s.emulate.cluster import Cluster

logger = logging.getLogger(__name__)

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
RESTART_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


def _rule_matches(rule: dict[str, Any], pod: Pod, container: str) -> bool:
    codes = rule.get("onExitCodes")
    if codes is not None:
        if codes.get("containerName") not in (None, container):
            return False
        values = {int(v) for v in codes.get("values") or []}
        inside = pod.exit_code in values
        return inside if codes.get("operator", "In") == "In" else not inside
    conditions = rule.get("onPodConditions") or []
    return any(c.get("type") in pod.conditions for c in conditions)


class JobRun:
    """One Indexed Job while it runs (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        name: str,
        spec: dict[str, Any],
        hostname_prefix: str,
        subdomain: str | None,
        namespace: str,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        on_done: Any = None,
    ) -> None:
        if spec.get("completionMode") != "Indexed":
            raise NotImplementedError(f"Job {name}: the emulation runs Indexed Jobs only")
        self.cluster = cluster
        self.name = name
        self.spec = spec
        self.completions = int(spec["completions"])
        self.per_index = spec.get("backoffLimitPerIndex")
        self.max_failed_indexes = spec.get("maxFailedIndexes")
        self.backoff_limit = spec.get("backoffLimit", 6)
        self.rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
        self.template = spec["template"]
        self.hostname_prefix = hostname_prefix
        self.subdomain = (
            subdomain if subdomain is not None else self.template["spec"].get("subdomain")
        )
        self.namespace = namespace
        self.labels = {**(self.template.get("metadata", {}).get("labels") or {}), **(labels or {})}
        self.annotations = dict(annotations or {})
        self.on_done = on_done
        self.failures = [0] * self.completions
        self.total_failures = 0
        self.succeeded: set[int] = set()
        self.failed_indexes: set[int] = set()
        self.pods: list[Pod] = []
        self.status: str | None = None
        """None while running; "Complete" or "Failed"."""
        self.reason: str | None = None

    @property
    def container(self) -> str:
        return str(self.template["spec"]["containers"][0]["name"])

    def start(self) -> None:
        for i in range(self.completions):
            self._create(i, backoff_s=0.0)

    def _create(self, index: int, *, backoff_s: float) -> None:
        def create() -> None:
            if self.status is None:
                pod = self.cluster.create_pod(
                    owner=f"Job/{self.name}",
                    name=f"{self.name}-{index}-{len(self.pods)}",
                    hostname=f"{self.hostname_prefix}-{index}",
                    subdomain=self.subdomain,
                    namespace=self.namespace,
                    template=self.template,
                    labels=self.labels,
                    annotations={**self.annotations, INDEX_ANNOTATION: str(index)},
                    index=index,
                    on_end=self._ended,
                )
                self.pods.append(pod)

        self.cluster.schedule(backoff_s, create)

    def _backoff(self, failures: int) -> float:
        cfg = self.cluster.cfg
        return min(cfg.max_backoff_s, cfg.failure_backoff_s * 2 ** max(0, failures - 1))

    def _ended(self, pod: Pod) -> None:
        if self.status is not None:
            return
        i = pod.index
        assert i is not None
        if pod.exit_code == 0:
            self.succeeded.add(i)
            self._maybe_done()
            return
        rule = next((r for r in self.rules if _rule_matches(r, pod, self.container)), None)
        action = rule["action"] if rule else "Count"
        self.cluster.record(
            "pod_failed",
            pod=pod.name,
            index=i,
            exit_code=pod.exit_code,
            action=action,
            conditions=sorted(pod.conditions),
            owner=f"Job/{self.name}",
        )
        if action == "FailJob":
            self.fail("PodFailurePolicy")
        elif action == "Ignore":
            self._create(i, backoff_s=0.0)
        elif action == "FailIndex":
            self._index_failed(i)
        else:
            self.total_failures += 1
            self.failures[i] += 1
            if self.per_index is not None:
                if self.failures[i] > int(self.per_index):
                    self._index_failed(i)
                else:
                    self._create(i, backoff_s=self._backoff(self.failures[i]))
            elif self.total_failures > int(self.backoff_limit):
                self.fail("BackoffLimitExceeded")
            else:
                self._create(i, backoff_s=self._backoff(self.total_failures))

    def _index_failed(self, index: int) -> None:
        self.failed_indexes.add(index)
        if self.max_failed_indexes is not None and len(self.failed_indexes) > int(
            self.max_failed_indexes
        ):
            self.fail("MaxFailedIndexesExceeded")
        else:
            self._maybe_done()

    def _maybe_done(self) -> None:
        if len(self.succeeded) + len(self.failed_indexes) < self.completions:
            return
        if self.failed_indexes:
            self.fail("FailedIndexes")
        else:
            self.status = "Complete"
            self.cluster.record("job_complete", job=self.name)
            if self.on_done is not None:
                self.on_done(self)

    def fail(self, reason: str) -> None:
        """The Job failed: its running pods are deleted (graceful)."""
        if self.status is not None:
            return
        self.status, self.reason = "Failed", reason
        self.cluster.record("job_failed", job=self.name, reason=reason)
        self.delete()
        if self.on_done is not None:
            self.on_done(self)

    def delete(self) -> None:
        """Delete every running pod of the Job (SIGTERM, SIGKILL after the grace period)."""
        grace = float(self.template["spec"].get("terminationGracePeriodSeconds", 30))
        for pod in self.pods:
            self.cluster.terminate(pod, grace)

    @property
    def settled(self) -> bool:
        """Done, and none of its pods still runs."""
        return self.status is not None and not any(p.running for p in self.pods)


class JobSetRun:
    """One JobSet while it runs (see the module docstring)."""

    def __init__(self, cluster: Cluster, doc: dict[str, Any]) -> None:
        self.cluster = cluster
        self.doc = doc
        self.name = doc["metadata"]["name"]
        self.namespace = doc["metadata"].get("namespace", "default")
        spec = doc["spec"]
        policy = spec.get("failurePolicy") or {}
        self.max_restarts = int(policy.get("maxRestarts", 0))
        self.rules = policy.get("rules") or []
        self.subdomain = (spec.get("network") or {}).get("subdomain") or self.name
        self.restarts = 0
        self.children: list[JobRun] = []
        self.status: str | None = None
        self.reason: str | None = None
        self._restarting = False
        cluster.add_headless_service(self.subdomain, {JOBSET_LABEL: self.name}, self.namespace)

    def start(self) -> None:
        self.children = []
        for rjob in self.doc["spec"]["replicatedJobs"]:
            for j in range(int(rjob.get("replicas", 1))):
                child = JobRun(
                    self.cluster,
                    name=f"{self.name}-{rjob['name']}-{j}",
                    spec=rjob["template"]["spec"],
                    hostname_prefix=f"{self.name}-{rjob['name']}-{j}",
                    subdomain=self.subdomain,
                    namespace=self.namespace,
                    labels={JOBSET_LABEL: self.name},
                    annotations={RESTART_ANNOTATION: str(self.restarts)},
                    on_done=self._child_done,
                )
                self.children.append(child)
        for child in self.children:
            child.start()

    def _child_done(self, child: JobRun) -> None:
        if self.status is not None or self._restarting:
            return
        if child.status == "Complete":
            if all(c.status == "Complete" for c in self.children):
                self.status = "Complete"
                self.cluster.record("jobset_complete", jobset=self.name)
            return
        rule = next(
            (
                r
                for r in self.rules
                if not r.get("onJobFailureReasons") or child.reason in r["onJobFailureReasons"]
            ),
            None,
        )
        action = rule["action"] if rule else "RestartJobSet"
        if action == "FailJobSet" or (
            action == "RestartJobSet" and self.restarts >= self.max_restarts
        ):
            self.status, self.reason = "Failed", child.reason
            self.cluster.record(
                "jobset_failed", jobset=self.name, reason=child.reason, action=action
            )
            for c in self.children:
                c.fail("JobSetFailed")
            return
        self._restarting = True
        self.cluster.record(
            "jobset_restart", jobset=self.name, restart=self.restarts + 1, reason=child.reason
        )
        for c in self.children:
            c.fail("JobSetRestart")
            c.delete()
        self.cluster.when(lambda: all(c.settled for c in self.children), self._recreate)

    def _recreate(self) -> None:
        self.restarts += 1
        self._restarting = False
        self.start()

    @property
    def settled(self) -> bool:
        return self.status is not None and all(c.settled for c in self.children)


class DeploymentRun:
    """A Deployment's pods, each replaced whenever it ends (see the module docstring)."""

    def __init__(self, cluster: Cluster, doc: dict[str, Any]) -> None:
        self.cluster = cluster
        self.name = doc["metadata"]["name"]
        self.namespace = doc["metadata"].get("namespace", "default")
        self.replicas = int(doc["spec"].get("replicas", 1))
        self.template = doc["spec"]["template"]
        self.pods: list[Pod] = []

    def start(self) -> None:
        for _ in range(self.replicas):
            self._create()

    def _create(self) -> None:
        def create() -> None:
            pod = self.cluster.create_pod(
                owner=f"Deployment/{self.name}",
                name=f"{self.name}-{len(self.pods)}",
                hostname=f"{self.name}-{len(self.pods)}",
                subdomain=None,
                namespace=self.namespace,
                template=self.template,
                labels=dict(self.template.get("metadata", {}).get("labels") or {}),
                annotations={},
                index=None,
                on_end=lambda pod: self._create() if not self.cluster.closing else None,
            )
            self.pods.append(pod)

        self.cluster.schedule(0.0, create)
