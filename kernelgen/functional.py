"""`kernelgen.conv2d`: F.conv2d's semantics, computed by kernelgen's own kernels.

The first call with a given signature (shapes, strides, dtype, device, parameters,
precision) validates it, chooses a kernel (select.py) and loads or compiles it
(kernels.py); the resulting plan is memoised, so later calls only allocate the output
and launch. The outcome is also recorded on disk (plans.py), so the first such call in
a later process skips validation and selection and imports its kernel directly. A choice
measured on this GPU (kernelgen.tune, or KERNELGEN_TUNE=1) is kept in that record and
served before the selector is asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import numbers
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from . import compiled, config, packs, plans
from .kernels import count, entry_spec, load_entry, load_kernel, packed_bytes, stats, workspace_bytes
from .precision import check_override, torch_fp32_conv_math

if TYPE_CHECKING:
    from .checks import Call
    from .device import Device
    from .spec import ConvSpec

log = logging.getLogger("kernelgen")

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CL = torch.channels_last
_CF = torch.contiguous_format
# How a plan prepares the input: as it is; dense NCHW; dense channels_last; dense NCHW starting on
# a 16-byte boundary (families with `aligned_input`).
_PREP = {"any": 0, "nchw": 1, "nhwc": 2, "nchw_aligned": 3}


class Plan:
    """Everything a call with a known signature needs: the kernel and its integer arguments.

    Precomputed once per signature, so a call only allocates the output, reads four
    pointers and the stream, and launches.
    """

    __slots__ = ("launch", "out_shape", "fmt", "squeeze", "prep", "w_asis", "b_contig", "args", "key", "ws", "sample",
                 "range_name", "packed", "pack_once", "r_asis")

    def __init__(self, launch, out_shape, fmt, squeeze, prep, w_asis, b_contig, args, key, ws=0, sample=None,
                 range_name=None, packed=0, pack_once=True, r_asis=True):
        self.launch = launch  # None: nothing to compute (an empty batch, or meta tensors)
        self.out_shape = out_shape  # 4-D
        self.fmt = fmt
        self.squeeze = squeeze  # unbatched input: drop the batch dimension again
        self.prep = prep  # 0: input as it is; 1: made NCHW-contiguous; 2: made channels_last; 3: 1, aligned
        self.w_asis = w_asis  # the kernel reads the weight through its strides; else a contiguous copy
        self.b_contig = b_contig
        self.args = args  # N, H, W, P, Q, input, output and weight strides, device index
        self.key = key
        self.ws = ws  # bytes of device scratch the kernel takes, allocated per call on its stream
        self.sample = sample  # (sh, sw): the kernel reads the view input[..., ::sh, ::sw] (Call.sample)
        self.range_name = range_name  # the launch's profiler range, naming its family (_profiled)
        self.packed = packed  # bytes of the kernel's packed weights (packs.py), 0 if it packs none
        self.pack_once = pack_once  # keep them with the weight (KERNELGEN_PACK_ONCE); else packed every call
        self.r_asis = r_asis  # the residual (if any) lies with the output's strides; else it is copied so


_plans: dict[Any, Plan] = {}


class _PerThread(threading.local):
    """Per thread (autograd runs a device's backward on a thread of its own): while `transient` is
    above zero, the calls' weights are transient (transient_weights())."""

    transient = 0


_local = _PerThread()
_planning_targets: list["Device"] = []
_meta_observers: list[Callable[..., None]] = []
_compiling = torch.compiler.is_compiling
# What conv2d checks on each call for a caller that its kernels cannot serve directly (compiled.route):
# a dispatch mode, a functorch transform, the TorchScript tracer, the profiler, a tensor subclass.
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.maybe_current_level
_tracing_state = torch._C._get_tracing_state
_profiler = torch.autograd.profiler
_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@contextlib.contextmanager
def transient_weights() -> Iterator[None]:
    """While active on this thread, the weights conv2d is given are transient, each call's own
    (the gradients' operands: a flipped weight, grad_out as a kernel), so a kernel that packs its
    weights packs them into memory of the call's own and keeps nothing: no buffer kept with the
    weight, no event recorded, no bookkeeping a later call could never use (packs.py keeps a packing
    for the next call with the same weight)."""
    _local.transient += 1
    try:
        yield
    finally:
        _local.transient -= 1


@contextlib.contextmanager
def planning_for(gpu: "str | Device", wide_dram: bool = False) -> Iterator[None]:
    """While active, CUDA plans made away from a GPU (spec_for on meta or CPU tensors, as
    `kernelgen warm` makes them) are for `gpu`, a kernelgen.device.Device or a target's name
    ('sm_90a'; with `wide_dram`, its larger-memory part: kernelgen.device.nominal), rather than
    the current GPU: the specs are then the ones such a GPU will ask for. Calls on CUDA tensors
    keep their own GPU."""
    from .device import nominal

    _planning_targets.append(nominal(gpu, wide_dram) if isinstance(gpu, str) else gpu)
    try:
        yield
    finally:
        _planning_targets.pop()


@contextlib.contextmanager
def observe_meta_calls(callback: Callable[..., None]) -> Iterator[None]:
    """While active, call `callback(input, weight, bias, stride, padding, dilation, groups,
    precision, family, tiles, activation=..., residual=...[, scale=...])` for every
    kernelgen.conv2d call on meta tensors.

    This is how `kernelgen warm --model` finds the convolutions of a model run on meta
    tensors, direct calls of kernelgen.conv2d included.
    """
    _meta_observers.append(callback)
    try:
        yield
    finally:
        _meta_observers.remove(callback)


def _key(v: Any) -> Any:
    """A call parameter as plain values for the plan signature, which becomes a plan record's JSON:
    ints, strings and tuples of them (numpy integers as ints; tiles as sorted pairs). TypeError for
    anything else (a tensor as a stride), which sends the call down the full path unplanned."""
    if v.__class__ is int or v.__class__ is str:
        return v
    if v.__class__ is tuple and len(v) == 2 and v[0].__class__ is int and v[1].__class__ is int:
        return v  # (a module's stride, padding or dilation: the common case, without recursion)
    if isinstance(v, (list, tuple)):
        return tuple(_key(e) for e in v)
    if isinstance(v, Mapping):
        return tuple(sorted((_key(k), _key(e)) for k, e in v.items()))
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    raise TypeError(f"not a plain parameter: {v!r}")


def _autocast(device_type: str, *tensors):
    """The tensors as F.conv2d takes them under torch.autocast: conv2d is one of autocast's
    lower-precision ops, so every floating tensor but a float64 one is cast to the region's dtype
    (torch.get_autocast_dtype). Non-tensors are left for the checks to explain."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
                 and t.dtype is not torch.float64 else t for t in tensors)


def _gpu(index: int) -> "Device":
    """The GPU `index` (kernelgen.device.of, read once per process): what selection and plan
    records key on."""
    from .device import of

    return of(index)


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1, *, precision: str | None = None, family: str | None = None,
           tiles: Mapping[str, int] | None = None, activation: str | None = None, negative_slope: float = 0.01,
           residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
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
    activation, negative_slope, residual: a fused epilogue. The call returns
        activation(conv2d(input, weight, bias) + residual), computed in the accumulator's
        precision and rounded once to the output's dtype. activation: None or one of
        kernelgen.ACTIVATIONS ('relu', 'relu6', 'leaky_relu', 'silu', 'gelu' (the exact erf form),
        'hardswish', 'hardsigmoid', 'sigmoid'), with torch's semantics; negative_slope:
        leaky_relu's slope, a finite float (ignored by the others; the kernels take it as a
        float32). residual: None or a tensor of exactly the output's shape, dtype and device
        (any strides).
    scale: None or a 1-D float32 tensor of out_channels elements on the input's device (whatever
        the input's dtype; any strides): each output channel's accumulator is multiplied by it
        before the bias, so the call returns activation(scale[k] * conv2d(input, weight)[k] +
        bias[k] + residual), rounded once. This is a folded BatchNorm's scale kept in float32
        while the weights keep their own rounding (kernelgen.convert(fold_bn=True) on 16-bit models).

    Autograd: the gradients are computed by kernelgen's own forward kernels (gradients.py),
    through a fused activation by torch's own derivative of it (its ties and NaN): read from
    the saved output for relu, relu6, sigmoid and leaky_relu with a slope >= 0; for the others
    backward recomputes the pre-activation with one more forward call. The residual's gradient
    is the pre-activation's. With a scale, input, weight and bias gradients are those of the
    convolution whose output gradient is grad_z * scale[k]; the scale itself gets no gradient
    (NotImplementedError where autograd would need one). Double backward raises NotImplementedError.

    Under torch.autocast the call computes in the region's dtype, as F.conv2d does.
    """
    device_type = getattr(getattr(input, "device", None), "type", None)
    if (device_type == "cuda" or device_type == "cpu") and torch.is_autocast_enabled(device_type):
        input, weight, bias = _autocast(device_type, input, weight, bias)
    if _compiling():  # torch.compile is tracing: the call becomes one operator of the graph
        return compiled.call(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles,
                             activation, negative_slope, residual, scale)
    if (_dispatch_modes() or _functorch_level() is not None or _tracing_state() is not None
            or _profiler._is_profiler_enabled or input.__class__ is not _Tensor or weight.__class__ not in _PLAIN
            or (bias is not None and bias.__class__ not in _PLAIN)
            or (residual is not None and residual.__class__ not in _PLAIN)
            or (scale is not None and scale.__class__ not in _PLAIN)):
        y = compiled.route(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles,
                           activation, negative_slope, residual, scale)
        if y is not None:
            return y
        if _profiler._is_profiler_enabled and activation is None and residual is None and scale is None:
            # inside the operator: the launch as a range naming its family
            return _profiled(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles)
    if _meta_observers and isinstance(input, torch.Tensor) and input.is_meta:
        for observe in list(_meta_observers):
            observe(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles,
                    activation=activation, residual=residual, **({} if scale is None else {"scale": scale}))
    # a fused epilogue (kept apart: plain calls pay nothing)
    if activation is not None or residual is not None or scale is not None:
        return _conv2d_epilogue(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles,
                                activation, negative_slope, residual, scale)
    if _any_neg(input, weight, bias):
        input, weight, bias = _resolve_neg(input, weight, bias)
    sig = signature(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles)
    plan = None if sig is None else _plans.get(sig)
    if plan is None:
        plan = _new_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, sig)
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _autograd().apply(plan, (stride, padding, dilation, groups, precision, family, tiles, None, None),
                                 input, weight, bias)
    return _run(plan, input, weight, bias)


