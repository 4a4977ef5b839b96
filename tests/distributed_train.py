"""A small convnet converted to kernelgen, trained data-parallel beside the same net in torch
(issue 56: DDP and FSDP2). Run by torchrun, one process a rank:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_train.py \\
        --wrap ddp --device cpu --out losses.json

Every rank builds both nets from one seed, wraps each (DistributedDataParallel, or FSDP2's
fully_shard), and trains it for --steps SGD steps on its own shard of one seeded global batch:
gloo on the CPU (kernelgen's CPU kernels, so the CPU tier runs it), NCCL on a GPU a rank. Rank 0
writes both loss curves, the relative difference of the two nets' final parameters (FSDP2's
shards gathered), whether every DDP replica ended the same, the kernelgen layers and its kernel
counters (kernelgen.stats: loads and compiles, no fallbacks) to --out as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import kernelgen


def net() -> nn.Sequential:
    """Two convolutions (one strided, one grouped) and a linear head: the forward and all three
    gradients of both, and a module kernelgen does not touch."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, groups=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def wrap(model: nn.Module, how: str, device: torch.device) -> nn.Module:
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            fully_shard(m)
    return fully_shard(model)


def full_parameters(model: nn.Module) -> torch.Tensor:
    """The model's parameters, whole (FSDP2's sharded DTensors gathered), as one flat vector."""
    parts = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(t.detach().reshape(-1))
    return torch.cat(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", choices=("ddp", "fsdp2"), required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.allow_tf32 = False  # (kernelgen follows it: both nets in IEEE float32)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    reference = net().to(device=device, dtype=dtype)
    ours = kernelgen.convert(copy.deepcopy(reference))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * world, 3, 10, 10, generator=g, dtype=dtype)[rank::world].to(device)
    target = torch.randn(4 * world, 4, generator=g, dtype=dtype)[rank::world].to(device)

    losses, same, final = {}, {}, {}
    for name, model in (("torch", reference), ("kernelgen", ours)):
        model = wrap(model, args.wrap, device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        run = []
        for _ in range(args.steps):
            opt.zero_grad()
            loss = (model(x) - target).square().mean()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            run.append(mean.item() / world)
        losses[name] = run
        final[name] = params = full_parameters(model)
        if args.wrap == "ddp":  # (FSDP2's whole parameters are one all-gather: the same everywhere by making)
            gathered = [torch.empty_like(params) for _ in range(world)]
            dist.all_gather(gathered, params)
            same[name] = all(torch.equal(t, gathered[0]) for t in gathered)
    drift = ((final["kernelgen"] - final["torch"]).norm() / final["torch"].norm()).item()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(world=world, wrap=args.wrap, device=args.device, dtype=args.dtype, losses=losses,
                           parameter_drift=drift, same_on_every_rank=same,
                           convs=sum(isinstance(m, kernelgen.Conv2d) for m in ours.modules()),
                           stats=kernelgen.stats()), f)
    dist.barrier()
    dist.destroy_process_group()
    # Out without the interpreter's teardown: there, after destroy_process_group, a gloo thread of a
    # rank whose peer had already exited sometimes called std::terminate ("terminate called without
    # an active exception": 3 runs in 20 on a loaded 2-core machine, rank 0, after its results were
    # written). Everything this process owes is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
