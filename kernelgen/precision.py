"""Which float32 math a convolution may use: exact IEEE float32 or TF32 tensor cores.

Policy: kernelgen follows torch's own setting for convolutions unless a call says
otherwise (`precision='ieee'` or `'tf32'`). torch's setting is read, most specific
first, from `torch.backends.cudnn.conv.fp32_precision`, then
`torch.backends.cudnn.fp32_precision`, then `torch.backends.fp32_precision` (the
first that says 'ieee' or 'tf32' wins; 'none' defers to the next), and where none
decides (or on a torch without them), `torch.backends.cudnn.allow_tf32`.
PyTorch's default lets convolutions use TF32, so kernelgen's does too.

float16, bfloat16 and float64 are unaffected (their math is fixed by the dtype).
"""

from __future__ import annotations

PRECISIONS = ("ieee", "tf32")


def check_override(precision: str | None) -> str | None:
    if precision is None or precision in PRECISIONS:
        return precision
    raise ValueError(f"precision must be None (follow torch), 'ieee' or 'tf32', got {precision!r}")


def torch_fp32_conv_math() -> str:
    """'tf32' or 'ieee', as torch's convolution setting says now."""
    import torch

    backends = torch.backends
    for owner in (getattr(getattr(backends, "cudnn", None), "conv", None), getattr(backends, "cudnn", None), backends):
        value = getattr(owner, "fp32_precision", None) if owner is not None else None
        if value in PRECISIONS:
            return value
    try:
        return "tf32" if backends.cudnn.allow_tf32 else "ieee"
    except RuntimeError:  # torch refuses to answer when legacy and new flags were mixed
        return "tf32"


def fp32_math(precision: str | None) -> str:
    """The math for a float32 call: the override if given, else torch's setting."""
    return check_override(precision) or torch_fp32_conv_math()
