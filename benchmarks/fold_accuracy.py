"""Where BatchNorm folding loses accuracy in bfloat16 (issue 53), emulated on the CPU.

Builds ResNet-50 (or ResNeXt-50 32x4d) exactly as torchvision does (same modules, same order, same
initialisation: the weights equal torchvision's for a seed), draws BatchNorm statistics as
bench_networks.py does (or as tests/model_state.py randomise_bn does, --bn model_state), casts it to
bfloat16 and runs it on a seeded bf16 input (bench_networks.make_input). Each variant's logits are
compared with a float64 run of the bf16 model (its weights and input upcast), as ||y - y64|| / ||y64||,
and with eager's error. Kernelgen's bf16 kernels are emulated: F.conv2d in float32 on bf16 values,
plus the bias (and, fused, the residual and the ReLU) in float32, rounded to bf16 once. Eager is torch's
own bf16 CPU run, and cuDNN emulated (conv rounded to bf16, BatchNorm in float32 on it, rounded).
The folded variants differ only in what is rounded: the folded weight, the folded bias, or neither
(and a per-channel float32 scale in the epilogue on the unfolded weights); plus folding the float32
model before the cast. No GPU, no kernelgen.

    python benchmarks/fold_accuracy.py [--networks resnet50,resnext50_32x4d] [--seeds 0,1,2]
        [--image 224] [--bn bench|model_state] [--prepool]
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_networks import _draw_batchnorm  # noqa: E402
from bench_networks import make_input as bench_input  # noqa: E402
from model_state import randomise_bn  # noqa: E402

BF16 = torch.bfloat16


# --- the model: torchvision's ResNet with Bottleneck blocks, built in the same order ---------------


def _conv1x1(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, planes * 4)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), groups=1, width_per_group=64, num_classes=1000):
        super().__init__()
        self.inplanes, self.groups, self.base_width = 64, groups, width_per_group
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * 4, stride), nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes, groups=self.groups, base_width=self.base_width)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


NETWORKS = {"resnet50": dict(), "resnext50_32x4d": dict(groups=32, width_per_group=4)}


def build(name, seed, bn):
    """bench_networks.build: float32, eval mode, seeded weights, BatchNorm statistics drawn."""
    torch.manual_seed(seed)
    model = ResNet(**NETWORKS[name])
    (_draw_batchnorm if bn == "bench" else randomise_bn)(model, seed)
    return model.eval()


def make_input(image, seed, batch=1):
    """bench_networks.make_input's bf16 channels_last input, on the CPU."""
    return bench_input(batch, image, "bf16-cl", "cpu", seed)


# --- one forward pass, each conv+BN unit computed by a pluggable `unit` ------------------------------


def units(model):
    """(conv, bn) of every unit, in the order forward() computes them."""
    out = [(model.conv1, model.bn1)]
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for b in layer:
            out += [(b.conv1, b.bn1), (b.conv2, b.bn2), (b.conv3, b.bn3)]
            if b.downsample is not None:
                out.append((b.downsample[0], b.downsample[1]))
    return out


def run(model, x, unit, head):
    """The network's forward with unit(x, conv, bn, relu, residual) computing conv -> BN [-> + residual]
    [-> ReLU] and head(x, fc) computing the pooling and the classifier."""
    x = unit(x, model.conv1, model.bn1, True, None)
    x = F.max_pool2d(x, 3, 2, 1)
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for b in layer:
            out = unit(x, b.conv1, b.bn1, True, None)
            out = unit(out, b.conv2, b.bn2, True, None)
            idt = x if b.downsample is None else unit(x, b.downsample[0], b.downsample[1], False, None)
            x = unit(out, b.conv3, b.bn3, True, idt)
    return head(x, model.fc)


def _conv(x, w, conv):
    return F.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.groups)


def rnd(t):
    """float32 -> bf16 (round to nearest even) -> float32."""
    return t.to(BF16).float()


def _features(x, fc):
    return x.double()


