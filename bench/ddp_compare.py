"""Compare the logs of bench/ddp_scaling.sh: loss curves and throughput.

python -m bench.ddp_compare LOGDIR   (reads one.jsonl, multi.jsonl, resume.jsonl)
"""

import argparse
import json
import os
import statistics

from gpt2_fused.training.jsonl import read_jsonl


def steps(path):
    if not os.path.exists(path):
        return {}
    recs = read_jsonl(path)
    return {r["step"]: r for r in recs if "loss" in r}


def main(log):
    one, multi, res = (steps(os.path.join(log, f"{n}.jsonl")) for n in ("one", "multi", "resume"))
    out = {}
    if one and multi:
        first = sorted(set(one) & set(multi))[:20]
        out["max_abs_loss_diff_first20"] = max(
            abs(one[s]["loss"] - multi[s]["loss"]) for s in first
        )
        for name, d in (("one", one), ("multi", multi)):
            out[f"tok_per_s_{name}"] = statistics.median(d[s]["tok_per_s"] for s in d if s >= 10)
        out["scaling"] = out["tok_per_s_multi"] / out["tok_per_s_one"]
    if multi and res:
        common = sorted(set(multi) & set(res))
        out["resume_steps_logged"] = len(res)
        out["max_abs_loss_diff_resume_vs_multi"] = max(
            abs(multi[s]["loss"] - res[s]["loss"]) for s in common
        )
    for k, v in out.items():
        print(f"{k}: {v}")
    json.dump(out, open(os.path.join(log, "ddp_compare.json"), "w"), indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log", help="the LOGDIR bench/ddp_scaling.sh wrote")
    main(ap.parse_args().log)
