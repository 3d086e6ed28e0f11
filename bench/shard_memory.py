"""Per-rank memory of --shard's modes at W ranks, from the engines' own partitions.

    python -m bench.shard_memory [--model gpt2-xl] [--world 8] [--peak-gib 58.96] [--batch 16]
        [--batches 16,8,4]

No GPU: the model is built on the meta device and split by torch's ZeroRedundancyOptimizer and
FSDP2's fully_shard in a fake process group of --world ranks (torch's test backend: collectives
do nothing), so each rank's parameter count is the engines' own. Per rank and parameter:
fp32 weights 4 B, grads 4 B, AdamW moments 8 B (DDP 16; ZeRO-1 4 + 4 + 8/W on its largest rank;
FSDP2 16/W). The rest of a step's peak (activations, temporaries) is --peak-gib, DDP's measured
peak at micro-batch --batch on one GPU, minus DDP's 16 B/param, taken to scale with the
micro-batch (an assumption). FSDP2 adds what it gathers: the root's weights (wte = lm_head, wpe,
ln_f) from forward to backward and two blocks at a time, and, with gradient accumulation, every
grad unsharded until the last micro-step (4 B/param).

gpt2-xl at W = 8 prints (bench/RESULTS.md#multi-gpu): ZeRO-1's largest rank 194,764,800 parameters,
FSDP2's 194,710,800 (N / 8), and the table of GiB per rank there.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.testing._internal.distributed.fake_pg import FakeStore

from model import GPT, GPTConfig

GIB = 2**30


def meta_model(name):
    with torch.device("meta"):
        return GPT(GPTConfig.from_preset(name))


def largest_shares(name, world):
    """(ZeRO-1's, FSDP2's) largest per-rank parameter count over the ranks of a fake group."""
    zero = fsdp = 0
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        model = meta_model(name)
        params = list(model.parameters())
        groups = [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]
        opt = ZeroRedundancyOptimizer(
            [{"params": g} for g in groups], optimizer_class=torch.optim.AdamW
        )
        mine = opt._partition_parameters()[rank]  # the partition its step() uses
        zero = max(zero, sum(p.numel() for g in mine for p in g["params"]))
        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp = max(fsdp, sum(p.to_local().numel() for p in model.parameters()))
        dist.destroy_process_group()
    return zero, fsdp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--peak-gib", type=float, default=58.96, help="DDP's measured peak, 1 GPU")
    ap.add_argument("--batch", type=int, default=16, help="the micro-batch of --peak-gib")
    ap.add_argument("--batches", default="16,8,4", help="micro-batches to tabulate")
    args = ap.parse_args()
    model = meta_model(args.model)
    n = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for m in (model.transformer.wte, model.transformer.wpe,
                                   model.transformer.ln_f) for p in m.parameters())  # fmt: skip
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    zero, fsdp = largest_shares(args.model, args.world)
    rest = args.peak_gib - 16 * n / GIB
    print(f"{args.model}: N = {n:,} parameters; W = {args.world}: largest rank holds {zero:,} "
          f"(ZeRO-1, {zero * args.world / n:.4f} x N/W), {fsdp:,} (FSDP2, "
          f"{fsdp * args.world / n:.4f} x N/W)")  # fmt: skip
    print(f"rest of DDP's peak at B = {args.batch}: {args.peak_gib} - 16 B x N = {rest:.2f} GiB")
    modes = {  # (state bytes on the largest rank, what is gathered or accumulated besides)
        "DDP": (16 * n, 0),
        "ZeRO-1": (8 * n + 8 * zero, 0),
        "FSDP2": (16 * fsdp, 4 * (root + 2 * block)),
        "FSDP2, grad accumulation": (16 * fsdp, 4 * (root + 2 * block) + 4 * n),
    }
    batches = [int(b) for b in args.batches.split(",")]
    print("\n| mode | state GiB | gathered/accumulated GiB | " +
          " | ".join(f"per rank at B = {b}" for b in batches) + " |")  # fmt: skip
    print("|---" * (3 + len(batches)) + "|")
    for name, (state, extra) in modes.items():
        totals = [(state + extra) / GIB + rest * b / args.batch for b in batches]
        cells = " | ".join(f"{t:.1f}" for t in totals)
        print(f"| {name} | {state / GIB:.2f} | {extra / GIB:.2f} | {cells} |")


if __name__ == "__main__":
    main()
