"""The fused epilogue's reference: torch's activations, with hardswish and hardsigmoid written out.

torch multiplies by `1.0f / 6.0f` (a float32 constant) even in float64, 3e-8 off relative; kernelgen
divides by 6 in the accumulator's precision, so a float64 reference divides by 6 too.
"""
import torch
import torch.nn.functional as F


def _hardsigmoid(y: torch.Tensor) -> torch.Tensor:
    return (y + 3).clamp(0, 6) / 6


ACTS = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "gelu": F.gelu,
        "hardswish": lambda y: y * _hardsigmoid(y), "hardsigmoid": _hardsigmoid, "sigmoid": torch.sigmoid}


def activate(y: torch.Tensor, activation: str | None, negative_slope: float = 0.01) -> torch.Tensor:
    """`activation` (a member of kernelgen.ACTIVATIONS, or None) applied to y, in y's dtype."""
    if activation == "leaky_relu":
        return F.leaky_relu(y, negative_slope)
    return y if activation is None else ACTS[activation](y)
