"""A stand-in for kernelgen.conv2d's epilogue (activation=, residual=), until the kernel side lands.

DELETE THIS FILE once `kernelgen.conv2d(..., activation=, negative_slope=, residual=)` is merged:
tests/test_fuse.py then runs against the real kernels (it uses this stand-in only while
kernelgen.conv2d takes no `activation`; see `conv2d_with_epilogue` there).

`conv2d` implements the contract the kernel side promises, in torch: activation(F.conv2d(input,
weight, bias) + residual), with torch's activations, and refuses what the real function refuses
(an activation not in ACTIVATIONS, a residual not of exactly the output's shape, dtype and device),
so that a test passing here shows conversion hands the kernels only what they take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "relu6", "leaky_relu", "silu", "gelu", "hardswish", "hardsigmoid", "sigmoid")
_TORCH = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "gelu": F.gelu, "hardswish": F.hardswish,
          "hardsigmoid": F.hardsigmoid, "sigmoid": torch.sigmoid}


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, precision=None, family=None,
           tiles=None, activation=None, negative_slope=0.01, residual=None):
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected None or one of {ACTIVATIONS}")
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):  # as kernelgen.conv2d: computed in the region's dtype
        dtype = torch.get_autocast_dtype(device_type)
        input, weight, bias = (t if t is None or t.dtype == torch.float64 else t.to(dtype)
                               for t in (input, weight, bias))
    with torch.autocast(device_type, enabled=False):
        y = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
        if residual is not None:
            if (not isinstance(residual, torch.Tensor) or residual.shape != y.shape or residual.dtype != y.dtype
                    or residual.device != y.device):
                raise ValueError(f"residual {getattr(residual, 'dtype', None)} {getattr(residual, 'shape', None)}: "
                                 f"expected exactly the output's {y.dtype} {tuple(y.shape)} on {y.device}")
            y = y + residual
        if activation == "leaky_relu":
            return F.leaky_relu(y, negative_slope)
        return y if activation is None else _TORCH[activation](y)
