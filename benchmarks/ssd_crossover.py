"""The critical-batch crossover between SSD's neural and random backups (ALGORITHM.md §6), on the
real pair on this CPU, in the paper's layout.

A miss anywhere in a batch of b stalls the round for the backup, so the round is a hit round with
probability p_hit^b, while each sequence still emits p_hit E_hit + (1 - p_hit) E_miss tokens. The
neural backup (the draft re-drafts the missed rows: T_b = K draft steps, E_miss = E) wins at small
b; the random backup (T_b ~ 0, E_miss ~ 1) wins once p_hit^b is small. This script measures both
and prints, in one table:

* predicted SSD speed-up over AR with each backup at b = 1, 2, 4, ..., 64 from the times and rates
  measured at b = 1 (`ssd_jax.algorithm.policy.ssd_speedup`; times held at their b = 1 values);
* at each measured b, the prediction from that b's own measured times and rates, beside the
  measured SSD / AR tokens/s with both backups.

    python benchmarks/ssd_crossover.py --batches 1,4,16 --max-new-tokens 32

Layouts (each its own process, pinned): AR on one core (T_1, the reference); SSD with the target on
core 0 and the draft in its own process on core 1 (two-process). Greedy. JSON goes to
benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
PREDICT_AT = (1, 2, 4, 8, 16, 32, 64)


def _prompts(n: int) -> list[str]:
    from ssd_jax.tools.benchmark_set import load_prompts
    prompts = [p["text"] for p in load_prompts()]
    if n > len(prompts):
        raise SystemExit(f"batch {n} needs {n} prompts; the benchmark set has {len(prompts)}")
    return prompts[:n]


def _rates(outs) -> dict:
    """Tokens/s (all sequences) and the §6 inputs of one mode's runs."""
    import numpy as np

    from ssd_jax.runtime.metrics import mean_tokens

    ms = [o.metrics for o in outs]
    steady = [r for m in ms for r in m.timeline if not r.compiled]
    d = {"tokens_per_s": sum(m.timed_tokens for m in ms) / sum(m.decode_s for m in ms),
         "round_s": float(np.median([r.round_s for r in steady]))}
    if ms[0].mode == "ssd":
        hits, lookups = sum(m.hits for m in ms), sum(m.lookups for m in ms)
        after_hit = np.sum([m.accept_hist_after_hit for m in ms], axis=0)
        after_miss = np.sum([m.accept_hist_after_miss for m in ms], axis=0)
        backups = [r.backup_s for r in steady if r.backup_s > 0]
        d.update(hits=hits, lookups=lookups, p_hit=hits / lookups if lookups else float("nan"),
                 e_hit=mean_tokens(after_hit) if after_hit.sum() else float("nan"),
                 e_miss=mean_tokens(after_miss) if after_miss.sum() else float("nan"),
                 tv=float(np.median([r.verify_s for r in steady])),
                 tp=float(np.median([r.draft_s for r in steady])),
                 tb=float(np.mean(backups)) if backups else 0.0,
                 miss_rounds=len(backups), backups=[m.backups for m in ms])
    return d


def worker(args) -> None:
    """One layout in this process (pinned by the parent); prints one JSON line."""
    batches = [int(b) for b in args.batches.split(",")]
    if args.layout == "two-process":
        from ssd_jax.runtime.transport import start_two_process
        remote = start_two_process(args.draft, dtype=args.dtype, quant=args.draft_quant, cores=(0, 1))
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig

    target = load_model(args.target, args.dtype)
    if args.layout == "two-process":
        eng = Engine(target, remote_draft=remote)
        modes = [("ssd-neural", "neural"), ("ssd-random", "random")]
    else:
        eng = Engine(target, load_draft(args.draft, args.dtype, args.draft_quant), placement="colocated")
        modes = [("ar", None)]
    fan = tuple(int(x) for x in args.fanout.split(","))
    out = {"layout": args.layout, "results": {}}
    for b in batches:
        prompts = _prompts(b)
        for name, backup in modes:
            kw = dict(mode=name[:3], max_new_tokens=args.max_new_tokens)
            if backup:
                kw.update(k=args.k, ssd=SSDConfig(fanout=fan, backup=backup))
            eng.generate(prompts, **dict(kw, max_new_tokens=8))  # compile this shape outside
            runs = [eng.generate(prompts, **kw) for _ in range(args.repeats)]
            r = _rates(runs)
            r["token_ids"] = runs[0].token_ids
            out["results"][f"{name}@{b}"] = r
    print("RESULT " + json.dumps(out))
    if args.layout == "two-process":
        remote.close()


def _predict(ar_step: float, s: dict, batch: int) -> float:
    from ssd_jax.algorithm.policy import ssd_speedup
    return ssd_speedup(ar_step, s["tv"], s["tp"], s["tb"], s["p_hit"], s["e_hit"], s["e_miss"],
                       batch=batch)


def _pooled(runs: list[dict]) -> dict:
    """One backup's rates over every measured b: hits / lookups, and E_hit, E_miss weighted by
    lookups (a sequence's hit rate and tokens per round do not depend on its companions)."""
    lookups = sum(r["lookups"] for r in runs)
    w = [r["lookups"] / lookups for r in runs]
    return {"p_hit": sum(r["hits"] for r in runs) / lookups,
            "e_hit": sum(wi * r["e_hit"] for wi, r in zip(w, runs)),
            "e_miss": sum(wi * r["e_miss"] for wi, r in zip(w, runs))}


