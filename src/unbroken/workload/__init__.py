"""The reference workload: the reference model, the deterministic resumable data, the reference
training script.

``model`` is a Llama-style decoder-only transformer in plain torch, ``data`` a seeded synthetic
Markov language with random-access samples and a world-size-independent resumable sampler,
``rng`` captures and restores every RNG a step touches, ``parallel`` wraps a model in FSDP2 or
DDP.

Of ours, this package imports only ``unbroken.ledger``, ``unbroken.faults`` and ``unbroken.env``.
"""
