"""torchtitan's Llama 3 debug model on CPU, before (plain_torchtitan_llama.py) and after
(torchtitan_llama.py) adopting unbroken.

plain_torchtitan_llama.py is torchtitan's own entry point (``torchtitan.train.main``: parse the
config, build the Trainer, train) with torchtitan's own fault tolerance: a checkpoint every 10
steps (its ``CheckpointManager``, DCP), from which a restarted job resumes. torchtitan_llama.py
runs the same in unbroken.main with unbroken's checkpoints in place of torchtitan's: it
restarts in-process after an exception or a hang, resumes from memory after a lost process,
and its ledger yields `unbroken report`. `diff -u examples/plain_torchtitan_llama.py
examples/torchtitan_llama.py` is what a user applies. Run either with

    unbroken-run --standalone --nproc-per-node 2 examples/torchtitan_llama.py \\
        --module titan_cpu --config llama3_debugmodel_cpu

(``titan_cpu``: the debug model on CPU ranks; on GPUs, name any torchtitan config; the
checkpoints go to ``outputs/checkpoint``, torchtitan's default ``--dump-folder``). Rank 0
prints a hash of the trained weights at the end: the same for both scripts and every run of
them on 2 ranks, with faults or without.
"""

import titan_cpu  # torchtitan on CPU ranks: first, before torchtitan's modules
import torch.distributed as dist
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger


def train() -> None:
    init_logger()
    config = ConfigManager().parse_args()
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    digest = titan_cpu.weights_sha256(trainer.model_parts[0])
    if dist.get_rank() == 0:
        print(f"final_state_sha256={digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