def _profiled(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles) -> torch.Tensor:
    """conv2d inside its operator while torch.profiler records: the launch in a range that names the
    family serving the call (`kernelgen::conv2d[nhwc_tma]`, inside the operator's `kernelgen::conv2d`),
    so a trace tells the kernels apart. Kept out of conv2d's body, so that an unprofiled call pays
    nothing for it; grad mode is off here (the operator's autograd wraps it), so no backward node."""
    input, weight, bias = _resolve_neg(input, weight, bias)
    sig = signature(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles)
    plan = (None if sig is None else _plans.get(sig)) or _new_plan(input, weight, bias, stride, padding, dilation,
                                                                   groups, precision, family, tiles, sig)
    if plan.range_name is None:  # nothing to launch
        return _run(plan, input, weight, bias)
    with torch.profiler.record_function(plan.range_name):
        return _run(plan, input, weight, bias)


def _new_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, sig,
              activation=None, residual=None, scale=None) -> Plan:
    """A call signature's first plan, memoised for its later calls (where it has a signature)."""
    plan = _make_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, sig,
                      activation, residual, scale)
    if sig is not None:
        _plans[sig] = plan
    return plan


_slopes: dict[float, int] = {}  # negative_slope -> its float32 bits (a small memo: slopes are few)


def _conv2d_epilogue(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles,
                     activation, negative_slope, residual, scale=None) -> torch.Tensor:
    """conv2d with a fused epilogue (a scale, an activation, a residual): its plan is memoised under
    the signature and the epilogue's (the activation's name, the residual's and the scale's shape,
    strides, dtype and device); the slope travels at run time."""
    alpha = 0
    if activation == "leaky_relu":
        alpha = _slopes.get(negative_slope) if negative_slope.__class__ is float else None
        if alpha is None:
            from .checks import slope_bits

            alpha = slope_bits(negative_slope)  # (explains a bad one, on every call: it is not in the signature)
            if negative_slope.__class__ is float and len(_slopes) < 64:
                _slopes[negative_slope] = alpha
    if _any_neg(input, weight, bias, residual, scale):
        input, weight, bias, residual, scale = _resolve_neg(input, weight, bias, residual, scale)
    sig = signature(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, activation,
                    residual, scale)
    plan = None if sig is None else _plans.get(sig)
    if plan is None:
        plan = _new_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, sig,
                         activation, residual, scale)
    if scale is not None and not scale.is_contiguous():  # (the kernels read scale[k]; the plan checked it)
        scale = scale.contiguous()
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)
                                    or (residual is not None and residual.requires_grad)
                                    or (scale is not None and scale.requires_grad)):
        if scale is not None and scale.requires_grad:
            from .gradients import SCALE_HAS_NO_GRADIENT

            raise NotImplementedError(SCALE_HAS_NO_GRADIENT)
        return _autograd().apply(plan, (stride, padding, dilation, groups, precision, family, tiles, activation,
                                        negative_slope), input, weight, bias, residual, alpha, scale)
    return _run(plan, input, weight, bias, residual=residual, alpha=alpha, scale=scale)


