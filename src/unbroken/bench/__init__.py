"""Benchmarks that reproduce and extend the published comparison.

Each prints ratios side by side from one run and can write ``--json``. Benchmarks may import
any part of unbroken; nothing imports them except the CLI.
"""
