"""``python -m unbroken.integrations.torchtitan <torchtitan's arguments>``: torchtitan's trainer
under ``unbroken.main``, in place of ``python -m torchtitan.train`` (see the package).

Imports of ours: ``unbroken.job``, ``unbroken.integrations.torchtitan``.
"""

from unbroken.integrations.torchtitan import train
from unbroken.job import main

if __name__ == "__main__":
    main(train)