def _any_neg(*tensors) -> bool:
    """Whether any of the tensors (None: absent) has its negative bit set (non-tensors: no), as
    cheaply as a warm call can ask: a plain loop, the checks of non-tensors only where one raises."""
    try:
        for t in tensors:
            if t is not None and t.is_neg():
                return True
        return False
    except (AttributeError, TypeError):  # (not tensors: the checks explain them)
        return any(isinstance(t, torch.Tensor) and t.is_neg() for t in tensors)


def _resolve_neg(*tensors):
    """The tensors with any negative bit resolved (x.conj().imag, torch._neg_view store their values
    unnegated, and kernels read memory): negated copies, as torch's own kernels take them. Before
    planning, since the copy's strides are its own."""
    return tuple(t.resolve_neg() if isinstance(t, torch.Tensor) and t.is_neg() else t for t in tensors)


def signature(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, activation=None,
              residual=None, scale=None) -> tuple | None:
    """What a plan is memoised under: the tensors' shapes, strides, dtypes and devices, the
    parameters and the float32 math the call resolves to; with an epilogue, its activation and
    the residual's shape, strides, dtype and device too, and the scale's where there is one (a call
    without one keeps the signature it had before epilogues, and one without a scale the one it had
    before scales). None where the arguments are not tensors or not plain values (the
    full path explains what is wrong)."""
    try:
        if activation is not None or residual is not None or scale is not None:
            if activation is not None and activation.__class__ is not str:
                return None
            if residual is not None and residual.layout is not torch.strided:
                return None
            epi = (activation, None if residual is None else (residual.shape, residual.stride(), residual.dtype,
                                                               residual.device))
            if scale is not None:
                if scale.layout is not torch.strided:
                    return None
                epi += ((scale.shape, scale.stride(), scale.dtype, scale.device),)
            base = signature(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles)
            return None if base is None else base + epi
        dtype = input.dtype
        if dtype is torch.float32:
            math = precision if precision is not None else torch_fp32_conv_math()
        else:
            math = None
        if _local.transient:  # (a plan of its own: the selector counts the packing, costmodel.py)
            family = ("transient", family)
        return (input.shape, input.stride(), dtype, input.device, weight.shape, weight.stride(), weight.dtype,
                weight.device, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                stride if stride.__class__ is int else _key(stride),
                padding if padding.__class__ is int else _key(padding),
                dilation if dilation.__class__ is int else _key(dilation),
                groups if groups.__class__ is int else _key(groups), math, family,
                None if tiles is None else _key(tiles))
    except (AttributeError, TypeError):
        return None


