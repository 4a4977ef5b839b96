"""The distinct convolution layers of six torchvision networks, as census.py Layers.

    python benchmarks/networks.py [--batch 32] [--image 224] [--networks resnet50,...] [--list]

Each network is moved to the meta device (no weights, no memory) and run once on a meta input;
forward pre-hooks on its nn.Conv2d modules record each call's input shape. Layers that differ only
in the module they belong to are one layer, named by its first module (`resnet50.layer1.0.conv2`)
and counted. Prints each network's count of distinct layers (`--list`: the layers too) and the
total over the networks; census.py --networks times them. Needs torchvision.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from census import Layer, describe  # noqa: E402

NETWORKS = ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny",
            "regnet_y_1_6gf")


def _torchvision():
    try:
        import torchvision
    except (ImportError, RuntimeError, OSError) as exc:  # not there, or built for another torch
        raise ImportError(f"networks.py builds torchvision's models, and torchvision cannot be imported ({exc}): "
                          f"pip install the torchvision release built for torch {torch.__version__}") from exc
    return torchvision


def _int_or_pair(v):
    return v if isinstance(v, (int, str)) else (v[0] if v[0] == v[1] else tuple(v))


def network_layers(name: str, batch: int = 32, image: int = 224) -> list[tuple[Layer, int]]:
    """(layer, calls) for each distinct nn.Conv2d call of torchvision's `name` on a (batch, 3, image,
    image) input, in the order of the forward pass."""
    tv = _torchvision()
    # Built on the CPU: some builders compute widths with tensors (RegNet), which meta cannot read back.
    model = tv.models.get_model(name, weights=None).eval().to("meta")
    found: dict[Layer, list] = {}  # the layer without its name -> [named layer, calls]

    def record(path: str, module: torch.nn.Conv2d, args) -> None:
        N, C, H, W = args[0].shape
        padding = module.padding
        if module.padding_mode != "zeros":  # nn.Conv2d pads the input itself, then convolves unpadded
            H, W, padding = H + 2 * padding[0], W + 2 * padding[1], 0
        layer = Layer(name=f"{name}.{path}", N=N, C=C, K=module.out_channels, H=H, W=W,
                      kernel=tuple(module.kernel_size), groups=module.groups, stride=_int_or_pair(module.stride),
                      padding=_int_or_pair(padding), dilation=_int_or_pair(module.dilation),
                      bias=module.bias is not None)
        found.setdefault(replace(layer, name=""), [layer, 0])[1] += 1

    hooks = [m.register_forward_pre_hook(lambda mod, args, path=path: record(path, mod, args))
             for path, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        with torch.no_grad():
            model(torch.empty(batch, 3, image, image, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return [(layer, calls) for layer, calls in found.values()]


def distinct_layers(names=NETWORKS, batch: int = 32, image: int = 224) -> list[Layer]:
    """The distinct layers of all `names` together, each named by its first occurrence
    (network_layers gives how often each occurs in its network)."""
    seen: dict[Layer, Layer] = {}
    for name in names:
        for layer, _ in network_layers(name, batch, image):
            seen.setdefault(replace(layer, name=""), layer)
    return list(seen.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--networks", default=",".join(NETWORKS))
    ap.add_argument("--list", action="store_true", help="print every distinct layer with its count of calls")
    args = ap.parse_args(argv)
    seen = set()
    try:
        for name in args.networks.split(","):
            found = network_layers(name, args.batch, args.image)
            print(f"{name}: {len(found)} distinct layers in {sum(calls for _, calls in found)} convolutions")
            for layer, calls in found:
                seen.add(replace(layer, name=""))
                if args.list:
                    print(f"  {describe(layer)}  x{calls}")
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"total: {len(seen)} distinct layers at batch {args.batch}, {args.image}x{args.image} input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
