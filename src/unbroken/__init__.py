"""unbroken: keeps PyTorch distributed training productive through faults.

The public API. Importing ``unbroken`` does not import torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
