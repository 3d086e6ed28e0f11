"""Call 2 diagnostics: (A) the 20-step stress setting's loss curves per seed for bf16 default,
bf16 plain, fp8 fused, fp8 tensorwise (torchao: an independent FP8 reference); (B) 124M:32
fp8_fused with the re-cast launch on and off: throughput + profile."""

import json
import os
import sys
import tempfile

import train
from bench.fp8_stress import ARGS, losses
from bench.throughput import PLAIN

out = sys.argv[1]
part = sys.argv[2]
if part == "A":
    tmp, curves = tempfile.mkdtemp(), {}
    for seed in (7, 1337):
        for name, extra in (
            ("bf16", ["--fp8=off"]),
            ("plain", ["--fp8=off", *PLAIN]),
            ("fused", ["--fp8=fused"]),
            ("tensorwise", ["--fp8=tensorwise"]),
        ):
            d = f"{tmp}/{name}_{seed}"
            try:
                train.main(ARGS + [f"--out_dir={d}", f"--seed={seed}", *extra])
                curves[f"{seed} {name}"] = [round(v, 4) for _, v in sorted(losses(d).items())]
            except Exception as e:
                curves[f"{seed} {name}"] = repr(e)[:300]
            json.dump(curves, open(f"{out}/curves.json", "w"), indent=1)
    for k, v in curves.items():
        print(k, v if isinstance(v, str) else " ".join(f"{x:.3f}" for x in v))
else:
    import bench.throughput as t

    for recast in ("1", "0"):
        env = dict(os.environ, RECAST=recast)
        os.environ["RECAST"] = recast
        t.CHILD = (
            "import os\nfrom gpt2_fused.kernels import fp8_scale\n"
            "fp8_scale.RECAST_ON_OVERFLOW = os.environ['RECAST'] == '1'\n"
        ) + t.CHILD
        sys.argv = [
            "x",
            "--runs",
            "124M:32:30:10",
            "--impls",
            "fp8_fused",
            "--profile",
            "124M:32",
            "--train-args=--fp8='fused'",
            "--out",
            f"{out}/tp_recast{recast}",
        ]
        t.main()
        t.CHILD = t.CHILD.split("== '1'\n", 1)[1]
