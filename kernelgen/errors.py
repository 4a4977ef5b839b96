"""kernelgen's exceptions.

Argument errors mirror F.conv2d: torch raises RuntimeError for most bad convolution
arguments, so `ConvArgumentError` is both a RuntimeError (code written against
F.conv2d keeps working) and a ValueError (what a Python caller expects of a bad value).
"""


class KernelgenError(Exception):
    """Base class of every error kernelgen raises on purpose."""


class ConvArgumentError(KernelgenError, ValueError, RuntimeError):
    """A convolution argument is invalid; raised before any compile or launch."""


class Unsupported(KernelgenError):
    """A kernel family cannot serve a spec; the selector leaves it out of the call's candidates."""


class CompileError(KernelgenError, RuntimeError):
    """A kernel failed to build. Carries the compiler's message and the source path."""

    def __init__(self, message: str, source_dir: str | None = None, log: str = ""):
        self.source_dir = source_dir
        self.log = log
        text = message
        if source_dir:
            text += f"\n  rendered source: {source_dir}"
        if log:
            text += "\n  compiler output (last 4000 characters):\n" + log[-4000:]
        super().__init__(text)


class CacheError(KernelgenError, RuntimeError):
    """The cache directory cannot be used (ownership, permissions, a lock timeout)."""
