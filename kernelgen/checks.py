"""Check a conv2d call's tensors the way F.conv2d does, before anything is compiled.

Messages follow torch's wording so that people who know F.conv2d's errors recognise
them; they are raised as `ConvArgumentError` (a RuntimeError like torch's, and a
ValueError) or `TypeError`.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

import torch

from .errors import ConvArgumentError
from .layout import is_channels_last  # noqa: F401 (part of this module's API)
from .spec import ACTIVATIONS, DTYPES, INT_MAX, ConvSpec, bounded, canonical_dtype, index, pair

_FLOAT_DTYPES = {getattr(torch, name) for name in DTYPES}


@dataclass(frozen=True)
class Call:
    """A validated call: the parameters that go into a spec plus the runtime sizes."""

    unbatched: bool
    N: int
    C: int
    H: int
    W: int
    K: int
    P: int
    Q: int
    channels_last: bool  # the output's memory format, as F.conv2d chooses it
    # (sh, sw): the kernel computes the stride-1 layer of the view input[..., ::sh, ::sw], and H
    # and W are the view's (select.sampled_1x1); None: the kernel reads the input as it is
    sample: tuple[int, int] | None = None


def _size(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check_tensors(input, weight, bias) -> None:
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"conv2d(): argument '{name}' must be Tensor, not {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"conv2d(): argument 'bias' must be Tensor or None, not {type(bias).__name__}")
    tensors = [("input", input), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, t in tensors:
        if t.layout != torch.strided:
            raise ConvArgumentError(f"kernelgen.conv2d needs dense (strided) tensors; {name} has layout {t.layout}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"kernelgen.conv2d computes in {', '.join(DTYPES)}; {name} has dtype {t.dtype}"
                            + (" (convert integer tensors with .float())" if not t.is_floating_point() else ""))
    devices = {t.device for _, t in tensors}
    if len(devices) > 1:
        a, b = sorted(str(d) for d in devices)[:2]
        raise ConvArgumentError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                f"{a} and {b}!")
    if weight.dtype != input.dtype:
        raise ConvArgumentError(f"Input type ({input.dtype}) and weight type ({weight.dtype}) should be the same")
    if bias is not None and bias.dtype != input.dtype:
        raise ConvArgumentError(f"Input type ({input.dtype}) and bias type ({bias.dtype}) should be the same")
    if input.device.type not in ("cuda", "cpu", "meta"):
        raise ConvArgumentError(f"kernelgen.conv2d runs on CUDA and CPU tensors, not {input.device.type}")


def groups_arg(groups) -> int:
    """`groups` as an int, taken as F.conv2d takes it (numpy integers too); TypeError otherwise."""
    g = index(groups)
    if g is None:
        raise TypeError(f"conv2d(): argument 'groups' must be int, not {type(groups).__name__}")
    if not -(1 << 63) <= g < 1 << 63:
        raise ConvArgumentError(f"Overflow when unpacking long long: groups={g} does not fit 64 bits")
    return g


def padding_arg(padding):
    """A call's padding in the forms F.conv2d takes: 'same', 'valid' (left to the spec), an int or a
    sequence of one or two ints (as (h, w)). The spec also takes its own canonical four pads
    (top, bottom, left, right), which a caller must not pass: F.conv2d refuses four values."""
    return padding if isinstance(padding, str) else pair("padding", padding)


def check_shapes(input: torch.Tensor, weight: torch.Tensor, bias, groups) -> int:
    """Ranks, channels, groups and bias against each other, in F.conv2d's order; returns groups as
    an int (for spec_params)."""
    groups = groups_arg(groups)
    if groups <= 0:
        raise ConvArgumentError(f"non-positive groups is not supported, got groups={groups}")
    if input.dim() not in (3, 4):
        raise ConvArgumentError(f"Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: "
                                f"{_size(input)}")
    if weight.dim() != 4:
        raise ConvArgumentError(f"Expected 4-dimensional weight for {input.dim()}-dimensional input "
                                f"{_size(input)}, but got {weight.dim()}-dimensional weight of size "
                                f"{_size(weight)} instead")
    C = input.shape[-3]
    K = weight.shape[0]
    if K % groups:
        raise ConvArgumentError(f"Given groups={groups}, expected weight to be divisible by {groups} at dimension 0, "
                                f"but got weight of size {_size(weight)} instead")
    if C != weight.shape[1] * groups:
        raise ConvArgumentError(f"Given groups={groups}, weight of size {_size(weight)}, expected input{_size(input)} "
                                f"to have {weight.shape[1] * groups} channels, but got {C} channels instead")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != K):
        raise ConvArgumentError(f"Given weight of size {_size(weight)}, expected bias to be 1-dimensional with {K} "
                                f"elements, but got bias of size {_size(bias)} instead")
    if K == 0 or weight.shape[1] == 0:
        raise ConvArgumentError(f"kernelgen.conv2d needs at least one input and one output channel; weight has "
                                f"size {_size(weight)}")
    return groups


def check_call(input: torch.Tensor, weight: torch.Tensor, spec: ConvSpec, device: str) -> Call:
    """The spatial sizes against the spec's kernel, padding and dilation (after check_shapes).

    device: where the convolution will run ('cuda' or 'cpu'; the tensors may be on meta).
    """
    unbatched = input.dim() == 3
    N, C, H, W = (1, *input.shape) if unbatched else tuple(input.shape)
    K = weight.shape[0]
    (kh, kw), (dh, dw) = spec.kernel_size, spec.dilation
    top, bottom, left, right = spec.padding
    ph, pw = H + top + bottom, W + left + right
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if ph < eh or pw < ew:
        raise ConvArgumentError(f"Calculated padded input size per channel: ({ph} x {pw}). Kernel size: "
                                f"({eh} x {ew}). Kernel size can't be greater than actual input size")
    if N > 0 and (H == 0 or W == 0):  # (padding made the window fit an empty plane)
        raise ConvArgumentError(f"Only zero batch or zero channel inputs are supported, but got input shape: "
                                f"{_size(input)}")
    P, Q = spec.output_size(H, W)
    # Runtime sizes travel as 64-bit launch arguments, but the GPU kernels tile rows and planes
    # with 32-bit indices: bound them, and the output's element count (which torch.empty would
    # otherwise overflow while computing it).
    bounded("the padded input height", ph)
    bounded("the padded input width", pw)
    bounded("the input's batch size", N)
    if N * K * P * Q >= 1 << 63:
        raise ConvArgumentError(f"the output of {N}x{K}x{P}x{Q} elements does not fit 64 bits")
    # F.conv2d's output format: channels_last when the input or the weight is, except
    # float64 on CUDA, where torch's backends return contiguous outputs.
    # (an unbatched input is judged as torch judges it, unsqueezed: a channels_last weight makes the
    # output channels_last there too)
    channels_last = ((is_channels_last(input.unsqueeze(0) if unbatched else input) or is_channels_last(weight))
                     and not (device == "cuda" and input.dtype == torch.float64))
    return Call(unbatched=unbatched, N=N, C=C, H=H, W=W, K=K, P=P, Q=Q, channels_last=channels_last)


def check_activation(activation) -> str:
    """The spec's name for a call's `activation`: 'none' for None, else a member of ACTIVATIONS."""
    if activation is None:
        return "none"
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ConvArgumentError(f"activation must be None or one of {list(ACTIVATIONS)}, got {activation!r}")
    return activation


_FLOAT32_MAX = 3.4028234663852886e38


def slope_bits(negative_slope) -> int:
    """LeakyReLU's slope as the 32 bits of the float the kernels take (KgArgs.alpha): a real,
    finite number within float32's range; ConvArgumentError otherwise."""
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise ConvArgumentError(f"negative_slope must be a finite float, got {negative_slope!r} "
                                f"({type(negative_slope).__name__})")
    slope = float(negative_slope)
    if not math.isfinite(slope) or abs(slope) > _FLOAT32_MAX:
        raise ConvArgumentError(f"negative_slope must be a finite float (within float32's range), got {slope!r}")
    return struct.unpack("<I", struct.pack("<f", slope))[0]


