"""Whether a PersistentVolumeClaim of a file binds to what the file gives it: the
PersistentVolume it names (static provisioning, FSx for Lustre's included) or the StorageClass it
names (dynamic provisioning). A claim that names neither is left to the cluster."""

from __future__ import annotations

from typing import Any

from unbroken.k8s import eks
from unbroken.k8s.validate import Problem


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def problems(docs: list[Any], pvc: dict[str, Any]) -> list[Problem]:
    """Why a claim of this file would not bind to the PersistentVolume or StorageClass of this
    file it names (nothing when it names none of them)."""
    obj = f"PersistentVolumeClaim/{_get(pvc, 'metadata', 'name')}"
    spec = pvc.get("spec") or {}
    volume, klass = spec.get("volumeName"), spec.get("storageClassName")
    pv = next(
        (
            d
            for d in docs
            if isinstance(d, dict)
            and d.get("kind") == "PersistentVolume"
            and _get(d, "metadata", "name") == volume
        ),
        None,
    )
    out: list[Problem] = []
    if volume is not None and pv is not None:
        pv_class = _get(pv, "spec", "storageClassName") or ""
        if klass != pv_class:
            out.append(
                Problem(
                    obj,
                    "spec.storageClassName",
                    f"{klass!r} but PersistentVolume/{volume} has class {pv_class!r}: the claim "
                    'never binds (a claim without a class gets the default one; give "")',
                )
            )
        if "ReadWriteMany" not in (_get(pv, "spec", "accessModes") or []):
            out.append(
                Problem(f"PersistentVolume/{volume}", "spec.accessModes", "lacks ReadWriteMany")
            )
        ref = _get(pv, "spec", "claimRef") or {}
        want = (_get(pvc, "metadata", "namespace") or "default", _get(pvc, "metadata", "name"))
        if ref and (ref.get("namespace", "default"), ref.get("name")) != want:
            out.append(
                Problem(
                    f"PersistentVolume/{volume}",
                    "spec.claimRef",
                    f"reserved for {ref.get('namespace')}/{ref.get('name')}, not {want[0]}/{want[1]}",
                )
            )
        csi = _get(pv, "spec", "csi") or {}
        attrs = csi.get("volumeAttributes") or {}
        if csi.get("driver") == eks.FSX_DRIVER and not (
            attrs.get("dnsname") and attrs.get("mountname")
        ):
            out.append(
                Problem(
                    f"PersistentVolume/{volume}",
                    "spec.csi.volumeAttributes",
                    "an FSx for Lustre volume needs dnsname and mountname",
                )
            )
    sc = next(
        (
            d
            for d in docs
            if isinstance(d, dict)
            and d.get("kind") == "StorageClass"
            and _get(d, "metadata", "name") == klass
        ),
        None,
    )
    if sc is not None and sc.get("provisioner") == eks.FSX_DRIVER:
        params = sc.get("parameters") or {}
        missing = [k for k in ("subnetId", "securityGroupIds") if not params.get(k)]
        if missing:
            out.append(
                Problem(
                    f"StorageClass/{klass}",
                    "parameters",
                    f"{missing} missing: the FSx CSI driver cannot create the file system",
                )
            )
    return out
