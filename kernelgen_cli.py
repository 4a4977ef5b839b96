"""The `kernelgen` command: warm the kernel cache ahead of time, and manage it.

    kernelgen warm SPECFILE... | --examples | --model MODULE:CALLABLE --input-shape N,C,H,W
    kernelgen cache ls | info KEY | clear | prune | export FILE | import FILE | keygen FILE
    kernelgen render --input N,C,H,W --weight K,C,R,S [...]
    kernelgen doctor

Exit status: 0 success, 1 some work failed (a build, a corrupt entry), 2 bad usage or
input (an unknown option, a bad spec record, a hostile archive, no command), 141 the reader
of its output went away (`| head`), as for a command killed by SIGPIPE.

This module is the console script and sits beside the package, not in it, on purpose:
`import kernelgen` imports torch (it defines the operators torch.compile and exported
programs need), which costs about two seconds. Here the command line is parsed with the
standard library alone, so `--help`, `--version` and a usage error answer at once; the
package (kernelgen.cli, which runs the commands) is imported only to run one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

EXIT_USAGE = 2
# What a command killed by SIGPIPE reports: its reader (`| head`) went away.
EXIT_BROKEN_PIPE = 128 + 13


def _package_dir() -> Path | None:
    """The kernelgen package's directory, found without importing it (find_spec of a
    top-level name runs no code of the package)."""
    spec = importlib.util.find_spec("kernelgen")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version() -> str:
    """kernelgen.__version__, read from kernelgen/_version.py rather than imported."""
    pkg = _package_dir()
    try:
        text = (pkg / "_version.py").read_text() if pkg else ""
    except OSError:
        text = ""
    m = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    return m.group(1) if m else "unknown"


def _default_examples() -> Path:
    """The examples `warm --examples` warms: those installed with the package (the wheel ships
    them as kernelgen/examples), else a checkout's examples/ beside the package."""
    pkg = _package_dir() or Path("kernelgen")
    installed = pkg / "examples"
    return installed if any(installed.glob("conv_*.py")) else pkg.parent / "examples"


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}; expected sizes like 8,3,224,224") from None
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}; expected sizes like 8,3,224,224")
    return dims


def _int_or_pair(text: str) -> Any:
    if text in ("same", "valid"):
        return text
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected an int or two like 1,2") from None
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected an int or two like 1,2")
    return parts[0] if len(parts) == 1 else parts


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n



