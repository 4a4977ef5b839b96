"""Shared by the family tests: a layer's spec fields and the Problem of a call on a nominal GPU."""

from __future__ import annotations

from kernelgen.device import nominal
from kernelgen.spec import ConvSpec, Problem


def params(cin, cout, kernel=(1, 1), dtype="float32", stride=1, padding=0, dilation=1, groups=1, bias=False):
    """ConvSpec's fields of a layer (a 1x1 by default)."""
    return dict(in_channels=cin, out_channels=cout, kernel_size=kernel, stride=stride, padding=padding,
                dilation=dilation, groups=groups, dtype=dtype, bias=bias)


def problem(fields, N, H, W, arch="sm_90a", wide=False) -> Problem:
    """The call of `fields` on an N x H x W input, planned for a nominal GPU of `arch`."""
    P, Q = ConvSpec(**fields).output_size(H, W)
    return Problem(N=N, H=H, W=W, P=P, Q=Q, device=nominal(arch, wide_dram=wide))
