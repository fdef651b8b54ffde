# From https://github.com/pytorch/examples, distributed/FSDP2/utils.py at commit 77f55b912142e11fcfdf5b530231fb9c52f181e8.
# Copyright (c) 2017, Pytorch contributors. BSD 3-Clause License: see LICENSE in this folder.
# Kept as published except the lines tests/unit/test_upstream_example_source.py lists (to run on CPU).

import torch
from model import Transformer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard


def inspect_model(model: FSDPModule):
    assert isinstance(model, Transformer)
    assert isinstance(model, FSDPModule)

    if torch.distributed.get_rank() == 0:
        print(model)

    for param in model.parameters():
        assert param.placements == (Shard(0),)
        assert param.dtype == torch.float32
        # print(param.get_local_tensor())


def inspect_mixed_precision(model: FSDPModule):
    model.unshard()
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    model.reshard()
