"""The reference workload: the reference model, the deterministic resumable data, the reference
training script.

``model`` is a Llama-style decoder-only transformer in plain torch, ``data`` a seeded synthetic
Markov language with random-access samples and a world-size-independent resumable sampler,
``rng`` captures and restores every RNG a step touches, ``parallel`` wraps a model in FSDP2 or
DDP.

It is a user of unbroken like any training script: it reaches the launcher only through the
public API (``unbroken.heartbeat``), never its internals. Imports of ours: ``unbroken`` (the
public API), ``unbroken.errors``, ``unbroken.env``, ``unbroken.log``, ``unbroken.ledger``,
``unbroken.checkpoint``, ``unbroken.faults``, ``unbroken.restart``.
"""