def check_residual(residual, input: torch.Tensor, call: Call) -> None:
    """A call's `residual` (after check_call): None, or a tensor of exactly the output's shape,
    dtype and device (any strides: the call hands the kernel a copy with the output's where they
    differ)."""
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"conv2d(): argument 'residual' must be Tensor or None, not {type(residual).__name__}")
    out = [call.K, call.P, call.Q] if call.unbatched else [call.N, call.K, call.P, call.Q]
    if list(residual.shape) != out:
        raise ConvArgumentError(f"residual must have the output's shape {out}, but got residual of size "
                                f"{_size(residual)}")
    if residual.dtype != input.dtype:
        raise ConvArgumentError(f"residual must have the output's dtype {input.dtype}, but got {residual.dtype}")
    if residual.device != input.device:
        raise ConvArgumentError(f"residual must be on the output's device {input.device}, but it is on "
                                f"{residual.device}")
    if residual.layout != torch.strided:
        raise ConvArgumentError(f"kernelgen.conv2d needs dense (strided) tensors; residual has layout "
                                f"{residual.layout}")


def check_scale(scale, input: torch.Tensor, call: Call) -> None:
    """A call's `scale` (after check_call): None, or a dense 1-D float32 tensor of out_channels
    elements on the input's device (whatever the input's dtype: the kernels multiply their
    float32/float64 accumulator by it). Any strides: the call hands the kernel a contiguous copy."""
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"conv2d(): argument 'scale' must be Tensor or None, not {type(scale).__name__}")
    if scale.layout != torch.strided:
        raise ConvArgumentError(f"kernelgen.conv2d needs dense (strided) tensors; scale has layout {scale.layout}")
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be a float32 tensor (whatever the input's dtype), got {scale.dtype}; "
                        f"pass scale.float()")
    if list(scale.shape) != [call.K]:
        raise ConvArgumentError(f"scale must be 1-dimensional with out_channels={call.K} elements, but got scale "
                                f"of size {_size(scale)}")
    if scale.device != input.device:
        raise ConvArgumentError(f"scale must be on the input's device {input.device}, but it is on {scale.device}")


