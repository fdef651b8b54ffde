"""Benchmarks that reproduce and extend the published comparison.

Each prints ratios side by side from one run and can write ``--json``. Benchmarks may import
any part of unbroken but the CLI, through public names only; nothing imports them except the
CLI. Imports of ours: ``unbroken``, ``unbroken.errors``, ``unbroken.env``, ``unbroken.log``,
``unbroken.ledger``, ``unbroken.checkpoint``, ``unbroken.faults``, ``unbroken.restart``,
``unbroken.launcher``, ``unbroken.workload``, ``unbroken.dashboard``, ``unbroken.kb``,
``unbroken.k8s``, ``unbroken.version``.
"""
