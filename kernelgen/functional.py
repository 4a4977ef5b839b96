"""`kernelgen.conv2d`: F.conv2d's semantics, computed by kernelgen's own kernels.

The first call with a given signature (shapes, strides, dtype, device, parameters,
precision) validates it, chooses a kernel (dispatch.py) and loads or compiles it
(kernels.py); the resulting plan is memoised, so later calls only allocate the output
and launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import logging

import torch

from . import checks, dispatch, precision as _precision
from .errors import CompileError
from .kernels import count, load_kernel
from .spec import ConvSpec, Problem
from .toolchain import arch_for_capability, current

log = logging.getLogger("kernelgen")

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass(frozen=True)
class Plan:
    spec: ConvSpec | None  # None: nothing to launch (empty output)
    launch: Callable[..., None] | None
    call: checks.Call
    prep: str  # how the input is handed over: 'asis', 'nchw' (contiguous) or 'nhwc' (channels_last)


_plans: dict[Any, Plan] = {}
_arch_by_device: dict[int, str] = {}


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, Mapping):
        return tuple(sorted(v.items()))
    return v


def _cuda_arch(index: int) -> str:
    arch = _arch_by_device.get(index)
    if arch is None:
        arch = _arch_by_device[index] = arch_for_capability(*torch.cuda.get_device_capability(index))
    return arch


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1, *, precision: str | None = None, family: str | None = None,
           tiles: Mapping[str, int] | None = None) -> torch.Tensor:
    """2-D convolution with F.conv2d's semantics, computed by JIT-compiled kernelgen kernels.

    input: (N, C_in, H, W) or unbatched (C_in, H, W); any strides (channels_last too).
    weight: (C_out, C_in / groups, kH, kW). bias: (C_out,) or None.
    stride, dilation: int or (h, w), positive. padding: int, (h, w), 'valid' or 'same'
        ('same' needs stride 1; even kernels pad one more at the end, as torch does).
    groups: positive, dividing C_in and C_out (groups == C_in is depthwise, with
        C_out = m * C_in for a channel multiplier m).
    Returns (N, C_out, H_out, W_out) (or unbatched), of the input's dtype, on its
    device, channels_last when the input or the weight is, as F.conv2d does.

    Keyword-only extras:
    precision: for float32, None follows torch's convolution TF32 setting
        (torch.backends.cudnn.conv.fp32_precision / allow_tf32); 'ieee' forces exact
        float32; 'tf32' allows TF32 tensor-core products.
    family, tiles: force a kernel family and (some of) its tile sizes.

    Autograd: the forward is differentiable-aware but kernelgen has no backward
    kernels yet; calling backward through it raises NotImplementedError.
    """
    fp32 = input.dtype == torch.float32 if isinstance(input, torch.Tensor) else False
    math = _precision.fp32_math(precision) if fp32 else "ieee"
    try:
        sig = (input.shape, input.stride(), input.dtype, input.device, weight.shape, weight.stride(), weight.dtype,
               weight.device, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
               _hashable(stride), _hashable(padding), _hashable(dilation), groups, math, family, _hashable(tiles))
        plan = _plans.get(sig)
    except (AttributeError, TypeError):  # not tensors, or unhashable parameters: the slow path explains
        sig, plan = None, None
    if plan is None:
        plan = _make_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles)
        if sig is not None:
            _plans[sig] = plan
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _NoBackward.apply(plan, input, weight, bias)
    return _run(plan, input, weight, bias)


def spec_for(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, device: str | None = None,
             precision: str | None = None, family: str | None = None,
             tiles: Mapping[str, int] | None = None) -> tuple[ConvSpec | None, checks.Call]:
    """(spec, call): the kernel `conv2d` would compile for these arguments, and the call's sizes.

    The tensors may live on 'meta' (shapes and strides are all that is read); `device`
    ('cuda' or 'cpu') says which device to plan for, default the tensors'. The spec is
    None when there is nothing to compute (an empty batch).
    """
    _precision.check_override(precision)
    checks.check_tensors(input, weight, bias)
    checks.check_shapes(input, weight, bias, groups)
    params = checks.spec_params(input, weight, bias, stride, padding, dilation, groups)
    probe = ConvSpec(**params)  # validates the parameters; family/tiles are chosen below
    device = device or input.device.type
    call = checks.check_call(input, weight, probe, device)
    if call.N == 0 or device == "meta":
        return None, call
    math = _precision.fp32_math(precision) if params["dtype"] == "float32" else "ieee"
    problem = Problem(N=call.N, H=call.H, W=call.W, P=call.P, Q=call.Q)
    return dispatch.choose(params, device, problem, call.channels_last, math, family=family, tiles=tiles), call


def _make_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles) -> Plan:
    spec, call = spec_for(input, weight, bias, stride, padding, dilation, groups, precision=precision,
                          family=family, tiles=tiles)
    if spec is None:
        return Plan(spec=None, launch=None, call=call, prep="asis")
    device = spec.device
    toolchain = current("cpu") if device == "cpu" else current("cuda", _cuda_arch(input.device.index))
    try:
        launch = load_kernel(spec, toolchain)
    except CompileError:
        if family is not None or spec.family == "direct" or device != "cuda":
            raise
        # A fast family that fails to build is a kernelgen bug; the general family still
        # computes the right answer, so say so loudly, count it, and carry on.
        log.warning("kernelgen: family %s failed to build for %s; using the direct family instead",
                    spec.family, spec.summary(), exc_info=True)
        count("fallbacks")
        spec, _ = spec_for(input, weight, bias, stride, padding, dilation, groups, precision=precision,
                           family="direct")
        launch = load_kernel(spec, toolchain)
    prep = "asis" if spec.layout == "any" else spec.layout
    return Plan(spec=spec, launch=launch, call=call, prep=prep)


def _run(plan: Plan, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    c = plan.call
    fmt = torch.channels_last if c.channels_last else torch.contiguous_format
    y = torch.empty((c.N, c.K, c.P, c.Q), dtype=input.dtype, device=input.device, memory_format=fmt)
    if plan.launch is not None:
        x = input.unsqueeze(0) if c.unbatched else input
        if plan.prep == "nchw":
            x = x.contiguous()
        elif plan.prep == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
        w = weight.contiguous()
        b = bias.contiguous().data_ptr() if bias is not None else 0
        xs, ys = x.stride(), y.stride()
        if x.is_cuda:
            dev = x.device.index
            stream = _raw_stream(dev) if _raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream
        else:
            dev, stream = -1, 0
        plan.launch(x.data_ptr(), w.data_ptr(), b, y.data_ptr(), c.N, c.H, c.W, c.P, c.Q,
                    xs[0], xs[1], xs[2], xs[3], ys[0], ys[1], ys[2], ys[3], dev, stream)
    return y.squeeze(0) if c.unbatched else y


class _NoBackward(torch.autograd.Function):
    """Carries requires_grad through the forward; backward explains what is missing."""

    @staticmethod
    def forward(ctx, plan, input, weight, bias):  # type: ignore[override]
        return _run(plan, input, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise NotImplementedError("kernelgen.conv2d has no backward kernels yet: it computes forward passes "
                                  "(inference). Train with torch.nn.functional.conv2d, or run kernelgen under "
                                  "torch.no_grad()/torch.inference_mode().")


def clear_plans() -> None:
    """Forget memoised call plans (kernels stay loaded)."""
    _plans.clear()