def spec_for(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, device: str | None = None,
             precision: str | None = None, family: str | None = None, tiles: Mapping[str, int] | None = None,
             activation: str | None = None, residual=None, scale=None) -> tuple["ConvSpec | None", "Call"]:
    """(spec, call): the kernel `conv2d` would compile for these arguments (untuned: the
    selector's first choice), and the call's sizes.

    The tensors may live on 'meta' (shapes and strides are all that is read); `device`
    ('cuda' or 'cpu') says which device to plan for, default the tensors'. The spec is
    None when there is nothing to compute (an empty batch). `activation`, `residual` and `scale`
    (tensors, on meta too) are conv2d's epilogue.
    """
    specs, call = candidates_for(input, weight, bias, stride, padding, dilation, groups, device=device,
                                 precision=precision, family=family, tiles=tiles, activation=activation,
                                 residual=residual, scale=scale)
    return (specs[0] if specs else None), call


def candidates_for(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
                   device: str | None = None, precision: str | None = None, family: str | None = None,
                   tiles: Mapping[str, int] | None = None, every: bool = False, activation: str | None = None,
                   residual=None, scale=None) -> tuple[list["ConvSpec"], "Call"]:
    """(specs, call): what the families can run for these arguments, the selector's ranking of
    their first choices first, then (with `every`) each family's other configurations in the
    same order of families; and the call's sizes. Empty where there is nothing to compute.
    Raises what conv2d raises for bad arguments; ConvArgumentError where no family serves it."""
    from . import checks, select
    from .precision import fp32_math
    from .spec import ConvSpec, Problem

    check_override(precision)
    checks.check_tensors(input, weight, bias)
    groups = checks.check_shapes(input, weight, bias, groups)
    params = checks.spec_params(input, weight, bias, stride, padding, dilation, groups)
    probe = ConvSpec(**params)  # validates the parameters; family/tiles are chosen below
    device = device or input.device.type
    call = checks.check_call(input, weight, probe, device)
    params["activation"] = checks.check_activation(activation)
    checks.check_residual(residual, input, call)
    params["residual"] = residual is not None
    checks.check_scale(scale, input, call)
    params["scale"] = scale is not None
    if call.N == 0 or device == "meta":
        return [], call
    sample = select.sampled_1x1(probe, device, call.channels_last) if family is None else None
    if sample is not None:  # the stride-1 layer of the pixels the strided one reads (a view, no copy)
        view = input[..., ::sample[0], ::sample[1]]
        specs, vcall = candidates_for(view, weight, bias, 1, 0, dilation, groups, device=device,
                                      precision=precision, tiles=tiles, every=every, activation=activation,
                                      residual=residual, scale=scale)
        if vcall.channels_last == call.channels_last:  # (a degenerate view could look channels_last)
            return specs, dataclasses.replace(vcall, sample=sample)
    math = fp32_math(precision) if params["dtype"] == "float32" else "ieee"
    problem = Problem(N=call.N, H=call.H, W=call.W, P=call.P, Q=call.Q, device=_target(input, device),
                      transient=bool(_local.transient))
    return select.ranked(params, device, problem, call.channels_last, math, family=family, tiles=tiles,
                         every=every), call


