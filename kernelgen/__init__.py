"""kernelgen: JIT-generated convolution kernels for PyTorch.

    import kernelgen
    y = kernelgen.conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1)
    y = kernelgen.conv2d(x, w, b, padding=1, activation="relu", residual=r)  # relu(conv + b + r), fused
    m = kernelgen.Conv2d(64, 128, kernel_size=3, padding=1)
    kernelgen.tune(x, w, padding=1)      # time the top candidates on this GPU; later calls use the fastest

Kernels are rendered from Jinja2 templates, compiled with torch's load_inline, and
cached on disk (KERNELGEN_CACHE_DIR, default ~/.cache/kernelgen).
"""

from ._version import __version__
from .functional import conv2d
from .kernels import stats

# Imported on first access rather than here: a process whose calls are all served from
# the cache needs none of these modules, and each one costs import time (issue 2).
_LAZY = {"ConvSpec": "spec", "Conv2d": "nn", "KernelgenError": "errors", "ConvArgumentError": "errors",
         "CompileError": "errors", "CacheError": "errors", "Unsupported": "errors", "tune": "tuner",
         "tune_calls": "tuner", "TuneResult": "tuner", "convert": "conversion", "revert": "conversion",
         "report": "conversion", "frozen_weights": "packs", "ACTIVATIONS": "spec"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelgen' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["__version__", "conv2d", "Conv2d", "ConvSpec", "ACTIVATIONS", "stats", "tune", "tune_calls", "TuneResult",
           "convert", "revert", "report", "frozen_weights", "KernelgenError", "ConvArgumentError", "CompileError",
           "CacheError", "Unsupported"]
