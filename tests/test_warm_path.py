"""Pure tier: the pieces of a warm call (a plan-record hit) that replace torch or stdlib work
with cheaper equivalents, checked against what they replace."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernelgen import functional

CL = torch.channels_last


def _inputs():
    """4-D and unbatched inputs in many layouts: contiguous, channels_last, permuted,
    sliced, broadcast (stride 0), size-1 and size-0 dimensions."""
    base = [(2, 3, 5, 7), (1, 3, 5, 7), (2, 1, 5, 7), (2, 3, 1, 7), (2, 3, 5, 1), (1, 1, 1, 1), (2, 3, 0, 7),
            (2, 3, 5, 0), (3, 4, 4, 4)]
    for shape in base:
        x = torch.empty(shape)
        yield x
        yield x.contiguous(memory_format=CL)
        yield x.permute(0, 1, 3, 2)  # transposed plane
        yield x.permute(1, 0, 2, 3)  # batch and channels swapped
        yield x[:, :, ::2]  # every other row
        yield x[..., :max(shape[3] - 1, 0)]  # a column short: rows padded
        yield x[0]  # unbatched
        yield x[0].permute(0, 2, 1)
        yield x[0][:, ::2]
    yield torch.empty(1, 3, 1, 1).expand(4, 3, 5, 5)  # stride 0
    yield torch.empty(3, 1, 1).expand(3, 5, 5)
    yield torch.empty_strided((2, 3, 5, 7), (1, 1024, 32, 4))  # odd but valid strides
    yield torch.empty_strided((1, 3, 5, 7), (1, 35, 7, 1))  # contiguous but for a size-1 stride


def _torch_input_strides(x: torch.Tensor, unbatched: bool, prep: int) -> tuple[int, ...]:
    """What the plan used to compute, through torch on meta tensors."""
    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if unbatched:
        meta = meta.unsqueeze(0)
    if prep == 1:
        meta = meta.contiguous()
    elif prep == 2:
        meta = meta.contiguous(memory_format=CL)
    return meta.stride()


@pytest.mark.parametrize("prep", [0, 1, 2])
def test_input_strides_equal_torchs(prep):
    checked = 0
    for x in _inputs():
        unbatched = x.dim() == 3
        ours, theirs = functional._input_strides(x, unbatched, prep), _torch_input_strides(x, unbatched, prep)
        shape = (1, *x.shape) if unbatched else tuple(x.shape)
        # the same elements (a size-1 dimension's stride addresses nothing, nor an empty tensor's) ...
        assert x.numel() == 0 or [a for a, n in zip(ours, shape) if n != 1] == [b for b, n in zip(theirs, shape) if n != 1], \
            (x.shape, x.stride(), prep)
        # ... and, where the kernel is handed a dense tensor, the dense strides it checks for (issue 54, item 3)
        if prep:
            dense = functional._contiguous_strides if prep == 1 else functional._channels_last_strides
            assert ours == dense(shape), (x.shape, x.stride(), prep)
        checked += 1
    assert checked > 80


@pytest.mark.parametrize("shape", list(itertools.product([1, 2], [1, 3, 8], [1, 4], [1, 5])) + [(2, 3, 0, 5),
                                                                                              (2, 0, 4, 5)])
def test_output_strides_equal_torchs(shape):
    assert functional._contiguous_strides(shape) == torch.empty(shape, device="meta").stride()
    assert functional._channels_last_strides(shape) == torch.empty(shape, device="meta", memory_format=CL).stride()
