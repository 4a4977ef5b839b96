"""What the whole-model tests share: BatchNorm statistics drawn at random (so folding changes
something), and a model's state_dict kept and compared."""

from __future__ import annotations

import torch
from torch import nn


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def randomise_bn(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) * 2 - 1)
            m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) - 0.5)
    return model
