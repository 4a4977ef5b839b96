"""What the whole-model tests share: a model's state_dict, kept and compared."""

from __future__ import annotations

import torch


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
