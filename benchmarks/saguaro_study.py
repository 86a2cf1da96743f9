"""Temperature x Saguaro C on the real pair (issue 24, item 3): hit rate, acceptance and tokens/s,
with 95% intervals over prompts, and the hit rate split by the outcome looked up.

    python benchmarks/saguaro_study.py --per-dataset 3 --max-new-tokens 96

The paper's layout at batch 1: the target on core 0, the draft in its own process on core 1
(`start_two_process`). One engine runs every point, so after the first call of each temperature
kind (greedy / sampled) nothing compiles: temperature and C are traced values. Prompts: the first
--per-dataset of each paper-suite set (ssd_jax.tools.datasets), the same prompts and seeds at every
point. At T = 0 the draft's row is one-hot, so C changes nothing there and only C = 1 runs.

Per point: hits / lookups, the per-token acceptance a (ML geometric), tokens per round and
tokens/s, each with a percentile-bootstrap 95% interval over prompts (2,000 resamples, seed 0), and
`Metrics.hit_rate_by_accept` pooled: the hit rate of lookups after a rejection at draft position j
(j < K) and after all K accepted (j = K). For each temperature, the difference of hit rates C = 1
minus C = c is bootstrapped over prompts, paired (the same prompt's two figures drawn together),
so "C = 0.5 hits more than C = 1" is a statement with an interval, not a reading of two means.

Writes saguaro_study-<time>.json, .md and .png to --out (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_BOOT = 2000


def _boot(per_prompt: list[tuple[float, float]], seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high) of Σ num / Σ den over prompts, percentile bootstrap over prompts."""
    import numpy as np
    a = np.asarray(per_prompt, dtype=np.float64)
    point = a[:, 0].sum() / a[:, 1].sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(N_BOOT, len(a)))
    num, den = a[idx, 0].sum(1), a[idx, 1].sum(1)
    r = num[den > 0] / den[den > 0]
    return float(point), float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


def _boot_diff(x: list[tuple[float, float]], y: list[tuple[float, float]], seed: int = 0):
    """(point, low, high) of ratio(x) - ratio(y), the prompts of x and y drawn together."""
    import numpy as np
    a, b = np.asarray(x, np.float64), np.asarray(y, np.float64)
    point = a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(N_BOOT, len(a)))
    d = a[idx, 0].sum(1) / a[idx, 1].sum(1) - b[idx, 0].sum(1) / b[idx, 1].sum(1)
    return float(point), float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975))


def _per_prompt(ms) -> dict:
    """Per-prompt (numerator, denominator) pairs of each figure, and pooled per-outcome counts."""
    k = ms[0].k
    acc = [(sum(j * c for j, c in enumerate(m.accept_hist)),
            sum(j * c for j, c in enumerate(m.accept_hist)) + sum(m.accept_hist[:-1])) for m in ms]
    return dict(hits=[(m.hits, m.lookups) for m in ms], acceptance=acc,
                tokens_per_round=[(sum((j + 1) * c for j, c in enumerate(m.accept_hist)),
                                   sum(m.accept_hist)) for m in ms],
                tokens_per_s=[(m.timed_tokens, m.decode_s) for m in ms],
                hits_by_accept=[sum(m.hits_by_accept[j] for m in ms) for j in range(k + 1)],
                lookups_by_accept=[sum(m.lookups_by_accept[j] for m in ms) for j in range(k + 1)])


def run(args) -> dict:
    from ssd_jax.runtime.transport import start_two_process  # before any other JAX use
    remote = start_two_process(args.draft, dtype=args.dtype, quant=args.draft_quant,
                               cores=tuple(args.cores))
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models.load import load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.tools import datasets
    from ssd_jax.tools.bench_workers import encode_prompt

    target = load_model(args.target, args.dtype)
    eng = Engine(target, remote_draft=remote)
    prompts = []
    for name in datasets.PAPER_SUITE:
        prompts += [dict(p, dataset=name) for p in datasets.prompts(name, args.per_dataset)]
    ids = [encode_prompt(target.tokenizer, p) for p in prompts]
    fan = tuple(int(x) for x in args.fanout.split(","))
    k = len(fan) - 1
    points = [(0.0, 1.0)] + [(t, c) for t in args.temperatures if t > 0 for c in args.c]
    out = {}
    for t, c in points:
        sampling = SamplingParams(temperature=t)
        ssd = SSDConfig(fanout=fan, saguaro_c=c)
        kw = dict(mode="ssd", k=k, sampling=sampling, ssd=ssd, max_new_tokens=args.max_new_tokens)
        eng.generate(ids[:1], **dict(kw, max_new_tokens=8))  # a compile, if any, outside the timing
        t0 = time.perf_counter()
        ms = [eng.generate([p], seed=i, **kw).metrics for i, p in enumerate(ids)]
        res = _per_prompt(ms)
        res["compile_s"] = sum(m.compile_s for m in ms)
        res["wall_s"] = time.perf_counter() - t0
        out[f"{t}/{c}"] = res
        print(f"T={t} C={c}: hit {_boot(res['hits'])[0]:.3f} over {sum(d for _, d in res['hits'])} "
              f"lookups, {res['wall_s']:.0f} s", file=sys.stderr, flush=True)
    remote.close()
    return dict(points=out, k=k, fanout=list(fan), prompts=[p["dataset"] for p in prompts])