def _target(input: torch.Tensor, device: str) -> "Device | None":
    """The GPU a plan is for: the input's, else (meta planning, e.g. `kernelgen warm`) the
    innermost `planning_for` GPU or the current one; None on CPU or when neither is known."""
    if device != "cuda":
        return None
    if input.is_cuda:
        return _gpu(input.device.index)
    if _planning_targets:
        return _planning_targets[-1]
    if torch.cuda.is_available():
        return _gpu(torch.cuda.current_device())
    return None


def _signature_json(sig: tuple, arch: str) -> list:
    """The in-process signature as JSON-able values (device index replaced by its arch)."""
    def js(v):
        if isinstance(v, (tuple, list, torch.Size)):
            return [js(e) for e in v]
        if isinstance(v, (torch.dtype, torch.device)):
            return str(v) if isinstance(v, torch.dtype) else v.type
        return v
    return [js(v) for v in sig]


def _record_name(sig: tuple, input: torch.Tensor) -> str:
    """The plan record of a call signature on the input's device (plans.py): keyed by the GPU's
    model and target, so a choice measured on one GPU is not served on another."""
    if input.is_cuda:
        gpu = _gpu(input.device.index)
        return plans.record_name(_signature_json(sig, gpu.arch), gpu.arch, gpu.key)
    return plans.record_name(_signature_json(sig, "cpu"), "cpu", "cpu")


def _make_plan(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, sig,
               activation=None, residual=None, scale=None) -> Plan:
    device = input.device.type if isinstance(input, torch.Tensor) else None
    record_name, record = None, None
    if sig is not None and device in ("cuda", "cpu") and input.numel() > 0:
        arch = _gpu(input.device.index).arch if device == "cuda" else "cpu"
        record_name = _record_name(sig, input)
        cache = _default_cache()
        record = plans.read(cache.root, record_name)
        if record is not None:
            try:
                launch = load_entry(record["key"], cache, expect=_runtime_fields(device, arch))
                if launch is not None and plans.fits(record, entry_spec(record["key"]), input, weight, bias, stride,
                                                     padding, dilation, groups, activation, residual, scale):
                    log.debug("plan for conv2d(input %s, weight %s): %s (from its plan record)",
                              tuple(input.shape), tuple(weight.shape), record.get("summary"))
                    return _plan(launch, record["key"], record["call"], record["prep"], input, weight, bias,
                                 residual)
            except (KeyError, TypeError, ValueError):  # a damaged record: the full path rewrites it
                record = None
    spec, call = spec_for(input, weight, bias, stride, padding, dilation, groups, precision=precision,
                          family=family, tiles=tiles, activation=activation, residual=residual, scale=scale)
    if spec is None:  # nothing to compute (an empty batch, meta tensors): F.conv2d returns NCHW there
        return _plan(None, None, _call_fields(dataclasses.replace(call, channels_last=False)), "any", input,
                     weight, bias)
    tuned = _tuned_spec(record, spec, input) if family is None and tiles is None else None
    if tuned is not None:  # measured on this GPU before, its kernel since pruned: build it again
        spec = tuned
    elif (record_name is not None and family is None and tiles is None and config.tune()
          and not (device == "cuda" and torch.cuda.is_current_stream_capturing())):
        from .tuner import tune  # KERNELGEN_TUNE: measure the candidates now; tune writes the record

        tune(input, weight, bias, stride, padding, dilation, groups, precision=precision, activation=activation,
             residual=residual, scale=scale)
        record = plans.read(_default_cache().root, record_name)
        tuned = _tuned_spec(record, spec, input)
        spec = tuned or spec
    return _build_plan(spec, call, input, weight, bias, stride, padding, dilation, groups, precision, family,
                       record_name, record if tuned is not None else None, activation, residual, scale)


