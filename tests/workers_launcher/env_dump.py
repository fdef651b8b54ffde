"""An unmodified torchrun script: env:// process group, one all_reduce, its view of the world.

Writes ``<out_dir>/rank<RANK>.json`` with the launcher's environment, argv, sys.path[0] and the
all_reduce result, and prints one line to stdout and one to stderr.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "UNBROKEN_ROUND",
    "UNBROKEN_RUN_DIR",
    "UNBROKEN_RUN_ID",
    "UNBROKEN_HEARTBEAT_ADDR",
    "UNBROKEN_STORE_ADDR",
]

if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    rank = os.environ["RANK"]
    record = {
        "env": {k: os.environ.get(k) for k in KEYS},
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "all_reduce": t.item(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    print(f"hello from rank {rank}")
    print(f"error line from rank {rank}", file=sys.stderr)
