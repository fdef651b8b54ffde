"""Kubernetes: the manifests a user applies, their validation, the rendezvous store's process,
and an emulated cluster (``k8s.emulate``) that runs those manifests on one machine.

- ``spec``: ``DeploySpec``, what a user says about a job (flags or a small YAML file);
- ``render``: the spec as an Indexed Job + headless Service, or a JobSet, plus the rendezvous
  store (Deployment + Service) and the checkpoint volume claim;
- ``validate``: Kubernetes' schemas (kubernetes-validate, strict, pinned version), the JobSet
  CRD's schema (committed under ``schemas/``) and the semantic checks schemas cannot make;
- ``store``: the rendezvous store process the store pod runs (``unbroken k8s store``).

Importing it does not import torch. Imports of ours: ``unbroken.launcher`` (its flags and exit
codes, which the manifests must agree with).
"""