def _tuned_spec(record: dict | None, untuned: "ConvSpec", input: torch.Tensor) -> "ConvSpec | None":
    """The spec a plan record says was measured fastest for this call, where it still describes
    the same convolution as the selector's and its family can run it here; else None."""
    if not record or not isinstance(record.get("tuned"), dict):
        return None
    from .errors import KernelgenError, Unsupported
    from .families import get_family
    from .spec import ConvSpec

    try:
        spec = ConvSpec.from_dict(json.loads(record["tuned"]["spec"]))
        same = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "dtype",
                "bias", "device", "activation", "residual", "scale")
        if any(getattr(spec, f) != getattr(untuned, f) for f in same):
            return None
        get_family(spec.family).check(spec, _gpu(input.device.index) if input.is_cuda else None)
        return spec
    except (KernelgenError, Unsupported, KeyError, TypeError, ValueError):
        return None


def _build_plan(spec, call, input, weight, bias, stride, padding, dilation, groups, precision, family,
                record_name, tuned_record, activation=None, residual=None, scale=None) -> Plan:
    """Load or build `spec`'s kernel, record the plan (keeping a tuned record's measurements) and
    return it."""
    from .errors import CompileError
    from .toolchain import current

    device = input.device.type
    toolchain = current("cpu") if device == "cpu" else current("cuda", _gpu(input.device.index).arch)
    fell_back = False
    compiles, start = stats()["compiles"], time.perf_counter()
    try:
        launch, key = load_kernel(spec, toolchain)
    except CompileError:
        if family is not None or spec.family == "direct" or device != "cuda":
            raise
        # A fast family that fails to build is a kernelgen bug; the general family still
        # computes the right answer, so say so loudly, count it, and carry on.
        log.warning("kernelgen: family %s failed to build for %s; using the direct family instead",
                    spec.family, spec.summary(), exc_info=True)
        count("fallbacks")
        fell_back = True
        spec, call = spec_for(input, weight, bias, stride, padding, dilation, groups, precision=precision,
                              family="direct", activation=activation, residual=residual, scale=scale)
        launch, key = load_kernel(spec, toolchain)
    why = ("forced by the call" if family is not None else "the direct family, after the chosen one failed to build"
           if fell_back else "measured fastest on this GPU" if tuned_record is not None else "the selector's choice")
    _log_plan(spec, input, weight, why, stats()["compiles"] > compiles, time.perf_counter() - start)
    cache = _default_cache()
    prep = _prep_name(spec)
    call_fields = _call_fields(call)
    # No record after a fallback: each process should try (and report) the fast family again.
    if record_name is not None and cache.writable and not fell_back:
        record = {"key": key, "call": call_fields, "prep": prep, "summary": spec.summary()}
        if tuned_record is not None:
            record["tuned"] = tuned_record["tuned"]
        plans.write(cache.root, record_name, record)
    return _plan(launch, key, call_fields, prep, input, weight, bias, residual)


_compiled_before = False  # whether this process has compiled a kernel for a call yet


def _log_plan(spec: "ConvSpec", input: torch.Tensor, weight: torch.Tensor, why: str, compiled: bool,
              seconds: float) -> None:
    """Say what a new call signature got: the kernel (family and tiles) and why, at DEBUG; where it
    compiled, that and how long the call waited, at INFO, or at WARNING the first time in a process,
    since that is the unexplained pause a user sees and `kernelgen warm` is what avoids it."""
    global _compiled_before
    shapes = f"input {tuple(input.shape)} {str(input.dtype)[6:]}, weight {tuple(weight.shape)}"
    if not compiled:
        log.debug("plan for conv2d(%s): %s (%s; kernel loaded, not compiled)", shapes, spec.summary(), why)
    elif not _compiled_before:
        _compiled_before = True
        log.warning("kernelgen compiled a kernel for a new conv2d shape (%s) in %.1f s: %s (%s). Each new shape "
                    "compiles once and is cached on disk; `kernelgen warm` compiles ahead of time. Later compiles "
                    "are logged at INFO (logger 'kernelgen', or TORCH_LOGS=+kernelgen).", shapes, seconds,
                    spec.summary(), why)
    else:
        log.info("compiled conv2d(%s) in %.1f s: %s (%s)", shapes, seconds, spec.summary(), why)


