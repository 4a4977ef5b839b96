"""KernelBench level 1, problem 84: depthwise 2D convolution, 3x3 kernel, 256x512 input, served by kernelgen.

`Model` and the test code under it are the problem's own text
(KernelBench/level1/84_conv_depthwise_2D_asymmetric_input_square_kernel.py);
`ModelNew` is the same module with its convolution compiled by kernelgen. Run from the
repository root:

    python examples/conv_depthwise.py [--precision ieee|tf32|bf16] [--device cpu]
"""

import torch
import torch.nn as nn

import kernelgen

KERNELBENCH_PROBLEM = 84


class Model(nn.Module):
    """
    Performs a depthwise 2D convolution with asymmetric input and square kernel.

    Args:
        in_channels (int): Number of channels in the input tensor.
        out_channels (int): Number of channels produced by the convolution.
        kernel_size (int): Size of the square convolution kernel.
        stride (int, optional): Stride of the convolution. Defaults to 1.
        padding (int, optional): Padding applied to the input. Defaults to 0.
        bias (bool, optional): If `True`, adds a learnable bias to the output. Defaults to `False`.
    """
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0, bias: bool = False):
        super(Model, self).__init__()
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size=(kernel_size, kernel_size), stride=stride, padding=padding, groups=in_channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Performs the depthwise 2D convolution.

        Args:
            x (torch.Tensor): Input tensor of shape (batch_size, in_channels, height_in, width_in).

        Returns:
            torch.Tensor: Output tensor of shape (batch_size, out_channels, height_out, width_out).
        """
        return self.conv2d(x)

# Test code
batch_size = 64
in_channels = 128
out_channels = 128
kernel_size = 3
width_in = 512
height_in = 256
stride = 1
padding = 0

def get_inputs():
    x = torch.rand(batch_size, in_channels, height_in, width_in)
    return [x]

def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]


class ModelNew(nn.Module):
    """Model, with the convolution compiled by kernelgen."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0, bias: bool = False):
        super().__init__()
        self.conv2d = kernelgen.Conv2d(in_channels, out_channels, kernel_size=(kernel_size, kernel_size),
                                       stride=stride, padding=padding, groups=in_channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2d(x)


if __name__ == "__main__":
    import sys

    import _harness

    sys.exit(_harness.main(sys.modules[__name__]))