def spec_params(input: torch.Tensor, weight: torch.Tensor, bias, stride, padding, dilation, groups) -> dict:
    """The spec fields a call determines, after check_shapes, whose int `groups` it takes (family,
    layout, math, tiles come later)."""
    kernel = (int(weight.shape[2]), int(weight.shape[3]))
    stride, dilation = _fit(input, kernel, stride, padding, dilation)
    return dict(
        in_channels=int(weight.shape[1]) * groups, out_channels=int(weight.shape[0]),
        kernel_size=kernel,
        stride=stride, padding=padding_arg(padding), dilation=dilation, groups=groups,
        dtype=canonical_dtype(input.dtype), bias=bias is not None,
    )


def _fit(input: torch.Tensor, kernel: tuple[int, int], stride, padding, dilation):
    """(stride, dilation) with values too large for a C++ int replaced by ones that compute the same
    convolution on this input, as F.conv2d computes it: a stride past the padded input's last
    window start takes one window (so does any stride from that span on), and a 1-wide kernel
    reads one tap whatever its dilation. Anything else is left for the spec to refuse; common
    calls return their arguments untouched (the plan signature still holds the caller's)."""
    s, d = pair("stride", stride), pair("dilation", dilation)
    pads = (0, 0) if isinstance(padding, str) else pair("padding", padding)
    if max(*s, *d, *pads) <= INT_MAX or min(*s, *d, *pads) < 0 or min(*s, *d) == 0:
        return stride, dilation  # (the spec explains non-positive values)
    for i, p in enumerate(pads):
        if p >= 1 << 62:  # torch's own limit, where 2 * padding would overflow
            raise ConvArgumentError(f"Given padding={p} at dimension {i} , expected padding to be at most {(1 << 62) - 1}")
    if isinstance(padding, str):
        return stride, dilation
    padded = [input.shape[-2 + i] + 2 * pads[i] for i in (0, 1)]
    extent = [d[i] * (kernel[i] - 1) + 1 for i in (0, 1)]
    if padded[0] < extent[0] or padded[1] < extent[1]:
        raise ConvArgumentError(f"Calculated padded input size per channel: ({padded[0]} x {padded[1]}). Kernel size: "
                                f"({extent[0]} x {extent[1]}). Kernel size can't be greater than actual input size")
    s, d = list(s), list(d)
    for i in (0, 1):
        if d[i] > INT_MAX and kernel[i] == 1:
            d[i] = 1
        span = padded[i] - extent[i]  # the last window's start
        if s[i] > INT_MAX and span < s[i]:
            s[i] = span + 1
    return tuple(s), tuple(d)
