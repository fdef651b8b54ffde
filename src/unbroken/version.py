"""The package version, in a leaf module any layer may import (the launcher, the exporter).

Imports of ours: none.
"""

__version__ = "0.1.0"
