"""Framework integrations, each a module imported only when used, with its framework as an
extra (``unbroken.integrations.lightning``: ``pip install 'unbroken[lightning]'``). They drive
the public API from the framework's hooks.

Imports of ours: ``unbroken.checkpoint``, ``unbroken.restart`` (and ``blob``, the
frameworks' own state as one value).
"""
