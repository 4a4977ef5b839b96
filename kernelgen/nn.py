"""`kernelgen.Conv2d`: torch.nn.Conv2d whose forward runs kernelgen's kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .functional import conv2d

# torch.fx.symbolic_trace records a call of this module's conv2d as one node rather than tracing
# into it (its checks and plan lookups cannot take proxies).
torch.fx.wrap("conv2d")


# The float32 per-output-channel scale a 16-bit conv keeps of its folded BatchNorm (a persistent buffer,
# so state_dict carries it; kernelgen.convert(fold_bn=True)), which forward passes to conv2d as `scale`.
BN_SCALE = "bn_scale"

SCRIPT_ERROR = (
    "torch.jit.script cannot compile kernelgen.Conv2d: its forward chooses and launches JIT-compiled kernels in "
    "Python. Use torch.jit.trace (the traced graph calls the operator kernelgen::conv2d; `import kernelgen` before "
    "loading it), or kernelgen.revert(model) to turn kernelgen layers back into torch.nn.Conv2d before scripting.")


class Conv2d(torch.nn.Conv2d):
    """A drop-in for torch.nn.Conv2d: same constructor, parameters and state_dict.

    Only the forward differs: it calls `kernelgen.conv2d`. Non-'zeros' padding modes
    pad with F.pad first, exactly as torch.nn.Conv2d does. It also takes conv2d's epilogue as
    keyword arguments: `layer(x, activation="relu", residual=r)` is relu(layer(x) + r).

    precision: None (follow torch's TF32 setting), 'ieee' or 'tf32'; keyword-only.
    """

    def __init__(self, *args, precision: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.precision = precision

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling it: the one place to say
        # what to do instead of TorchScript's error about keyword-only arguments deep in conv2d.
        raise RuntimeError(SCRIPT_ERROR)

    def forward(self, input: torch.Tensor, *, activation: str | None = None, negative_slope: float = 0.01,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution, and with `activation` or `residual` (kernelgen.conv2d's epilogue, which
        `kernelgen.convert(..., fuse=True)` passes) activation(conv + residual) in the same kernel."""
        padding = self.padding
        if self.padding_mode != "zeros":
            input, padding = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode), 0
        scale = self._buffers.get(BN_SCALE)
        if activation is None and residual is None and scale is None:
            return conv2d(input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                          precision=self.precision)
        return conv2d(input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                      precision=self.precision, activation=activation, negative_slope=negative_slope,
                      residual=residual, scale=scale)