def _call_fields(call: "Call") -> list:
    """What a plan (and its record on disk) keeps of a validated call."""
    return [call.unbatched, call.N, call.K, call.P, call.Q, call.H, call.W, call.channels_last, call.sample]


def _prep_name(spec: "ConvSpec") -> str:
    """The input preparation (a key of _PREP) the spec's kernel needs."""
    from .families import get_family

    if spec.layout == "nchw" and get_family(spec.family).aligned_input:
        return "nchw_aligned"
    return spec.layout


_runtime: dict[tuple[str, str], dict] = {}


def _runtime_fields(device: str, arch: str) -> dict:
    """The toolchain fields a served entry must show, known without building a Toolchain."""
    fields = _runtime.get((device, arch))
    if fields is None:
        import sys

        from ._version import __version__

        fields = _runtime[(device, arch)] = {
            "kernelgen": __version__, "python": sys.implementation.cache_tag, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda or "", "device": device}
        if device == "cuda":
            fields["arch"] = arch
    return fields


def _default_cache():
    from .kernels import default_cache

    return default_cache()


def _contiguous_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a new NCHW-contiguous tensor of `shape` (a size 0 counts as 1)."""
    N, C, H, W = shape
    sw = 1
    sh = sw * max(W, 1)
    sc = sh * max(H, 1)
    return (sc * max(C, 1), sc, sh, sw)


def _channels_last_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a new channels_last tensor of `shape` (plain products, as torch's)."""
    N, C, H, W = shape
    return (C * W * H, 1, C * W, C)


def _input_strides(input: torch.Tensor, unbatched: bool, prep: int) -> tuple[int, ...]:
    """The strides of the 4-D input a kernel is handed: `input` (unsqueezed if unbatched),
    made contiguous in NCHW (prep 1 or 3) or channels_last (prep 2) when it is not already
    (both: the dense strides of that format, size-1 dimensions included).

    Computed from sizes and strides, as torch computes them, rather than by running
    unsqueeze/contiguous on meta tensors: the first meta tensor of a process costs more
    than the rest of a warm call's planning.
    """
    x = input.unsqueeze(0) if unbatched else input  # a view: no copy, no allocation
    # Dense in torch's sense ignores the stride of a dimension of size 1 (a channel slice at batch 1
    # keeps its parent's batch stride): the tensor is used as it is, but the kernel is handed the
    # dense strides it checks for, which address the same elements.
    if prep in (1, 3):
        return _contiguous_strides(x.shape)
    if prep == 2:
        return _channels_last_strides(x.shape)
    return x.stride()


def _weight_strides(weight: torch.Tensor) -> tuple[bool, tuple[int, ...]]:
    """(as_is, strides): kernels read a weight through its strides (KgW in abi.cuh) when
    every offset in it fits 32 bits (any layout: OIHW, channels_last, a slice, an expand);
    another weight is copied to contiguous OIHW first, and the strides are that copy's."""
    strides = weight.stride()
    if sum((n - 1) * s for n, s in zip(weight.shape, strides)) < 1 << 31:
        return True, strides
    return False, _contiguous_strides(weight.shape)


def _plan(launch, key, call_fields, layout, input, weight, bias, residual=None) -> Plan:
    """Precompute a plan's launch arguments from the call's sizes and the tensors' strides."""
    unbatched, N, K, P, Q, H, W, channels_last, sample = call_fields
    fmt = _CL if channels_last else _CF
    prep = _PREP[layout]
    if launch is None:
        return Plan(None, (N, K, P, Q), fmt, unbatched, prep, True, True, (), key)
    if sample:  # (a record on disk holds it as a list)
        sample = (int(sample[0]), int(sample[1]))
        input = input[..., ::sample[0], ::sample[1]]
    xs = _input_strides(input, unbatched, prep)
    ys = (_channels_last_strides if channels_last else _contiguous_strides)((N, K, P, Q))
    w_asis, wst = _weight_strides(weight)
    dev = input.device.index if input.is_cuda else -1
    family = (entry_spec(key) or {}).get("family", "unknown")
    # The kernel reads the residual at the output's offsets: as it lies where its strides are the
    # output's (a dimension of one element excepted), else a copy that has them (_run).
    r_asis = residual is None or all(
        n == 1 or s == t for n, s, t in zip((N, K, P, Q), (residual.unsqueeze(0) if unbatched else residual).stride(),
                                            ys))
    return Plan(launch, (N, K, P, Q), fmt, unbatched, prep, w_asis,
                bias is None or bias.is_contiguous(), (N, H, W, P, Q, *xs, *ys, *wst, dev), key,
                workspace_bytes(key, input.numel(), N * K * P * Q), sample, f"kernelgen::conv2d[{family}]",
                packed_bytes(key), config.pack_once(), r_asis)


