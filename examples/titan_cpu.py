"""torchtitan's Llama 3 debug model on CPU ranks (gloo): what torchtitan_llama.py and its plain
twin plain_torchtitan_llama.py share. None of it is needed on GPUs.

torchtitan 0.3 is written for GPUs. Without one it needs, and this module gives it on import
(import it before anything of torchtitan's):

- a device module for "cpu" (torchtitan falls back to ``torch.cuda`` when it finds no
  accelerator), with the few calls torchtitan makes of it;
- ``torch.distributed.set_timeout`` (the PyTorch nightly torchtitan 0.3 was built against;
  released torch has ``_set_pg_timeout``).

And ``llama3_debugmodel_cpu``, the config both scripts name (``--module titan_cpu --config
llama3_debugmodel_cpu``): torchtitan's ``llama3_debugmodel`` with an attention that has a
backward on CPU (SDPA, causal: FlexAttention's backward needs a GPU), FSDP2 reducing with SUM
(gloo has no PREMUL_SUM), DTensor for the model-parallel axes only, a fixed seed, short
sequences, and its tokenizer and text generated here (torchtitan's test assets are not in its
wheel): a word-level tokenizer over 2046 made-up words and 300 documents of them, the same on
every run and machine.
"""

import hashlib
import json
import os
import random
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the documents are local files

import torchtitan.tools.utils as _titan_utils  # noqa: E402  (before the modules that read it)

_titan_utils.device_type = "cpu"
_titan_utils.device_module = types.SimpleNamespace(
    set_device=lambda *a, **k: None,
    current_device=lambda: 0,
    device_count=lambda: 1,
    empty_cache=lambda: None,
    synchronize=lambda *a: None,
    get_device_name=lambda *a: "cpu",
    reset_peak_memory_stats=lambda *a: None,
    memory_stats=lambda *a: {},
    get_device_properties=lambda *a: types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ),
)
if not hasattr(dist, "set_timeout"):
    dist.set_timeout = dist.distributed_c10d._set_pg_timeout

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

ASSETS = Path(tempfile.gettempdir()) / "unbroken-titan-assets-1"
WORDS, DOCUMENTS = 2046, 300


def _write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (every rank writes the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def assets() -> Path:
    """The tokenizer (``ASSETS/tokenizer``) and documents (``ASSETS/documents``), made once."""
    if (ASSETS / "documents" / "train.jsonl").exists():
        return ASSETS
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: list[str] = []
    while len(words) < WORDS:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))
        if word not in words:
            words.append(word)
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(words[: WORDS - 1])})
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "special": True,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            }
            for t, i in list(vocab.items())[:2]
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    lines = [
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(40, 200)))})
        for _ in range(DOCUMENTS)
    ]
    _write(ASSETS / "tokenizer" / "tokenizer.json", json.dumps(tokenizer))
    _write(ASSETS / "tokenizer" / "tokenizer_config.json", json.dumps(config))
    _write(ASSETS / "documents" / "train.jsonl", "\n".join(lines) + "\n")
    return ASSETS


def _reduce_with_sum(parallelize):
    def parallelize_for_gloo(model, *args, **kwargs):
        model = parallelize(model, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_for_gloo


def llama3_debugmodel_cpu():
    """torchtitan's ``llama3_debugmodel`` made to train on CPU ranks; 40 steps, a checkpoint
    every 10 (torchtitan's own: the plain script; unbroken's: the adopted one)."""
    root = assets()
    config = llama3_debugmodel()
    del config.model_spec.model.layers[2:]  # 2 of its 6 layers, no activation checkpointing:
    config.activation_checkpoint = None  # steps of tens of milliseconds on 2 cores
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec.parallelize_fn = _reduce_with_sum(config.model_spec.parallelize_fn)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.hf_assets_path = str(root / "tokenizer")
    config.dataloader.dataset_path = str(root / "documents")
    config.training.steps = 40
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.checkpoint.enable = True
    config.checkpoint.interval = 10
    config.metrics.log_freq = 10
    config.debug.seed = 0
    return config


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of the full weights; gathers the FSDP shards (call it on every rank)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        h.update(name.encode() + full.detach().float().numpy().tobytes())
    return h.hexdigest()
