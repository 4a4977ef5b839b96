"""Memory-format questions answered from sizes and strides alone (no import beyond the stdlib),
so the warm path (plans.fits) can ask them without loading the validation modules."""

from __future__ import annotations


def is_channels_last(t: "torch.Tensor") -> bool:  # noqa: F821
    """Whether torch's Tensor.suggest_memory_format() says channels_last for `t`: what decides
    F.conv2d's output format, so ambiguous tensors (size-1 dimensions, views) must read alike.

    Read from the channels outwards (C, W, H, N), each stride must reach at least the span of
    the dimensions before it. No channels_last for a zero channel stride, an empty dimension, or
    a batch stride equal to the channel stride (an N111 tensor, or an N11W one sliced down to a
    column: torch keeps NCHW for those)."""
    if t.dim() != 4:
        return False
    size, stride = t.shape, t.stride()
    if stride[1] == 0:
        return False
    span = 0
    for d in (1, 3, 2, 0):
        if size[d] == 0 or stride[d] < span or (d == 0 and span == stride[1]):
            return False
        span = stride[d] * size[d]
    return True
