"""Heartbeat steps 0..5; before step 3 every rank falls silent for SECONDS, as MODE says:

- ``slow``: rank 0 computes (a spin loop: a slow step on a busy machine) and the others wait
  on it (a sleep: a collective whose peer is late); the job is progressing;
- ``hung``: every rank waits (a sleep): nothing computes, the job is hung.
"""

import os
import sys
import time

from unbroken.launcher.client import heartbeat

if __name__ == "__main__":
    mode, seconds = sys.argv[1], float(sys.argv[2])
    rank = int(os.environ["RANK"])
    for step in range(6):
        if step == 3:
            end = time.monotonic() + seconds
            if mode == "slow" and rank == 0:
                while time.monotonic() < end:
                    pass
            else:
                time.sleep(seconds)
        time.sleep(0.02)
        heartbeat(step)
    heartbeat(5, finishing=True)