def ref64(model, x, head=None):
    """Everything in float64 (the bf16 model's values upcast). head: as run()'s (default the pooling
    and classifier in float64)."""
    def unit(x, conv, bn, relu, res):
        y = F.batch_norm(_conv(x, conv.weight.double(), conv), bn.running_mean.double(), bn.running_var.double(),
                         bn.weight.double(), bn.bias.double(), False, 0.0, bn.eps)
        if res is not None:
            y = y + res
        return y.relu() if relu else y

    return run(model, x.double().contiguous(), unit,
               head or (lambda x, fc: F.linear(x.mean((2, 3)), fc.weight.double(), fc.bias.double())))


def head32(x, fc):
    """Pooling and classifier as bf16 kernels do them: float32 math, each output rounded once."""
    return rnd(F.linear(rnd(x.mean((2, 3))), fc.weight.float(), fc.bias.float()))


def cudnn_emu(model, x, head=head32):
    """Eager cuDNN (and unfolded kernelgen, whose bf16 conv is the same): conv in float32 rounded to
    bf16, BatchNorm in float32 on it rounded to bf16, the residual add rounded, ReLU."""
    def unit(x, conv, bn, relu, res):
        y = rnd(_conv(x, conv.weight.float(), conv))
        y = rnd(F.batch_norm(y, bn.running_mean.float(), bn.running_var.float(), bn.weight.float(),
                             bn.bias.float(), False, 0.0, bn.eps))
        if res is not None:
            y = rnd(y + res)
        return y.relu() if relu else y

    return run(model, x.float().contiguous(), unit, head)


def fold_params(conv, bn):
    """kernelgen.conversion._fold's arithmetic, in float64: (weight, scale, bias) of bn(conv(x))."""
    scale = torch.rsqrt(bn.running_var.double() + bn.eps) * bn.weight.double()
    shift = bn.bias.double() - bn.running_mean.double() * scale
    return conv.weight.double() * scale.reshape(-1, 1, 1, 1), scale, shift


def folded(model, x, source, w_dtype, b_dtype, fuse, scale_epilogue=False, head=head32):
    """Kernels on a folded model. `source`: the model whose parameters are folded (the bf16 model, or
    the float32 one before the cast); the folded weight and bias are rounded to w_dtype / b_dtype.
    scale_epilogue: the kernel keeps the unfolded bf16 weight and multiplies its float32 accumulator by
    the per-channel scale (float32) in the epilogue before adding the bias. fuse: residual add and
    ReLU in the epilogue, in float32, rounded once (else the conv output is rounded, then the add)."""
    params = {}
    for (conv, bn), (sconv, sbn) in zip(units(model), units(source)):
        w, scale, b = fold_params(sconv, sbn)
        if scale_epilogue:
            w, s = sconv.weight.to(BF16).float(), scale.float().reshape(1, -1, 1, 1)
        else:
            w, s = w.to(w_dtype).float(), None
        params[conv] = (w, s, b.to(b_dtype).float().reshape(1, -1, 1, 1))

    def unit(x, conv, bn, relu, res):
        w, s, b = params[conv]
        acc = _conv(x, w, conv)
        acc = (acc if s is None else acc * s) + b
        if res is not None and fuse:
            acc = acc + res
            res = None
        y = rnd(acc.relu() if relu and res is None else acc)
        if res is not None:
            y = rnd(y + res)
            y = y.relu() if relu else y
        return y

    return run(model, x.float().contiguous(), unit, head)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


# --- the table ------------------------------------------------------------------------------------


def variants(m16, m32):
    """name -> fn(x) giving logits. m16: the bf16 model; m32: the float32 model it was cast from."""
    v = {
        "eager bf16 (torch CPU)": lambda x: m16(x),
        "eager bf16 (cuDNN emu) = unfolded kernels": lambda x: cudnn_emu(m16, x),
    }
    for fuse in (False, True):
        f = " +fuse" if fuse else ""
        v.update({
            f"fold: W bf16, b bf16 (today){f}": lambda x, fuse=fuse: folded(m16, x, m16, BF16, BF16, fuse),
            f"fold: W bf16, b fp32{f}": lambda x, fuse=fuse: folded(m16, x, m16, BF16, torch.float32, fuse),
            f"fold: W fp32, b bf16{f}": lambda x, fuse=fuse: folded(m16, x, m16, torch.float32, BF16, fuse),
            f"fold: W fp32, b fp32{f}": lambda x, fuse=fuse: folded(m16, x, m16, torch.float32, torch.float32, fuse),
            f"fold: W unfolded bf16 + fp32 scale epilogue, b bf16{f}":
                lambda x, fuse=fuse: folded(m16, x, m16, None, BF16, fuse, scale_epilogue=True),
            f"fold from fp32 model, then cast (W, b bf16){f}":
                lambda x, fuse=fuse: folded(m16, x, m32, BF16, BF16, fuse),
        })
    return v


