"""KernelBench level 1, problem 83: depthwise 2D convolution, 3x1 kernel, 512x512 input, served by kernelgen.

`Model` and the test code under it are the problem's own text
(KernelBench/level1/83_conv_depthwise_2D_square_input_asymmetric_kernel.py);
`ModelNew` is the same module with its convolution compiled by kernelgen. Run from the
repository root:

    python examples/conv_depthwise_kx1.py [--precision ieee|tf32|bf16] [--device cpu]
"""

import torch
import torch.nn as nn

import kernelgen

KERNELBENCH_PROBLEM = 83


class Model(nn.Module):
    """
    Performs a depthwise 2D convolution with a square input and an asymmetric kernel.

    Args:
        in_channels (int): Number of channels in the input tensor.
        kernel_size (int): Size of the convolution kernel.
        stride (int, optional): Stride of the convolution. Defaults to 1.
        padding (int, optional): Padding applied to the input. Defaults to 0.
        dilation (int, optional): Spacing between kernel elements. Defaults to 1.
        bias (bool, optional): If `True`, adds a learnable bias to the output. Defaults to `False`.
    """
    def __init__(self, in_channels: int, kernel_size: int, stride: int = 1, padding: int = 0, dilation: int = 1, bias: bool = False):
        super(Model, self).__init__()
        self.conv2d = nn.Conv2d(in_channels, in_channels, kernel_size=(kernel_size, 1), stride=stride, padding=padding, dilation=dilation, groups=in_channels, bias=bias)
        
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Performs the depthwise 2D convolution.

        Args:
            x (torch.Tensor): Input tensor of shape (batch_size, in_channels, height, width).

        Returns:
            torch.Tensor: Output tensor of shape (batch_size, in_channels, height_out, width_out).
        """
        return self.conv2d(x)

# Test code
batch_size = 64
in_channels = 8
kernel_size = 3
width = 512
height = 512
stride = 1
padding = 0
dilation = 1

def get_inputs():
    x = torch.rand(batch_size, in_channels, height, width)
    return [x]

def get_init_inputs():
    return [in_channels, kernel_size, stride, padding, dilation]


class ModelNew(nn.Module):
    """Model, with the convolution compiled by kernelgen."""

    def __init__(self, in_channels: int, kernel_size: int, stride: int = 1, padding: int = 0, dilation: int = 1, bias: bool = False):
        super().__init__()
        self.conv2d = kernelgen.Conv2d(in_channels, in_channels, kernel_size=(kernel_size, 1), stride=stride,
                                       padding=padding, dilation=dilation, groups=in_channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2d(x)


if __name__ == "__main__":
    import sys

    import _harness

    sys.exit(_harness.main(sys.modules[__name__]))
