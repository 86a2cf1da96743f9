"""Outcome prediction at the paper's settings (issue 24, item 4): SSD's hit rate per dataset at
K = 7 with the paper's width (F = 3 at every position, MQ = 24) and with the capped-geometric
allocation at equal MQ (`ssd_jax.algorithm.fanout.allocate` at the measured acceptance), against
the narrow tree the CPU plan picks (given with --plan, e.g. the fan-out in a paper-suite result).

    python benchmarks/outcome_prediction.py --per-dataset 8 --max-new-tokens 64 --plan 0,0,0,0,1

Hit rates are counts, not times: target and draft run in this one process (the layout changes no
token and no hit), greedy as the paper's table, each dataset's prompts as one batch (a sequence's
hits do not depend on its companions). The acceptance that sizes the geometric allocation comes
from a greedy SD run at K = 7 over the same prompts. Per dataset and tree: hits / lookups with a
95% Wilson interval (lookups counted as independent: an approximation, rounds of one prompt are
correlated), tokens per round, and the hit rate after a rejection (j < K) and after all K accepted.

Writes outcome_prediction-<time>.json and .md to --out (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wilson(h: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = h / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return mid - half, mid + half


def run(args) -> dict:
    from ssd_jax.algorithm import fanout as fo
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.tools import datasets
    from ssd_jax.tools.bench_workers import encode_prompt

    target = load_model(args.target, args.dtype)
    eng = Engine(target, load_draft(args.draft, args.dtype, args.draft_quant), placement="colocated",
                 max_len=args.max_len)
    ids = {name: [encode_prompt(target.tokenizer, p) for p in datasets.prompts(name, args.per_dataset)]
           for name in args.datasets}
    k = args.k
    sd = {name: eng.generate(x, mode="sd", k=k, max_new_tokens=args.max_new_tokens).metrics
          for name, x in ids.items()}
    acc_hist = [sum(m.accept_hist[j] for m in sd.values()) for j in range(k + 1)]
    from ssd_jax.algorithm.policy import acceptance_from_hist
    a = acceptance_from_hist(acc_hist)
    mq = 3 * (k + 1)
    trees = {f"paper F=3 (K={k})": (3,) * (k + 1),
             f"capped-geometric MQ={mq} (K={k}, a={a:.3f})": fo.allocate(k, mq, a, vocab=eng.vocab_size),
             f"CPU plan (K={len(args.plan) - 1})": tuple(args.plan)}
    out = {"k": k, "acceptance_sd_k": a, "sd_accept_hist": acc_hist, "trees": {n: list(f) for n, f in trees.items()},
           "results": {}}
    for tree, fan in trees.items():
        for name, x in ids.items():
            t0 = time.perf_counter()
            m = eng.generate(x, mode="ssd", k=len(fan) - 1, ssd=SSDConfig(fanout=fan),
                             max_new_tokens=args.max_new_tokens).metrics
            kk = len(fan) - 1
            out["results"][f"{tree}|{name}"] = dict(
                hits=m.hits, lookups=m.lookups, tokens_per_round=m.tokens_per_round,
                hits_by_accept=m.hits_by_accept, lookups_by_accept=m.lookups_by_accept, k=kk,
                seconds=time.perf_counter() - t0)
            print(f"{tree} {name}: {m.hits}/{m.lookups}", file=sys.stderr, flush=True)
    return out


def report(res: dict, names: list[str]) -> str:
    lines = [f"Acceptance a (greedy SD at K = {res['k']} over the same prompts): {res['acceptance_sd_k']:.3f}", "",
             "| tree | F_0..F_K | " + " | ".join(names) + " | all sets | after a rejection | after all K accepted | tokens / round |",
             "|---|---|" + "---|" * (len(names) + 4)]
    for tree, fan in res["trees"].items():
        rs = [res["results"][f"{tree}|{n}"] for n in names]
        cells = []
        for r in rs:
            lo, hi = wilson(r["hits"], r["lookups"])
            cells.append(f"{r['hits'] / max(r['lookups'], 1):.3f} [{lo:.2f}, {hi:.2f}]")
        h, n = sum(r["hits"] for r in rs), sum(r["lookups"] for r in rs)
        k = rs[0]["k"]
        hr = sum(sum(r["hits_by_accept"][:k]) for r in rs)
        nr = sum(sum(r["lookups_by_accept"][:k]) for r in rs)
        hk = sum(r["hits_by_accept"][k] for r in rs)
        nk = sum(r["lookups_by_accept"][k] for r in rs)
        tpr = sum(r["tokens_per_round"] * r["lookups"] for r in rs) / max(n, 1)
        lo, hi = wilson(h, n)
        lines.append(f"| {tree} | {','.join(map(str, fan))} | " + " | ".join(cells) +
                     f" | {h / max(n, 1):.3f} [{lo:.2f}, {hi:.2f}] ({h}/{n}) | "
                     f"{hr / max(nr, 1):.3f} ({hr}/{nr}) | {hk / max(nk, 1):.3f} ({hk}/{nk}) | {tpr:.2f} |")
    return "\n".join(lines)


def main() -> None:
    from ssd_jax.tools.datasets import PAPER_SUITE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="default %(default)s")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="default %(default)s")
    p.add_argument("--datasets", default=",".join(PAPER_SUITE), help="default %(default)s")
    p.add_argument("--per-dataset", type=int, default=8, help="prompts per set, one batch (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default %(default)s")
    p.add_argument("--k", type=int, default=7, help="the paper's K (default %(default)s)")
    p.add_argument("--plan", required=True, help="the CPU plan's F_0..F_K, e.g. from a paper-suite "
                   "result's config.fanout")
    p.add_argument("--max-len", type=int, default=1024, help="KV cache length (default %(default)s; "
                   "the paper-width tree's cache and rows take ~10 GB at 4096 and batch 8)")
    p.add_argument("--dtype", default="bfloat16", help="default %(default)s")
    p.add_argument("--draft-quant", default="int4", choices=("none", "int8", "int4"), help="default %(default)s")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="output folder")
    args = p.parse_args()
    args.datasets = [x for x in args.datasets.split(",") if x]
    bad = [x for x in args.datasets if x not in PAPER_SUITE]
    if bad or not args.datasets:
        raise SystemExit(f"--datasets: a subset of {','.join(PAPER_SUITE)}, got {bad}")
    try:
        args.plan = [int(x) for x in args.plan.split(",")]
    except ValueError as e:
        raise SystemExit(f"--plan is F_0..F_K as comma-separated integers: {e}")
    if len(args.plan) < 2 or min(args.plan) < 0 or args.k < 1:
        raise SystemExit("--plan needs K + 1 >= 2 counts >= 0, and --k >= 1")
    res = run(args)
    from ssd_jax.runtime.defaults import describe
    text = report(res, args.datasets) + f"\n\n- CPU: {describe()}"
    print(text)
    from _results import write_results
    write_results("outcome_prediction", args.out, dict(results=res), text)


if __name__ == "__main__":
    main()
