"""SSD in the paper's shape on this 2-core CPU: AR and SD colocated on one core; SSD with the target
on that core and the draft on the other (two processes, ssd_jax.runtime.transport). Also AR and SD given both
cores, for the equal-hardware comparison. Greedy, the Qwen2.5-Coder pair, the benchmark set; fp32
unless --dtype bfloat16, the draft's weights int8 or int4 with --draft-quant int8|int4 (models/quant.py).

    python benchmarks/ssd_paper_shape.py --prompts 8 --max-new-tokens 64

Each layout runs in its own process (pinned with taskset / sched_setaffinity). Prints a markdown
table of tokens/s, tokens per round, hit rate, round/verify time and the ALGORITHM.md §6 prediction, and
writes JSON to benchmarks/results/.
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


def _prompts(n: int) -> list[str]:
    from ssd_jax.tools.benchmark_set import load_prompts
    return [p["text"] for p in load_prompts()[:n]]


def _steady(m, key):
    import numpy as np
    vals = [getattr(r, key) for r in m.timeline if not r.compiled]
    return float(np.median(vals)) if vals else float("nan")


def _summary(out_list, mode):
    import numpy as np
    toks = sum(o.metrics.timed_tokens for o in out_list)
    secs = sum(o.metrics.decode_s for o in out_list)
    d = {"mode": mode, "tokens_per_s": toks / secs if secs else float("nan"),
         "new_tokens": sum(o.metrics.new_tokens for o in out_list)}
    if mode != "ar":
        hist = np.sum([o.metrics.accept_hist for o in out_list], axis=0)
        d["tokens_per_round"] = float(sum((j + 1) * c for j, c in enumerate(hist)) / hist.sum())
        d["accept_hist"] = hist.tolist()
        d["verify_s"] = float(np.median([_steady(o.metrics, "verify_s") for o in out_list]))
        d["round_s"] = float(np.median([_steady(o.metrics, "round_s") for o in out_list]))
        d["draft_s"] = float(np.median([_steady(o.metrics, "draft_s") for o in out_list]))
    else:
        d["step_s"] = float(np.median([_steady(o.metrics, "round_s") for o in out_list]))
    if mode == "ssd":
        hits = sum(o.metrics.hits for o in out_list)
        lookups = sum(o.metrics.lookups for o in out_list)
        d["hit_rate"] = hits / lookups if lookups else float("nan")
        d["backup_s"] = float(np.mean([r.backup_s for o in out_list for r in o.metrics.timeline
                                       if r.backup_s > 0 and not r.compiled] or [0.0]))
        d["exchange_s"] = float(np.median([r.exchange_s for o in out_list for r in o.metrics.timeline
                                           if not r.compiled] or [0.0]))
        preds = [o.metrics.predicted_speedup for o in out_list if o.metrics.predicted_speedup]
        d["predicted_speedup_vs_ar"] = float(np.median(preds)) if preds else None
    return d


def _plan(ar_sd: dict, k: int):
    """The fan-out `ssd_jax.algorithm.policy.plan` picks for SSD at lookahead k from the 1-core AR/SD run."""
    from ssd_jax.algorithm import policy

    res = {r["mode"]: r for r in ar_sd["results"]}
    ar, sd = res["ar"], res["sd"]
    return policy.plan_from_sd(ar["step_s"], sd["verify_s"], sd["draft_s"], sd["accept_hist"], ks=(k,),
                               width_slope=ar_sd.get("draft_width_slope"))


def worker(args) -> None:
    """One layout in this process; prints one JSON line."""
    if args.layout == "ssd-two-process":
        from ssd_jax.runtime.transport import start_two_process
        remote = start_two_process(args.draft, dtype=args.dtype, quant=args.draft_quant,
                                   draft_vocab=args.draft_vocab, cores=(0, 1))
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig

    target = load_model(args.target, args.dtype)
    prompts = _prompts(args.prompts)
    if args.layout == "ssd-two-process":
        eng = Engine(target, remote_draft=remote)
    else:
        eng = Engine(target, load_draft(args.draft, args.dtype, args.draft_quant, args.draft_vocab),
                     placement="colocated")
    if args.fanout == "plan" and args.layout == "ssd-two-process":
        raise SystemExit("--fanout plan is resolved by the full script from its AR/SD run")
    fan = None if args.fanout in ("uniform", "plan") else tuple(int(x) for x in args.fanout.split(","))
    warm = prompts[0]
    results = []
    modes = ["ar", "ssd"] if args.layout == "ssd-two-process" else ["ar", "sd"]
    for mode in modes:
        kw = dict(mode=mode, max_new_tokens=args.max_new_tokens)
        if mode == "sd":
            kw.update(k=args.k)
        if mode == "ssd":
            kw.update(k=args.ssd_k, ssd=SSDConfig(fanout=fan, backup=args.backup))
        eng.generate([warm], **dict(kw, max_new_tokens=8))  # compile outside the measurement
        outs = []
        for p in prompts:
            outs.append(eng.generate([p], **kw))
        results.append(_summary(outs, mode))
        results[-1]["token_ids"] = [o.token_ids[0] for o in outs]
    out = {"layout": args.layout, "results": results}
    if args.layout != "ssd-two-process":  # the planner's tree cost: timed on this draft
        out["draft_width_slope"] = eng.draft_width_slope()
    print("RESULT " + json.dumps(out))
    if args.layout == "ssd-two-process":
        remote.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="SD lookahead")
    p.add_argument("--ssd-k", type=int, default=4)
    p.add_argument("--fanout", default="plan",
                   help="SSD F_0..F_K as a comma list, 'uniform' (one per position), or 'plan' "
                        "(default: ssd_jax.algorithm.policy.plan from the 1-core AR/SD run's measurements)")
    p.add_argument("--backup", default="neural")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--draft-quant", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="cut the draft's head to token ids [0, N) (models/draft_head.py)")
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    if args.layout:
        return worker(args)
    common = [a for a in sys.argv[1:]]
    runs = [("ar-sd-1core", "0"), ("ssd-two-process", None), ("ar-sd-2cores", "0,1")]
    table = []
    chosen = None
    for layout, cores in runs:
        lay = "ssd-two-process" if layout == "ssd-two-process" else "colocated"
        cmd = [sys.executable, __file__, *common, "--layout", lay]
        if lay == "ssd-two-process" and args.fanout == "plan":
            chosen = _plan(table[0], args.ssd_k)
            cmd += ["--fanout", ",".join(map(str, chosen.fanout))]
        if cores is not None:
            cmd = ["taskset", "-c", cores, *cmd]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"layout {layout} failed")
        res = json.loads(line[0][7:])
        res["name"], res["wall_s"] = layout, time.time() - t0
        table.append(res)
    by = {r["name"]: {x["mode"]: x for x in r["results"]} for r in table}
    ar1, sd1 = by["ar-sd-1core"]["ar"], by["ar-sd-1core"]["sd"]
    ssd = by["ssd-two-process"]["ssd"]
    ar2, sd2 = by["ar-sd-2cores"]["ar"], by["ar-sd-2cores"]["sd"]
    same = ssd["token_ids"] == ar1["token_ids"] == sd1["token_ids"]
    lines = [
        "| layout | mode | tok/s | tokens/round | hit rate | round s | verify s | round/verify |",
        "|---|---|---|---|---|---|---|---|",
        f"| 1 core | AR | {ar1['tokens_per_s']:.2f} | 1 | | {ar1['step_s']:.3f} | | |",
        f"| 1 core | SD K={args.k} | {sd1['tokens_per_s']:.2f} | {sd1['tokens_per_round']:.2f} | | "
        f"{sd1['round_s']:.3f} | {sd1['verify_s']:.3f} | {sd1['round_s'] / sd1['verify_s']:.2f} |",
        f"| target core 0 + draft core 1 | SSD K={args.ssd_k} | {ssd['tokens_per_s']:.2f} | "
        f"{ssd['tokens_per_round']:.2f} | {ssd['hit_rate']:.2f} | {ssd['round_s']:.3f} | "
        f"{ssd['verify_s']:.3f} | {ssd['round_s'] / ssd['verify_s']:.2f} |",
        f"| 2 cores | AR | {ar2['tokens_per_s']:.2f} | 1 | | {ar2['step_s']:.3f} | | |",
        f"| 2 cores | SD K={args.k} | {sd2['tokens_per_s']:.2f} | {sd2['tokens_per_round']:.2f} | | "
        f"{sd2['round_s']:.3f} | {sd2['verify_s']:.3f} | {sd2['round_s'] / sd2['verify_s']:.2f} |",
        "",
        f"- SSD / SD (paper shape): {ssd['tokens_per_s'] / sd1['tokens_per_s']:.2f}x; "
        f"SSD / AR(1 core): {ssd['tokens_per_s'] / ar1['tokens_per_s']:.2f}x; "
        f"SD / AR(1 core): {sd1['tokens_per_s'] / ar1['tokens_per_s']:.2f}x",
        f"- SSD measured speedup over AR (target process's own AR) vs the §6 prediction from the "
        f"measured T_1, T_v, T_p, T_b, hit rate and tokens/round: "
        f"{ssd['tokens_per_s'] / by['ssd-two-process']['ar']['tokens_per_s']:.2f}x measured vs "
        f"{ssd['predicted_speedup_vs_ar'] or float('nan'):.2f}x predicted",
        f"- equal hardware (both cores): SSD / SD(2 cores) = {ssd['tokens_per_s'] / sd2['tokens_per_s']:.2f}x, "
        f"SSD / AR(2 cores) = {ssd['tokens_per_s'] / ar2['tokens_per_s']:.2f}x",
        f"- SSD median exchange per round {ssd['exchange_s'] * 1e3:.1f} ms, mean backup "
        f"{ssd['backup_s'] * 1e3:.0f} ms on miss rounds, draft (tree) {ssd['draft_s']:.3f} s",
        f"- greedy outputs identical across AR, SD and SSD: {same}",
    ]
    if chosen is not None:
        lines.append(f"- SSD fan-out {chosen.fanout} chosen by ssd_jax.algorithm.policy.plan from the 1-core run "
                     f"(T_1, T_v, draft time, the draft's width slope "
                     f"{table[0].get('draft_width_slope') or float('nan'):.2f}, acceptance; "
                     f"predicted p_hit {chosen.p_hit:.2f}, "
                     f"predicted SSD/AR {chosen.predicted_speedup:.2f}x)")
    from ssd_jax.runtime.defaults import cpu_features, describe
    lines.append(f"- CPU: {describe()}")  # beside the figures (and in the JSON's meta)
    report = "\n".join(lines)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    meta = {"command": "python benchmarks/ssd_paper_shape.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
            "python": platform.python_version(), "cpu_features": cpu_features()}
    try:
        import jax
        meta["jax"] = jax.__version__
    except Exception:
        pass
    path = os.path.join(args.out, f"ssd_paper_shape-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "layouts": table, "report": report}, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
