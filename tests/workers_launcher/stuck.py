"""Report steps 0..3 through the heartbeat client, then fail: a job that never gets further."""

import sys
import time

from unbroken.launcher.client import heartbeat

if __name__ == "__main__":
    for step in range(4):
        heartbeat(step)
        time.sleep(0.01)
    sys.exit(1)
