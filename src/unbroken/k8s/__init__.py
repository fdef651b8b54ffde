"""Kubernetes: the manifests a user applies, their validation, the rendezvous store's process,
and an emulated cluster (``k8s.emulate``) that runs those manifests on one machine.

- ``spec``: ``DeploySpec``, what a user says about a job (flags or a small YAML file);
- ``render``: the spec as an Indexed Job + headless Service, a JobSet, or a Kubeflow Trainer
  TrainJob + runtime, plus the rendezvous store (Deployment + Service) and the checkpoint
  volume claim;
- ``eks``: the opt-in EKS pieces (EFA, placement in one zone, FSx for Lustre checkpoints);
- ``validate``: Kubernetes' schemas (kubernetes-validate, strict, pinned version), the JobSet
  and Trainer CRDs' schemas (committed under ``schemas/``) and the semantic checks schemas
  cannot make (``checks``; ``trainer``: the JobSet Trainer makes of a TrainJob);
- ``store``: the rendezvous store process the store pod runs (``unbroken k8s store``).

Importing it does not import torch. Imports of ours: ``unbroken.launcher`` (its flags and exit
codes, which the manifests must agree with), ``unbroken.ports`` (the emulated cluster's ports).
"""