def report(res: dict, batches: list[int]) -> str:
    """The crossover table from both layouts' results."""
    ar = {b: res["ar"][f"ar@{b}"] for b in batches}
    ssd = {kind: {b: res["two-process"][f"ssd-{kind}@{b}"] for b in batches} for kind in ("neural", "random")}
    # times from the smallest b at which both backups ran (a b = 1 run may never miss): one
    # round time M = max(T_v, T_p) for both (the mean of the two runs), each backup's own T_b
    ref = next((b for b in batches if all(ssd[k][b]["miss_rounds"] for k in ssd)), batches[-1])
    m = sum(max(ssd[k][ref]["tv"], ssd[k][ref]["tp"]) for k in ssd) / 2
    pred = {k: dict(_pooled(list(ssd[k].values())), tv=m, tp=m, tb=ssd[k][ref]["tb"]) for k in ssd}
    t1 = ar[ref]["round_s"]
    n_, r_ = pred["neural"], pred["random"]
    lines = [f"Predicted SSD / AR per sequence at b = 1..64: hit rates and tokens per round pooled "
             f"over all measured b (neural {n_['p_hit']:.3f}, E_hit {n_['e_hit']:.2f}, E_miss "
             f"{n_['e_miss']:.2f}; random {r_['p_hit']:.3f}, {r_['e_hit']:.2f}, {r_['e_miss']:.2f}), "
             f"times from b = {ref} (T_1 {t1:.3f} s, max(T_v, T_p) {m:.3f} s, T_b neural "
             f"{n_['tb']:.3f} s / random {r_['tb']:.3f} s), held fixed. Break-even: the neural "
             f"backup's T_b / max(T_v, T_p) above which random wins at that b.", "",
             "| b | neural | random | better | break-even T_b / round (here "
             f"{n_['tb'] / m:.3f}) |", "|---|---|---|---|---|"]
    for b in PREDICT_AT:
        sn, sr = _predict(t1, n_, b), _predict(t1, r_, b)
        # neural loses when (M + (1 - p^b) T_b) / E_n > (M + (1 - p_r^b) T_b,r) / E_r
        e_n = n_["p_hit"] * n_["e_hit"] + (1 - n_["p_hit"]) * n_["e_miss"]
        e_r = r_["p_hit"] * r_["e_hit"] + (1 - r_["p_hit"]) * r_["e_miss"]
        rt_r = m + (1 - r_["p_hit"] ** b) * r_["tb"]
        stall = 1 - n_["p_hit"] ** b
        even = (rt_r * e_n / e_r - m) / (stall * m) if stall > 0 else float("inf")
        lines.append(f"| {b} | {sn:.2f}x | {sr:.2f}x | {'neural' if sn >= sr else 'random'} | {even:.3f} |")
    lines += ["", "Measured at each b (SSD two-process, AR one core), beside the prediction from that "
              "b's own times and rates:", "",
              "| b | AR tok/s | SSD neural tok/s | SSD random tok/s | neural/AR meas. (pred.) | "
              "random/AR meas. (pred.) | hits/lookups neural | hits/lookups random | "
              "T_v / T_1 | T_b neural s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for b in batches:
        a, n, r = ar[b], ssd["neural"][b], ssd["random"][b]
        lines.append(
            f"| {b} | {a['tokens_per_s']:.2f} | {n['tokens_per_s']:.2f} | {r['tokens_per_s']:.2f} | "
            f"{n['tokens_per_s'] / a['tokens_per_s']:.2f}x ({_predict(a['round_s'], n, b):.2f}x) | "
            f"{r['tokens_per_s'] / a['tokens_per_s']:.2f}x ({_predict(a['round_s'], r, b):.2f}x) | "
            f"{n['hits']}/{n['lookups']} | {r['hits']}/{r['lookups']} | "
            f"{n['tv'] / a['round_s']:.2f} | {n['tb']:.3f} |")
    same = all(ssd["neural"][b]["token_ids"] == ssd["random"][b]["token_ids"] == ar[b]["token_ids"]
               for b in batches)
    lines.append(f"\n- greedy outputs identical across AR and both SSD backups at every b: {same}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--batches", default="1,4,16", help="measured batch sizes, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="generate calls per (mode, batch)")
    p.add_argument("--k", type=int, default=5, help="SSD lookahead K")
    p.add_argument("--fanout", default="1,1,1,1,1,1", help="SSD F_0..F_K (one guess per outcome)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--draft-quant", default="int4", choices=("none", "int8", "int4"))
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--report", metavar="JSON", help="print the tables again from a written result")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(report(saved["results"], [int(b) for b in saved["meta"]["command"].split("--batches ")[1].split()[0].split(",")]))
        return
    batches = [int(b) for b in args.batches.split(",")]
    if sorted(batches) != batches or batches[0] < 1:
        raise SystemExit(f"--batches must be increasing positive sizes, got {args.batches}")
    if len(args.fanout.split(",")) != args.k + 1:
        raise SystemExit(f"--fanout needs K + 1 = {args.k + 1} entries, got {args.fanout}")
    if args.layout:
        return worker(args)
    res = {}
    for layout, cores in (("ar", "0"), ("two-process", None)):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--layout", layout]
        if cores is not None:
            cmd = ["taskset", "-c", cores, *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"layout {layout} failed")
        res[layout] = json.loads(line[0][7:])["results"]
    from ssd_jax.runtime.defaults import cpu_features, describe
    text = report(res, batches) + f"\n- CPU: {describe()}"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    meta = {"command": "python benchmarks/ssd_crossover.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
            "cpu_features": cpu_features()}
    path = os.path.join(args.out, f"ssd_crossover-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": res, "report": text}, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
