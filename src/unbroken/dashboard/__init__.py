"""A live, read-only web view over run ledgers, its alerts, and the Prometheus exporter.

Owns ``unbroken dashboard`` (a page per run, an index with search over the knowledge base),
``/metrics`` (also served by ``unbroken-run --ft-metrics-port``) and the alert rules. Every
figure comes from the ledger through ``unbroken.ledger.goodput``; the only thing it writes is
``alert`` records, in a ledger file of its own. Never imports the launcher, checkpoints,
restart or the workload, and never torch. Imports of ours: ``unbroken.version`` (for
``unbroken_build_info``), ``unbroken.ledger``, ``unbroken.kb`` (search).
"""
