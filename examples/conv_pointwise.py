"""KernelBench level 1, problem 87: pointwise (1x1) 2D convolution, served by kernelgen.

`Model` and the test code under it are the problem's own text
(KernelBench/level1/87_conv_pointwise_2D.py); `ModelNew` is the same module with its
convolution compiled by kernelgen. Run from the repository root:

    python examples/conv_pointwise.py [--precision ieee|tf32|bf16] [--device cpu]
"""

import torch
import torch.nn as nn

import kernelgen

KERNELBENCH_PROBLEM = 87


class Model(nn.Module):
    """
    Performs a pointwise 2D convolution operation.

    Args:
        in_channels (int): Number of channels in the input tensor.
        out_channels (int): Number of channels produced by the convolution.
        bias (bool, optional): If `True`, adds a learnable bias to the output. Defaults to `False`.
    """
    def __init__(self, in_channels: int, out_channels: int, bias: bool = False):
        super(Model, self).__init__()
        self.conv1d = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0, bias=bias)
        
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Performs the pointwise 2D convolution.

        Args:
            x (torch.Tensor): Input tensor of shape (batch_size, in_channels, height, width).

        Returns:
            torch.Tensor: Output tensor of shape (batch_size, out_channels, height, width).
        """
        return self.conv1d(x)

# Test code
batch_size = 16
in_channels = 64
out_channels = 128
width = 1024
height = 1024

def get_inputs():
    x = torch.rand(batch_size, in_channels, height, width)
    return [x]

def get_init_inputs():
    return [in_channels, out_channels]


class ModelNew(nn.Module):
    """Model, with the convolution compiled by kernelgen.

    The attribute keeps the problem's name, `conv1d` (a misnomer for a 1x1 Conv2d), so
    that state_dicts load both ways.
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = False):
        super().__init__()
        self.conv1d = kernelgen.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv1d(x)


if __name__ == "__main__":
    import sys

    import _harness

    sys.exit(_harness.main(sys.modules[__name__]))