def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each command's namespace names its handler in kernelgen.cli
    (`command_name`), and `help_parser` is the parser whose help a bare command prints."""
    version, examples = _version(), _default_examples()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="DIR",
                        help="the cache directory (default: $KERNELGEN_CACHE_DIR or ~/.cache/kernelgen)")
    common.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")

    p = argparse.ArgumentParser(prog="kernelgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit status: 0 success, 1 some work failed, 2 bad usage or input.")
    p.add_argument("--version", action="version", version=f"kernelgen {version}")
    p.set_defaults(help_parser=p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    w = sub.add_parser("warm", parents=[common], help="compile kernels ahead of time into the cache",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Compile the kernels kernelgen.conv2d would compile, ahead of time.\n\n"
                                   "Each SPECFILE is JSON (one object or an array) or JSON Lines, one call per "
                                   "record:\n  {\"input\": [8, 64, 56, 56], \"weight\": [128, 64, 3, 3], "
                                   "\"bias\": true, \"stride\": 1,\n   \"padding\": 1, \"dilation\": 1, "
                                   "\"groups\": 1, \"dtype\": \"float16\", \"device\": \"cuda\"}\n"
                                   "optional: precision (ieee|tf32), memory_format (contiguous|channels_last), "
                                   "family, tiles {name: int}.\nA bad record is reported with its file and line "
                                   "and skipped (exit status 2); a failed build is reported with the\ncompiler's "
                                   "message and does not stop the others (exit status 1).")
    w.add_argument("specfiles", nargs="*", metavar="SPECFILE", help="JSON or JSON Lines spec records")
    w.add_argument("--examples", nargs="?", const=str(examples), metavar="DIR",
                   help="warm every kernel examples/conv_*.py use (ModelNew at get_inputs() shapes; the harness's "
                        "reduced shapes on the CPU), in each mode of examples/run_all.py (ieee, tf32, bf16) "
                        f"unless --dtype/--precision narrow it (default DIR: {examples})")
    w.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="a callable returning a torch.nn.Module; it is built and run on meta tensors (no memory, "
                        "no data, no GPU) to find every convolution (kernelgen.Conv2d and torch convolutions alike)")
    w.add_argument("--input-shape", type=_shape, action="append", metavar="N,C,H,W",
                   help="the shape of one forward argument of --model (repeat for several)")
    w.add_argument("--device", choices=("cuda", "cpu"),
                   help="device of records that name none, and of --model/--examples (default: cuda with a "
                        "visible GPU or --arch, else cpu)")
    w.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"),
                   help="dtype for --model (default float32) and --examples")
    w.add_argument("--precision", choices=("ieee", "tf32"),
                   help="float32 math for --model and --examples (default: torch's setting, as conv2d follows it)")
    w.add_argument("--arch", metavar="LIST",
                   help="CUDA targets, e.g. sm_80,sm_90a, planned and built instead of the local GPU's (needs "
                        "torch with CUDA)")
    w.add_argument("--wide-dram", action="store_true",
                   help="with --arch: plan for the target's larger-memory part (for sm_90a the H200, whose DRAM "
                        "moves 4.8 TB/s to the H100's 3.35; kernelgen.device.nominal)")
    w.add_argument("--jobs", "-j", type=_positive, default=None,
                   help="parallel builds (default: $KERNELGEN_JOBS or the number of cores)")
    w.add_argument("--dry-run", action="store_true", help="list the specialisations found; build nothing")
    w.add_argument("--tune", action="store_true",
                   help="then time each call's top candidates on this machine's GPU (random data of the call's "
                        "sizes) and keep the fastest in its plan record, as kernelgen.tune does")
    w.set_defaults(command_name="warm")

    c = sub.add_parser("cache", help="list, inspect, prune, clear, export and import cache entries",
                       description="See and control what is in the kernel cache.")
    c.set_defaults(help_parser=c)
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION")
    x = csub.add_parser("ls", parents=[common], help="list entries: key, family, arch, size, age, last used, spec",
                        description="List complete entries: key, family, arch, size, age, last use, spec.")
    x.set_defaults(command_name="cache_ls")
    x = csub.add_parser("info", parents=[common], help="one entry: full spec, source paths, toolchain",
                        description="Show one entry (a unique key prefix will do) and verify its binary.")
    x.add_argument("key", metavar="KEY")
    x.set_defaults(command_name="cache_info")
    x = csub.add_parser("clear", parents=[common], help="remove every entry",
                        description="Remove every entry, index file and failed build.")
    x.set_defaults(command_name="cache_clear")
    x = csub.add_parser("prune", parents=[common], help="remove old entries and cap the size",
                        description="Remove entries unused for longer than AGE, then the least recently used "
                                    "until the cache is at most SIZE.")
    x.add_argument("--max-size", metavar="SIZE", help="e.g. 500M, 2G (powers of 1024), 2GB (powers of 1000)")
    x.add_argument("--older-than", metavar="AGE", help="unused for longer than, e.g. 30m, 12h, 7d, 2w")
    x.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    x.set_defaults(command_name="cache_prune")
    x = csub.add_parser("export", parents=[common], help="write entries to a tar.gz for machines without a compiler",
                        description="Write verified entries (manifest, .so, sources) and a manifest of "
                                    "sha256 checksums to a tar.gz.")
    x.add_argument("file", metavar="FILE")
    x.add_argument("--key", action="append", metavar="KEY", help="only this entry (repeatable; prefixes work)")
    x.add_argument("--secret", metavar="FILE", help="sign the archive with the secret in FILE (default: "
                   "$KERNELGEN_ARCHIVE_SECRET; `kernelgen cache keygen FILE` makes one)")
    x.set_defaults(command_name="cache_export")
    x = csub.add_parser("import", parents=[common], help="import an exported tar.gz, verifying it",
                        description="Import entries from `kernelgen cache export`. An archive carries compiled "
                                    "code that kernelgen did not build here, and its checksums are its own, so "
                                    "only a signature says who made it: archives must be signed with your secret "
                                    "(--secret) unless --trust-unsigned is given. Every member name and checksum "
                                    "is verified; entries built by another toolchain (torch, CUDA, compilers, "
                                    "arch) are skipped; nothing is written outside the cache directory.")
    x.add_argument("file", metavar="FILE")
    x.add_argument("--secret", metavar="FILE", help="the secret the archive must be signed with (default: "
                   "$KERNELGEN_ARCHIVE_SECRET)")
    x.add_argument("--trust-unsigned", action="store_true",
                   help="import an unsigned archive (or one not checked against a secret): its code will run here")
    x.add_argument("--arch", metavar="LIST",
                   help="CUDA targets to accept (default: the local GPU's; every arch where no GPU is visible)")
    x.set_defaults(command_name="cache_import")
    x = csub.add_parser("keygen", parents=[common], help="write a new secret for signing archives",
                        description="Write 256 random bits (hex) to FILE, readable by you only. Share it with the "
                                    "machines that import your archives, and nobody else.")
    x.add_argument("file", metavar="FILE")
    x.set_defaults(command_name="cache_keygen")

    r = sub.add_parser("render", help="print the source kernelgen would compile for a convolution",
                       description="Print the CUDA (or C++) source, with its banner, that kernelgen would compile "
                                   "for a call of conv2d with these arguments.")
    r.add_argument("--input", type=_shape, required=True, metavar="N,C,H,W", help="input shape")
    r.add_argument("--weight", type=_shape, required=True, metavar="K,C/g,R,S", help="weight shape")
    r.add_argument("--bias", action="store_true", help="with a bias")
    r.add_argument("--stride", type=_int_or_pair, default=1, metavar="S[,S]")
    r.add_argument("--padding", type=_int_or_pair, default=0, metavar="P[,P]|same|valid")
    r.add_argument("--dilation", type=_int_or_pair, default=1, metavar="D[,D]")
    r.add_argument("--groups", type=int, default=1)
    r.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64"))
    r.add_argument("--device", choices=("cuda", "cpu"),
                   help="the device to render for (default: cuda with a visible GPU or --arch, else cpu)")
    r.add_argument("--precision", choices=("ieee", "tf32"), help="float32 math (default: torch's setting)")
    r.add_argument("--memory-format", default="contiguous", choices=("contiguous", "channels_last"))
    r.add_argument("--family", help="force a kernel family")
    r.add_argument("--tile", action="append", metavar="NAME=INT", help="force a tile size (repeatable)")
    r.add_argument("--arch", metavar="ARCH", help="plan for this CUDA target, e.g. sm_90a (default: the local "
                                                   "GPU's; where none is visible, families that need one are "
                                                   "not chosen)")
    r.add_argument("--wide-dram", action="store_true", help="with --arch: plan for the target's larger-memory part (the H200 for sm_90a)")
    r.add_argument("--unit", choices=("cuda", "cpp", "all"),
                   help="which translation unit (default: cuda for a cuda spec, cpp for cpu)")
    r.set_defaults(command_name="render")

    d = sub.add_parser("doctor", parents=[common], help="report what kernelgen needs and what would stop a compile",
                       description="Report torch, CUDA, nvcc, the GPU and its arch, the cache directory, and "
                                   "what would stop a compile. Exit status 1 if something would.")
    d.add_argument("--try-build", action="store_true", help="also build a tiny kernel into a throw-away cache: for the CPU, and for CUDA where torch has CUDA "
                        "(for the local GPU, or sm_80 where none is visible)")
    d.add_argument("--verify", action="store_true", help="re-hash every cached binary against its manifest")
    d.set_defaults(command_name="doctor")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kernelgen` command; returns the exit status (0 ok, 1 work failed, 2 bad usage or input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if getattr(args, "command_name", None) is None:  # `kernelgen` or `kernelgen cache` alone
        args.help_parser.print_help(sys.stderr)
        return EXIT_USAGE
    # torch warns on import, once a process, where NumPy is missing or was built for another ABI;
    # kernelgen does not use NumPy, so the command does not repeat that warning on every run.
    # (A filter in this process only: the library itself sets none.)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from kernelgen import cli

    return cli.run(args)


def console() -> int:
    """The console script: main() with a closed stdout (`kernelgen cache ls | head -1`) ending
    the command quietly, as it ends a C tool, rather than in a BrokenPipeError traceback."""
    try:
        code = main()
        sys.stdout.flush()  # the last write may still be buffered: fail here, not at exit
        return code
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(console())
