"""The one object that says what a kernel computes: `ConvSpec`.

Its constructor canonicalises every parameter (`3` becomes `(3, 3)`, `torch.float16`
becomes `"float16"`, `padding="same"` becomes explicit begin/end pads) and raises a
`ConvArgumentError` (a ValueError) or `TypeError` naming the field and what is
allowed. The same object feeds the template context and the cache key, so nothing
can reach a binary without being part of its key.

Runtime sizes (batch, height, width) are deliberately *not* in the spec: one compiled
kernel serves every input size. They travel in `Problem`.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConvArgumentError

DTYPES = ("float32", "float16", "bfloat16", "float64")
DEVICES = ("cuda", "cpu")
LAYOUTS = ("any", "nchw", "nhwc")
MATHS = ("ieee", "tf32")
# The activations a kernel's epilogue applies after the bias and the residual (torch's semantics:
# gelu is F.gelu's exact erf form, leaky_relu takes its slope at run time, as KgArgs.alpha).
ACTIVATIONS = ("relu", "relu6", "leaky_relu", "silu", "gelu", "hardswish", "hardsigmoid", "sigmoid")

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
SCALAR_T = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double"}
ACC_T = {"float32": "float", "float16": "float", "bfloat16": "float", "float64": "double"}

# Every spec integer is rendered into C++ as an `int` (templates' constexpr constants), and so
# are the few products of them the templates form (a dilated kernel's extent, the reduction
# length): all of them stay at or below INT_MAX. Python ints beyond int64 are refused as torch
# refuses them (its argument parser unpacks a long long).
INT_MAX = 2**31 - 1
_INT64 = 2**63


def index(value: Any) -> int | None:
    """`value` as an int where F.conv2d takes it as one: an int, a numpy integer, a one-element
    integer tensor (anything with __index__); None for anything else. Bools (and bool tensors)
    are None too: bool is an int in Python, but `stride=True` is a bug, not a stride."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int(name: str, value: Any) -> int:
    v = index(value)
    if v is None:
        raise TypeError(f"{name} must be an int or a tuple of ints, got {value!r} ({type(value).__name__})")
    if not -_INT64 <= v < _INT64:
        raise ConvArgumentError(f"Overflow when unpacking long long: {name}={v} does not fit 64 bits")
    return v


def bounded(name: str, value: int, limit: int = INT_MAX) -> int:
    """`value`, after checking it is at most `limit` (what a C++ int in the templates holds)."""
    if value > limit:
        raise ConvArgumentError(f"{name}={value} is larger than kernelgen's kernels take (at most {limit}: "
                                f"they compute in 32-bit ints)")
    return value


def pair(name: str, value: Any) -> tuple[int, int]:
    """An int or a sequence of one or two ints as (h, w), with F.conv2d's errors."""
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            value = (value[0], value[0])
        if len(value) != 2:
            raise ConvArgumentError(f"expected {name} to be a single integer value or a list of 2 values "
                                    f"to match the convolution dimensions, but got {name}={list(value)!r}")
        return _int(name, value[0]), _int(name, value[1])
    v = _int(name, value)
    return v, v


def canonical_dtype(dtype: Any) -> str:
    """'float32' for torch.float32, 'float32' or 'torch.float32'; TypeError otherwise."""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    aliases = {"float": "float32", "half": "float16", "double": "float64"}
    text = aliases.get(text, text)
    if text not in DTYPES:
        raise TypeError(f"kernelgen computes convolutions in {', '.join(DTYPES)}; got dtype {dtype}")
    return text


