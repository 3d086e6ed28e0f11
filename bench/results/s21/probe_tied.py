"""Session 21: which nodes make the tied wte's gradient in the compiled CUDA backward (the
post-grad graph that compile_guard.scatter_tied_grad sees), for the test's tiny model on the
trainer's path. From the repo root: `PYTHONPATH=. python3 bench/results/s21/probe_tied.py`."""

import sys

import torch
import torch._inductor.config as ic
from torch._inductor.custom_graph_pass import CustomGraphPass

from gpt2_fused.core import compile_guard, config
from model import GPT, GPTConfig

SHAPE = dict(n_layer=1, n_head=2, n_embd=64, block_size=32, vocab_size=500, padded_vocab_size=512)


class Dump(CustomGraphPass):
    def __call__(self, graph):
        print(
            f"--- graph, {len(graph.nodes)} nodes, scatter_tied_grad found "
            f"{compile_guard.scatter_tied_grad(graph)}"
        )
        for n in graph.nodes:
            val = n.meta.get("val")
            shape = tuple(getattr(val, "shape", ()))
            name = str(n.target)
            if shape == (512, 64) or "put" in name or "embedding" in name or n.op == "output":
                print(
                    n.format_node()[:400],
                    "| users:",
                    [u.name for u in n.users],
                    "|",
                    getattr(val, "dtype", None),
                    shape,
                )

    def uuid(self):
        return "probe_tied"


def main():
    print(torch.__version__, torch.cuda.get_device_name(0))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE)).cuda()
    idx = torch.randint(0, 500, (4, 32), device="cuda")
    compiled = torch.compile(model)
    cfg = config.TrainConfig(tied_grad_scatter=False)
    with (
        compile_guard.compiler_settings(cfg),
        ic.patch(force_disable_caches=True, post_grad_custom_post_pass=Dump()),
    ):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx, idx)
        loss.backward()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
