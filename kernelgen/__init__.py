"""kernelgen: JIT-generated convolution kernels for PyTorch.

    import kernelgen
    y = kernelgen.conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1)
    m = kernelgen.Conv2d(64, 128, kernel_size=3, padding=1)

Kernels are rendered from Jinja2 templates, compiled with torch's load_inline, and
cached on disk (KERNELGEN_CACHE_DIR, default ~/.cache/kernelgen).
"""

from ._version import __version__
from .errors import CacheError, CompileError, ConvArgumentError, KernelgenError, Unsupported
from .functional import conv2d
from .kernels import stats
from .nn import Conv2d


def __getattr__(name):
    # The spec module is only needed once a call misses the plan records: keep imports light.
    if name == "ConvSpec":
        from .spec import ConvSpec

        return ConvSpec
    raise AttributeError(f"module 'kernelgen' has no attribute {name!r}")


__all__ = ["__version__", "conv2d", "Conv2d", "ConvSpec", "stats", "KernelgenError", "ConvArgumentError",
           "CompileError", "CacheError", "Unsupported"]