def top_mass(args) -> dict:
    """Why C moves the hit rate so little here: the draft's mass m on the top F + 1 tokens that
    Saguaro scales. q'(t) = C q(t) / (C m + 1 - m) on them, so where m is near 1 the renormalised
    q' is nearly q. Measured on the draft (bf16; the teacher-forced pass on the plain-XLA table)
    over the same prompts:
    at the prompt's own positions (harder text for the draft, a low m) and at the positions of the
    draft's own greedy continuation of --max-new-tokens (its easiest text, a high m); the text it
    drafts in SSD, the target's, lies between."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.load import load_model
    from ssd_jax.models.protocol import forward, init_cache
    from ssd_jax.runtime.engine import Engine
    from ssd_jax.tools import datasets
    from ssd_jax.tools.bench_workers import encode_prompt

    draft = load_model(args.draft, "bfloat16")
    L = 1024  # one padded length, one compile
    eng = Engine(draft, placement="colocated", max_len=L)
    n_top = max(int(x) for x in args.fanout.split(",")[:-1]) + 1
    fwd = jax.jit(lambda p, t, n: forward(p, draft.cfg, t, init_cache(draft.cfg, 1, L), n)[0])
    V = draft.tokenizer.vocab_size
    out = {}
    for name in datasets.PAPER_SUITE:
        for p in datasets.prompts(name, args.per_dataset):
            ids = encode_prompt(draft.tokenizer, p)
            cont = eng.generate([ids], mode="ar", max_new_tokens=args.max_new_tokens).token_ids[0]
            seq = ids + list(cont)
            if len(seq) > L:
                raise SystemExit(f"--top-mass: a prompt and its continuation take {len(seq)} > {L} tokens")
            toks = jnp.asarray([seq + [0] * (L - len(seq))], jnp.int32)
            logits = fwd(draft.params, toks, jnp.asarray([len(seq)], jnp.int32))[0, : len(seq)]
            for t in args.temperatures or [1.0]:
                q = jax.nn.softmax(logits[:, :V] / max(t, 1e-6), axis=-1)
                m = np.asarray(jnp.sum(jax.lax.top_k(q, n_top)[0], axis=-1))
                out.setdefault(str(t), {"prompt": [], "continuation": []})
                out[str(t)]["prompt"] += np.round(m[: len(ids) - 1], 4).tolist()
                out[str(t)]["continuation"] += np.round(m[len(ids) - 1: -1], 4).tolist()
    return dict(n_top=n_top, mass=out)


def report_mass(res: dict, cs: list[float]) -> str:
    import numpy as np
    lines = [f"The draft's mass m on its top {res['n_top']} tokens (those Saguaro scales), and the "
             "mean factor q'/q on them at each C (C / (C m + 1 - m); 1 = no change):", "",
             "| T | text | positions | median m | mean m | " + " | ".join(f"q'/q at C = {c}" for c in cs) + " |",
             "|---|---|---|---|---|" + "---|" * len(cs)]
    for t, by in res["mass"].items():
        for where, ms in by.items():
            m = np.asarray(ms)
            f = [float(np.mean(c / (c * m + 1 - m))) for c in cs]
            lines.append(f"| {t} | {where} | {len(m)} | {np.median(m):.3f} | {m.mean():.3f} | " +
                         " | ".join(f"{x:.3f}" for x in f) + " |")
    return "\n".join(lines)


def report(res: dict, c_ref: float = 1.0) -> str:
    pts, k = res["points"], res["k"]
    lines = ["| T | C | hit rate [95%] | lookups | acceptance a [95%] | tokens/round | tokens/s [95%] | "
             "hit rate after a rejection (j < K) | after all K accepted | share of lookups j = K |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in pts.items():
        t, c = key.split("/")
        h, a, tpr, tps = (_boot(r[f]) for f in ("hits", "acceptance", "tokens_per_round", "tokens_per_s"))
        hb, lb = r["hits_by_accept"], r["lookups_by_accept"]
        rej = sum(hb[:k]) / max(sum(lb[:k]), 1)
        allk = hb[k] / lb[k] if lb[k] else float("nan")
        lines.append(f"| {t} | {c} | {h[0]:.3f} [{h[1]:.3f}, {h[2]:.3f}] | {sum(d for _, d in r['hits'])} | "
                     f"{a[0]:.3f} [{a[1]:.3f}, {a[2]:.3f}] | {tpr[0]:.2f} | {tps[0]:.2f} [{tps[1]:.2f}, "
                     f"{tps[2]:.2f}] | {rej:.3f} ({sum(hb[:k])}/{sum(lb[:k])}) | {allk:.3f} "
                     f"({hb[k]}/{lb[k]}) | {lb[k] / max(sum(lb), 1):.3f} |")
    lines += ["", f"Hit rate at C = {c_ref} minus at C = c, paired over prompts (95% interval; an "
              "interval that excludes 0 tells the two apart):", ""]
    for key, r in pts.items():
        t, c = key.split("/")
        ref = pts.get(f"{t}/{c_ref}")
        if ref is None or float(c) == c_ref:
            continue
        d = _boot_diff(ref["hits"], r["hits"])
        lines.append(f"- T = {t}, C = {c_ref} - C = {c}: {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    temps = sorted({float(k.split("/")[0]) for k in res["points"]} - {0.0})
    for t in temps:
        keys = [k for k in res["points"] if float(k.split("/")[0]) == t]
        cs = [float(k.split("/")[1]) for k in keys]
        for ax, field, name in zip(axes, ("hits", "acceptance", "tokens_per_s"),
                                   ("hit rate", "per-token acceptance a", "tokens/s (batch 1)")):
            b = [_boot(res["points"][k][field]) for k in keys]
            ax.errorbar(cs, [x[0] for x in b], yerr=[[x[0] - x[1] for x in b], [x[2] - x[0] for x in b]],
                        marker="o", capsize=3, label=f"T = {t}")
            ax.set_xlabel("Saguaro C")
            ax.set_ylabel(name)
    axes[0].legend()
    fig.suptitle("SSD on the default pair: Saguaro C at each temperature (95% intervals over prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model (default %(default)s)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model (default %(default)s)")
    p.add_argument("--per-dataset", type=int, default=3, help="prompts per paper-suite set (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="default %(default)s")
    p.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated (default %(default)s)")
    p.add_argument("--c", default="1,0.5,0.25", help="Saguaro C values, comma-separated; 1 must be "
                   "among them (the reference; default %(default)s)")
    p.add_argument("--fanout", default="1,1,1,1,1", help="SSD F_0..F_K; its length sets K "
                   "(default %(default)s: one candidate per outcome position)")
    p.add_argument("--dtype", default="auto", help="default %(default)s (ssd_jax.runtime.defaults)")
    p.add_argument("--draft-quant", default="auto", help="default %(default)s")
    p.add_argument("--cores", default="0,1", type=lambda s: [int(x) for x in s.split(",")],
                   help="CPU ids A,B: the target on A, the draft's process on B (default 0,1)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="output folder")
    p.add_argument("--report", metavar="JSON", help="print the table again from a written result")
    p.add_argument("--top-mass", action="store_true", help="instead of the study: the draft's mass "
                   "on the tokens Saguaro scales, at each temperature (why C changes little)")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)["results"]))
        return
    try:
        args.temperatures = [float(x) for x in args.temperatures.split(",")]
        args.c = [float(x) for x in args.c.split(",")]
        fan = [int(x) for x in args.fanout.split(",")]
    except ValueError as e:
        raise SystemExit(f"--temperatures, --c and --fanout are comma-separated numbers: {e}")
    if 1.0 not in args.c or any(not 0 < c <= 1 for c in args.c):
        raise SystemExit(f"--c must hold values in (0, 1], 1 among them; got {args.c}")
    if any(t < 0 for t in args.temperatures) or len(fan) < 2 or min(fan) < 0:
        raise SystemExit("--temperatures must be >= 0 and --fanout K + 1 >= 2 counts >= 0")
    from _results import write_results
    from ssd_jax.runtime.defaults import describe
    if args.top_mass:
        res = top_mass(args)
        text = report_mass(res, [c for c in args.c if c < 1])
        name, draw = "saguaro_mass", None
    else:
        res = run(args)
        text = report(res)
        name, draw = None, lambda path: plot(res, path)
    text += f"\n\n- CPU: {describe()}"
    print(text)
    write_results("saguaro_study", args.out, dict(results=res), text, plot=draw, name=name)


if __name__ == "__main__":
    main()
