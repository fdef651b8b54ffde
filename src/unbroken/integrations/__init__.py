"""Framework integrations, each imported only when used (``unbroken.integrations.lightning``
needs the ``lightning`` extra)."""