def _run(plan: Plan, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor | None = None, residual: torch.Tensor | None = None, alpha: int = 0,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch `plan` on the call's tensors; into `out` (of the plan's shape and format) where given.
    `residual`, `alpha` (a float's 32 bits) and `scale` (contiguous float32): the epilogue's, for a
    plan whose kernel has one."""
    y = torch.empty(plan.out_shape, dtype=input.dtype, device=input.device, memory_format=plan.fmt) \
        if out is None else out
    if plan.launch is not None:
        if plan.squeeze:  # (as _input_strides sees it: 4-D, so a channels_last preparation applies)
            input = input.unsqueeze(0)
        if plan.sample is not None:
            input = input[..., ::plan.sample[0], ::plan.sample[1]]
        prep = plan.prep
        x = input if prep == 0 else input.contiguous(memory_format=_CL) if prep == 2 else input.contiguous()
        if prep == 3 and x.data_ptr() % 16:  # a view between two 16-byte boundaries: a dense copy from one
            x = x.clone()
        w = weight if plan.w_asis else weight.contiguous()
        # (each copy stays bound to a name until the launch: a temporary freed before it could be
        # handed to the workspace below, or reused by the host's heap, and read as the bias)
        b = bias if bias is None or plan.b_contig else bias.contiguous()
        r = residual
        if r is not None and not plan.r_asis:  # a copy with the output's strides
            r = torch.empty_like(y).copy_(r.unsqueeze(0) if plan.squeeze else r)
        if input.is_cuda:
            dev = plan.args[-1]
            stream = _raw_stream(dev) if _raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream
        else:
            stream = 0
        # Scratch from the caching allocator on this stream, so its reuse stays stream-ordered.
        ws = torch.empty(plan.ws, dtype=torch.uint8, device=input.device) if plan.ws else None
        pack, ready, wp = None, False, None
        if plan.packed:  # the weights as the kernel packs them: kept with the weight (packs.py), or this call's
            if plan.pack_once and not _local.transient:
                pack, ready = packs.lookup(weight, plan.key, plan.packed, stream)
            wp = pack.buf if pack is not None else torch.empty(plan.packed, dtype=torch.uint8, device=input.device)
        did_pack = plan.launch(x.data_ptr(), w.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), *plan.args,
                               stream, 0 if ws is None else ws.data_ptr(), 0 if wp is None else wp.data_ptr(), ready,
                               0 if r is None else r.data_ptr(), alpha, 0 if scale is None else scale.data_ptr())
        if did_pack and pack is not None:
            packs.packed(pack, weight, stream)
    return y.squeeze(0) if plan.squeeze else y


@functools.lru_cache(maxsize=None)
def _autograd() -> type:
    """The autograd Function of a call whose tensors require grad: its backward computes the
    gradients with kernelgen's own forward kernels (gradients.backward), only those autograd needs.
    A call without an activation saves its input and weight; with one, also its output, or the
    bias and residual that recompute the pre-activation (gradients.from_output says which).

    Defined on first use: creating an autograd.Function subclass (torch makes a second
    class for its backward node) costs a process ~0.1 ms, which an inference process, or
    a warm start, need not pay at import.
    """

    class _Conv2d(torch.autograd.Function):
        @staticmethod
        def forward(ctx, plan, params, input, weight, bias, residual=None, alpha=0, scale=None):  # type: ignore[override]
            # stride, padding, dilation, groups, precision, family, tiles, activation, negative_slope: as given
            from .gradients import to_save

            ctx.params = params
            y = _run(plan, input, weight, bias, residual=residual, alpha=alpha, scale=scale)
            ctx.save_for_backward(*to_save(params[7], params[8], input, weight, y, bias, residual, scale))
            return y

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            from .gradients import backward

            input, weight, *epilogue = ctx.saved_tensors
            output, bias, residual, scale = epilogue or (None, None, None, None)
            stride, padding, dilation, groups, precision, family, tiles, activation, negative_slope = ctx.params
            needs = (tuple(ctx.needs_input_grad[2:6]) + (False,) * 4)[:4]  # (residual: where it was given)
            grads = backward(grad, input, weight, needs, stride, padding, dilation, groups, precision, activation,
                             negative_slope, output=output, bias=bias, residual=residual, family=family, tiles=tiles,
                             scale=scale)
            return (None, None, *grads, None, None)

    return _Conv2d


def clear_plans() -> None:
    """Forget memoised call plans (kernels stay loaded)."""
    _plans.clear()