@torch.no_grad()
def measure(name, seed, image, bn):
    m32 = build(name, seed, bn)
    m16 = copy.deepcopy(m32).to(dtype=BF16, memory_format=torch.channels_last)
    x = make_input(image, seed)
    ref = ref64(m16, x)          # bench_networks' reference: the bf16 model in float64
    ref_fp32 = ref64(m32, x)     # the float32 model in float64 (what folding before the cast approximates)
    out = {}
    for vname, fn in variants(m16, m32).items():
        y = fn(x)
        out[vname] = (rel_err(y, ref), rel_err(y, ref_fp32), int(y.argmax()) == int(ref.argmax()))
    return out


@torch.no_grad()
def prepool(name, seed, image, bn):
    """The last feature map's (before the global average pool) and the pooled vector's relative errors:
    independent rounding noise shrinks under the pool, an error shared by every pixel does not."""
    m16 = build(name, seed, bn).to(dtype=BF16, memory_format=torch.channels_last)
    x = make_input(image, seed)
    ref = ref64(m16, x, head=_features)
    rows = {"eager (cuDNN emu)": cudnn_emu(m16, x, head=_features),
            "fold today (W, b bf16)": folded(m16, x, m16, BF16, BF16, False, head=_features),
            "fold, W fp32": folded(m16, x, m16, torch.float32, BF16, False, head=_features)}
    out = {}
    for k, f in rows.items():
        out[k] = (rel_err(f, ref), rel_err(f.mean((2, 3)), ref.mean((2, 3))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--networks", default="resnet50", help=f"comma-separated, of {', '.join(NETWORKS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--bn", choices=("bench", "model_state"), default="bench",
                    help="BatchNorm statistics as bench_networks.py draws them, or as tests/model_state.py")
    ap.add_argument("--prepool", action="store_true",
                    help="also: errors of the last feature map before and after the global average pool")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    base = "eager bf16 (cuDNN emu) = unfolded kernels"
    for name in args.networks.split(","):
        t0 = time.perf_counter()
        per_seed = [measure(name, s, args.image, args.bn) for s in seeds]
        print(f"\n## {name}, batch 1, {args.image}x{args.image}, BN draw '{args.bn}', seeds {args.seeds}"
              f" ({time.perf_counter() - t0:.0f} s)\n")
        print("rel err: vs float64 of the bf16 model (bench_networks' reference); ratio: over the cuDNN-emulated "
              "eager's, per seed, geometric mean; 'vs fp32 model': vs float64 of the float32 model before the cast\n")
        print("| variant | " + " | ".join(f"rel err s{s}" for s in seeds)
              + " | ratio (geomean) | ratio max | vs fp32 model: err (mean), ratio | top-1 = fp64 |")
        print("| --- |" + " --- |" * (len(seeds) + 4))
        for vname in per_seed[0]:
            errs = [p[vname][0] for p in per_seed]
            ratios = [p[vname][0] / p[base][0] for p in per_seed]
            r32 = [p[vname][1] / p[base][1] for p in per_seed]
            e32 = sum(p[vname][1] for p in per_seed) / len(per_seed)
            agree = sum(p[vname][2] for p in per_seed)
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
            gm32 = math.exp(sum(map(math.log, r32)) / len(r32))
            print(f"| {vname} | " + " | ".join(f"{e:.2e}" for e in errs)
                  + f" | {gm:.2f}x | {max(ratios):.2f}x | {e32:.2e}, {gm32:.2f}x | {agree}/{len(seeds)} |", flush=True)
        if args.prepool:
            print("\n| variant (last feature map) | " + " | ".join(f"s{s} before pool / after" for s in seeds) + " |")
            print("| --- |" + " --- |" * len(seeds))
            pp = [prepool(name, s, args.image, args.bn) for s in seeds]
            for k in pp[0]:
                print(f"| {k} | " + " | ".join(f"{p[k][0]:.2e} / {p[k][1]:.2e}" for p in pp) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