def resolve_padding(padding: Any, kernel: tuple[int, int], stride: tuple[int, int],
                    dilation: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) as F.conv2d applies it.

    'same' pads d*(k-1) in total, the smaller half before: torch pads even kernels
    one more at the end, and so do we.
    """
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ConvArgumentError("padding='same' is not supported for strided convolutions")
            pads = []
            for k, d in zip(kernel, dilation):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return tuple(pads)  # type: ignore[return-value]
        raise ConvArgumentError(f"Invalid padding string '{padding}', should be one of ['valid', 'same']")
    ph, pw = pair("padding", padding)
    if ph < 0 or pw < 0:
        raise ConvArgumentError(f"negative padding is not supported, got padding={padding!r}")
    return (ph, ph, pw, pw)


@dataclass(frozen=True)
class Problem:
    """Runtime sizes of one call: batch, input height/width, output height/width, and the GPU the
    kernel will run on (kernelgen.device.Device; None on the CPU or where no GPU is known).
    `transient`: the call's weight is its own (a gradient's operand: functional.transient_weights),
    so a kernel that packs its weights packs them on every call, and the selector counts that."""

    N: int
    H: int
    W: int
    P: int
    Q: int
    device: Any = None
    transient: bool = False

    @property
    def arch(self) -> str:
        """The CUDA target the kernel is for ('sm_90a', ...), '' where none is known."""
        return self.device.arch if self.device is not None else ""


@dataclass(frozen=True)
class ConvSpec:
    """A fully specified convolution kernel.

    in_channels/out_channels/groups: channels of input and output, and groups
        (depthwise with multiplier m: groups = in_channels, out_channels = m * in_channels).
    kernel_size, stride, dilation: ints or pairs, stored as (h, w).
    padding: int, pair, 'same' or 'valid', stored as (top, bottom, left, right).
    dtype: float32, float16, bfloat16 or float64 (a torch.dtype or its name).
    device: 'cuda' or 'cpu'.
    bias: whether a bias vector is added.
    layout: memory layout the kernel is handed: 'any' (strided), 'nchw', 'nhwc'.
    math: 'ieee' (exact float32 or wider) or 'tf32' (TF32 tensor-core products).
    family: the template family (see kernelgen.families).
    tiles: the family's tile parameters (name -> value); unnamed ones take their first allowed value.
    activation: the epilogue's activation, 'none' or one of ACTIVATIONS (None means 'none').
    residual: whether the epilogue adds a residual tensor of the output's shape (before the
        activation, after the bias): y = activation(conv + bias + residual), rounded once.
    scale: whether the epilogue multiplies each output channel's accumulator by a float32 scale
        (a folded BatchNorm's) before the bias: y = activation(scale[k] * conv + bias + residual).
    """

    in_channels: int
    out_channels: int
    kernel_size: Any
    stride: Any = 1
    padding: Any = 0
    dilation: Any = 1
    groups: int = 1
    dtype: Any = "float32"
    device: str = "cuda"
    bias: bool = False
    layout: str = "any"
    math: str = "ieee"
    family: str = "direct"
    tiles: Any = field(default_factory=tuple)
    activation: Any = "none"
    residual: bool = False
    scale: bool = False

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        kernel = pair("kernel_size", self.kernel_size)
        stride = pair("stride", self.stride)
        dilation = pair("dilation", self.dilation)
        if min(kernel) <= 0:
            raise ConvArgumentError(f"kernel size must be positive, got kernel_size={kernel}")
        if min(stride) <= 0:
            raise ConvArgumentError(f"non-positive stride is not supported, got stride={stride}")
        if min(dilation) <= 0:
            raise ConvArgumentError(f"dilation should be greater than zero, got dilation={dilation}")
        put("kernel_size", kernel)
        put("stride", stride)
        put("dilation", dilation)
        if isinstance(self.padding, tuple) and len(self.padding) == 4 and all(
                isinstance(p, int) and not isinstance(p, bool) for p in self.padding):
            padding = self.padding  # already canonical (e.g. from from_json)
            if min(padding) < 0:
                raise ConvArgumentError(f"negative padding is not supported, got padding={padding}")
        else:
            padding = resolve_padding(self.padding, kernel, stride, dilation)
        put("padding", tuple(padding))

        cin = _int("in_channels", self.in_channels)
        cout = _int("out_channels", self.out_channels)
        groups = _int("groups", self.groups)
        if groups <= 0:
            raise ConvArgumentError(f"non-positive groups is not supported, got groups={groups}")
        if cin <= 0 or cout <= 0:
            raise ConvArgumentError(f"in_channels and out_channels must be positive, got {cin} and {cout}")
        if cin % groups:
            raise ConvArgumentError(f"groups={groups} does not divide in_channels={cin}")
        if cout % groups:
            raise ConvArgumentError(f"groups={groups} does not divide out_channels={cout}")
        put("in_channels", cin)
        put("out_channels", cout)
        put("groups", groups)
        self._bound()

        put("dtype", canonical_dtype(self.dtype))
        for name, allowed in (("device", DEVICES), ("layout", LAYOUTS), ("math", MATHS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConvArgumentError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.math == "tf32" and self.dtype != "float32":
            raise ConvArgumentError(f"math='tf32' applies to float32 only, not {self.dtype}")
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be True or False, got {self.bias!r}")
        if self.activation is None:
            put("activation", "none")
        if not isinstance(self.activation, str) or self.activation not in ("none",) + ACTIVATIONS:
            raise ConvArgumentError(f"activation must be None or one of {list(ACTIVATIONS)}, got {self.activation!r}")
        if not isinstance(self.residual, bool):
            raise TypeError(f"residual must be True or False, got {self.residual!r}")
        if not isinstance(self.scale, bool):
            raise TypeError(f"scale must be True or False, got {self.scale!r}")

        from .families import get_family  # the registry imports this module's types only

        family = get_family(self.family)  # raises naming the known families
        put("tiles", _canonical_tiles(family.name, family.tiles, self.tiles))

    def _bound(self) -> None:
        """Every integer the templates see, and the products of them they form, fit a C++ int."""
        for name in ("kernel_size", "stride", "dilation", "padding"):
            for v in getattr(self, name):
                bounded(name, v)
        for name in ("in_channels", "out_channels", "groups"):
            bounded(name, getattr(self, name))
        (kh, kw), (dh, dw) = self.kernel_size, self.dilation
        bounded("the dilated kernel's height dilation*(kernel_size-1)+1", dh * (kh - 1) + 1)
        bounded("the dilated kernel's width dilation*(kernel_size-1)+1", dw * (kw - 1) + 1)
        top, bottom, left, right = self.padding
        bounded("padding top+bottom", top + bottom)
        bounded("padding left+right", left + right)
        bounded("the reduction length in_channels/groups*kH*kW", self.cin_per_group * kh * kw)

    # -- derived values ---------------------------------------------------------------
    @property
    def epilogue(self) -> bool:
        """Whether the kernel applies anything to the accumulator but the bias (a scale, an
        activation, a residual)."""
        return self.activation != "none" or self.residual or self.scale

    @property
    def cin_per_group(self) -> int:
        return self.in_channels // self.groups

    @property
    def cout_per_group(self) -> int:
        return self.out_channels // self.groups

    def output_size(self, H: int, W: int) -> tuple[int, int]:
        """Output height and width for an input of H x W (may be <= 0 if too small)."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        top, bottom, left, right = self.padding
        P = (H + top + bottom - dh * (kh - 1) - 1) // sh + 1
        Q = (W + left + right - dw * (kw - 1) - 1) // sw + 1
        return P, Q

    # -- views for the template, the key and people -------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tiles"] = dict(self.tiles)
        # The epilogue's fields are left out at their defaults: a spec without one keeps the JSON,
        # and so the cache key, it had before they existed.
        for name, default in _LATER_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace. Equal specs give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ConvSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConvArgumentError(f"unknown spec field(s) {unknown}; known fields are {sorted(known)}")
        d = dict(d)
        for name in ("kernel_size", "stride", "dilation", "padding"):
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
        if isinstance(d.get("tiles"), Mapping):
            d["tiles"] = tuple(d["tiles"].items())
        return cls(**d)

    def replace(self, **changes: Any) -> "ConvSpec":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        tiles = ",".join(f"{k}={v}" for k, v in self.tiles)
        return (f"{self.family}[{tiles}] {self.device} {self.dtype}/{self.math} {self.layout} "
                f"{self.in_channels}->{self.out_channels} g{self.groups} k{kh}x{kw} s{sh}x{sw} "
                f"p{','.join(map(str, self.padding))} d{dh}x{dw}{' +bias' if self.bias else ''}"
                f"{' +scale' if self.scale else ''}{' +residual' if self.residual else ''}{' +' + self.activation if self.activation != 'none' else ''}")

    def template_context(self) -> dict[str, Any]:
        """UPPERCASE compile-time constants: only validated ints, bools and enum members."""
        from .families import get_family

        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        ctx: dict[str, Any] = {
            "FAMILY": self.family, "DEVICE": self.device, "DTYPE": self.dtype,
            "SCALAR_T": SCALAR_T[self.dtype], "ACC_T": ACC_T[self.dtype], "MATH": self.math,
            "CIN": self.in_channels, "COUT": self.out_channels, "GROUPS": self.groups,
            "CIN_G": self.cin_per_group, "COUT_G": self.cout_per_group,
            "KH": kh, "KW": kw, "SH": sh, "SW": sw, "DH": dh, "DW": dw,
            "PH": self.padding[0], "PW": self.padding[2],
            "HAS_BIAS": self.bias, "LAYOUT": self.layout,
            # the epilogue (templates/common/epilogue.cuh.j2): ACT a member of ACTIVATIONS or 'none'
            "ACT": self.activation, "HAS_RESIDUAL": self.residual, "EPILOGUE": self.epilogue,
            "HAS_SCALE": self.scale,  # the accumulator times a float32 per-channel scale, before the bias
            "WORKSPACE_BYTES": 0,  # a family that needs device scratch memory says how much,
            "WORKSPACE_PER_INPUT": 0,  # and how many bytes more for each element of the input
            "WORKSPACE_PER_OUTPUT": 0,  # and of the output
            "PACKED_BYTES": 0,  # a family that packs its weights: the bytes kept with a weight for them
        }
        ctx.update({name.upper(): value for name, value in self.tiles})
        ctx.update(get_family(self.family).context(self))
        return ctx


# Fields added after specs were first keyed, with the defaults to_dict leaves out.
_LATER_DEFAULTS = {"activation": "none", "residual": False, "scale": False}


def _canonical_tiles(family: str, space: Mapping[str, tuple[int, ...]], tiles: Any) -> tuple[tuple[str, int], ...]:
    items = dict(tiles.items() if isinstance(tiles, Mapping) else tiles)
    unknown = sorted(set(items) - set(space))
    if unknown:
        raise ConvArgumentError(f"family {family!r} has no tile parameter(s) {unknown}; "
                                f"its tile parameters are {sorted(space)}")
    out = []
    for name in sorted(space):
        # An unnamed tile parameter takes its first allowed value (the selector always names all).
        value = _int(f"tiles[{name!r}]", items.get(name, space[name][0]))
        if value not in space[name]:
            raise ConvArgumentError(f"tiles[{name!r}]={value} is not allowed for family {family!r}; "
                                    f"choose one of {list(space[name])}")
        out.append((name, value))
    return tuple(out)
