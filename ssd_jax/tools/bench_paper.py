"""`ssd-jax bench --suite paper`: the paper's evaluation table (its §7) on this
machine: per dataset AR, SD and SSD tokens/s, SSD/SD, SSD/AR and SD/AR with 95% intervals over
prompts, tokens per round, the hit rate, and the speed-ups the §6 model predicts.

    ssd-jax bench --suite paper                          # 8 prompts a set, 128 new tokens
    ssd-jax bench --suite paper --per-dataset 128 --max-new-tokens 512   # the paper's sizes

Layout, the paper's (SD and AR on the target's devices, SSD adding the draft's own): AR and SD in
one process on core A (target and draft colocated, one thread: the `colocated` layout of
ssd_jax.tools.bench); SSD with the target's process on core A and the draft in its own process on
core B (`two-process`). `--cores A,B` picks them. Each worker runs its modes over every prompt of
every dataset (AR, then SD; then SSD), one short warm-up generate per mode first.

Prompts: ssd_jax.tools.datasets, the first --per-dataset of each set's fixed sample (a set with
fewer prompts gives all it has); the chat sets are user turns in the target's chat template.
SD runs at --k (default 4), SSD at the CLI's SSD default (K = 5, fan-out 0,...,0,1) unless
--fanout is given (its length sets SSD's K), or `--fanout plan`: planned at SD's K from the AR and
SD runs (ssd_jax.algorithm.policy.plan_from_sd over every prompt).

Per dataset: tokens/s is steady-state tokens over steady-state seconds summed over its prompts
(`Metrics.tokens_per_s`'s rule), a ratio is one mode's tokens/s over another's, and its 95% interval
is a percentile bootstrap over prompts (`ratio_interval`: prompts drawn with replacement, both
modes' tokens and seconds of a drawn prompt together, the ratio of the summed figures; 2,000
resamples, seed 0). Predicted: ssd_jax.algorithm.policy's sd_speedup and ssd_speedup from the
dataset's medians (T_1 the AR step, T_v the verify, T_d the SD draft step, T_p the SSD tree; T_b
the mean backup), its acceptance, hit rate and tokens per round after hits and misses. The average
row is the mean of the dataset rows, as the paper's is.

Writes `paper.json` (everything, per prompt), `paper.md` (the table, and the paper's beside it)
and `paper_ratios.png` (both by ssd_jax/tools/bench_paper_report.py) to --out (default
`benchmarks/results/paper-<date>-<time>/`); raw worker results and logs under it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from ssd_jax.tools.bench_paper_report import PAPER, plot, render_markdown  # noqa: F401

N_BOOT = 2000
LEVEL = 0.95

# ------------------------------------------------------------------------------------------ statistics
def ratio_interval(num_tokens, num_seconds, den_tokens, den_seconds, *, level: float = LEVEL,
                   n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high): the ratio of two modes' tokens/s over prompts, (Σ num_tokens / Σ
    num_seconds) / (Σ den_tokens / Σ den_seconds), and its percentile-bootstrap interval: n_boot
    resamples of the prompts with replacement (prompt i's four figures drawn together), the
    (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled ratios."""
    a = [np.asarray(x, dtype=np.float64) for x in (num_tokens, num_seconds, den_tokens, den_seconds)]
    n = len(a[0])
    if n == 0 or any(len(x) != n for x in a):
        raise ValueError(f"need the same number (>= 1) of figures per prompt, got "
                         f"{[len(x) for x in a]}")
    if min(x.sum() for x in a) <= 0:
        raise ValueError("tokens and seconds must sum to > 0 in both modes")

    def ratio(nt, ns, dt, ds):
        return (nt / ns) / (dt / ds)

    point = float(ratio(*(x.sum() for x in a)))
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    sums = [x[idx].sum(axis=1) for x in a]
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = ratio(*sums)
    boots = boots[np.isfinite(boots)]
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return point, float(lo), float(hi)


def _median(xs):
    return float(np.median(xs)) if len(xs) else None


def _mean_tokens(hist) -> float | None:
    total = sum(hist)
    return sum((j + 1) * c for j, c in enumerate(hist)) / total if total else None


def _sum_hist(rows, key="accept_hist"):
    hists = [r[key] for r in rows if r.get(key)]
    return [int(sum(h)) for h in zip(*hists)] if hists else []


def summarize(ar: list, sd: list, ssd: list, k_sd: int, k_ssd: int) -> dict:
    """One dataset's row from its per-prompt records (the workers' `prompts` entries) of AR and SD
    (core A) and SSD (cores A + B), paired by prompt id."""
    from ssd_jax.algorithm import policy

    ids = [r["id"] for r in ar]
    for mode, rows in (("sd", sd), ("ssd", ssd)):
        if [r["id"] for r in rows] != ids:
            raise ValueError(f"the {mode} run's prompts differ from the AR run's")
    fig = {m: (np.array([r["timed_tokens"] for r in rows], float),
               np.array([r["decode_s"] for r in rows], float))
           for m, rows in (("ar", ar), ("sd", sd), ("ssd", ssd))}
    row = dict(prompts=len(ids), ids=ids)
    for m, (tok, sec) in fig.items():
        row[f"{m}_tokens_per_s"] = float(tok.sum() / sec.sum()) if sec.sum() > 0 else None
    for num, den in (("ssd", "sd"), ("ssd", "ar"), ("sd", "ar")):
        try:
            p, lo, hi = ratio_interval(*fig[num], *fig[den])
            row[f"{num}_over_{den}"] = dict(point=p, low=lo, high=hi)
        except ValueError:
            row[f"{num}_over_{den}"] = None
    hist_sd, hist_ssd = _sum_hist(sd), _sum_hist(ssd)
    row["sd_tokens_per_round"], row["ssd_tokens_per_round"] = _mean_tokens(hist_sd), \
        _mean_tokens(hist_ssd)
    row["sd_acceptance"] = policy.acceptance_from_hist(hist_sd) if sum(hist_sd) else None
    row["ssd_acceptance"] = policy.acceptance_from_hist(hist_ssd) if sum(hist_ssd) else None
    hits, lookups = sum(r.get("hits", 0) for r in ssd), sum(r.get("lookups", 0) for r in ssd)
    row.update(hits=hits, lookups=lookups, hit_rate=hits / lookups if lookups else None)
    row["agree_with_ar"] = {m: sum(a["token_ids"] == b["token_ids"] for a, b in zip(ar, rows))
                            for m, rows in (("sd", sd), ("ssd", ssd))}

    # the §6 model from this dataset's medians (ALGORITHM.md §6, ssd_jax.algorithm.policy)
    t1 = _median([s for r in ar for s in r.get("step_s", [])])
    steady = {m: {key: [x for r in rows for x in r.get("steady", {}).get(key, [])]
                  for key in ("verify_s", "draft_s", "backup_s")} for m, rows in (("sd", sd),
                                                                                   ("ssd", ssd))}
    inputs = dict(t1_s=t1, sd_verify_s=_median(steady["sd"]["verify_s"]),
                  sd_draft_step_s=(_median(steady["sd"]["draft_s"]) or 0) / k_sd or None,
                  ssd_verify_s=_median(steady["ssd"]["verify_s"]),
                  ssd_tree_s=_median(steady["ssd"]["draft_s"]),
                  ssd_backup_s=float(np.mean([b for b in steady["ssd"]["backup_s"] if b > 0]))
                  if any(b > 0 for b in steady["ssd"]["backup_s"]) else 0.0,
                  e_hit=_mean_tokens(_sum_hist(ssd, "accept_hist_after_hit")) or 1.0,
                  e_miss=_mean_tokens(_sum_hist(ssd, "accept_hist_after_miss")) or 1.0)
    pred_sd = pred_ssd = None
    if t1 and inputs["sd_verify_s"] and inputs["sd_draft_step_s"] and row["sd_acceptance"] is not None:
        pred_sd = policy.sd_speedup(t1, inputs["sd_verify_s"], inputs["sd_draft_step_s"], k_sd,
                                    row["sd_acceptance"])
    if t1 and inputs["ssd_verify_s"] and inputs["ssd_tree_s"] and row["hit_rate"] is not None:
        pred_ssd = policy.ssd_speedup(t1, inputs["ssd_verify_s"], inputs["ssd_tree_s"],
                                      inputs["ssd_backup_s"], row["hit_rate"], inputs["e_hit"],
                                      inputs["e_miss"])
    row["predicted"] = dict(inputs=inputs, sd_over_ar=pred_sd, ssd_over_ar=pred_ssd,
                            ssd_over_sd=pred_ssd / pred_sd if pred_sd and pred_ssd else None)
    return row


def average_row(rows: list[dict]) -> dict:
    """The mean of the dataset rows' figures (as the paper's average row), no intervals."""
    def mean(get):
        vals = [v for v in (get(r) for r in rows) if v is not None]
        return float(np.mean(vals)) if vals else None
    out = dict(prompts=sum(r["prompts"] for r in rows))
    for key in ("ar_tokens_per_s", "sd_tokens_per_s", "ssd_tokens_per_s", "sd_tokens_per_round",
                "ssd_tokens_per_round", "hit_rate"):
        out[key] = mean(lambda r: r.get(key))
    for key in ("ssd_over_sd", "ssd_over_ar", "sd_over_ar"):
        out[key] = dict(point=mean(lambda r: (r.get(key) or {}).get("point")), low=None, high=None)
    out["predicted"] = {key: mean(lambda r: r["predicted"].get(key))
                        for key in ("sd_over_ar", "ssd_over_ar", "ssd_over_sd")}
    return out


# ------------------------------------------------------------------------------------------ run
def _validate(args) -> None:
    """Every suite flag, before any model loads or worker starts (ValueError naming the flag)."""
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.runtime.engine import SSDConfig
    from ssd_jax.tools.flags import DEFAULT_K, default_fanout, resolve_formats

    if args.prompts_file is not None or args.limit:
        raise ValueError("--suite paper takes its prompts from ssd_jax.tools.datasets: use "
                         "--datasets and --per-dataset, not --prompts-file / --limit")
    if args.layouts is not None or args.modes is not None:
        raise ValueError("--suite paper runs its own layouts (AR and SD on core A, SSD on A + B) "
                         "and every mode: drop --layouts / --modes")
    if args.hf == "yes":
        raise ValueError("--suite paper does not run HF transformers: drop --hf yes")
    if args.per_dataset < 1:
        raise ValueError(f"--per-dataset must be >= 1, got {args.per_dataset}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.fanout == "plan":
        args.k_ssd, args.fanout_used = args.k, None
    else:
        fan = tuple(args.fanout) if args.fanout else default_fanout(DEFAULT_K["ssd"])
        SSDConfig(fanout=fan, saguaro_c=args.saguaro_c, backup=args.backup).lists(len(fan) - 1)
        args.k_ssd, args.fanout_used = len(fan) - 1, fan
    resolve_formats(args, "auto", "auto")


def _plan(res: dict, k: int) -> tuple[int, ...]:
    """The fan-out policy.plan_from_sd picks at SD's K from the AR and SD runs (every prompt)."""
    from ssd_jax.algorithm import policy

    ar, sd = res["modes"]["ar"]["prompts"], res["modes"]["sd"]["prompts"]
    t1 = _median([s for r in ar for s in r["step_s"]])
    tv = _median([x for r in sd for x in r["steady"]["verify_s"]])
    draft = _median([x for r in sd for x in r["steady"]["draft_s"]])
    if not (t1 and tv and draft):
        raise ValueError("--fanout plan: the AR / SD runs had no steady rounds to plan from "
                         "(more --max-new-tokens)")
    return tuple(policy.plan_from_sd(t1, tv, draft, _sum_hist(sd), ks=(k,)).fanout)


def run(args) -> int:
    """`ssd-jax bench --suite paper`."""
    from ssd_jax.models.load import _tokenizer
    from ssd_jax.models import hub
    from ssd_jax.tools import datasets
    from ssd_jax.tools.bench import (BenchError, _check_models, _default_cores, _loadavg,
                                     _run_worker, machine_info)
    from ssd_jax.tools.bench_report import _jsonable
    from ssd_jax.tools.benchmark_set import MAX_NEW_TOKENS

    _validate(args)
    _check_models(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = MAX_NEW_TOKENS
    prompts, provenance, notes = [], {}, []
    for name in args.datasets:
        ds = datasets.get(name)
        n = min(args.per_dataset, ds.count)
        if n < args.per_dataset:
            notes.append(f"{name} has {ds.count} prompts: all {ds.count} used")
        prompts += datasets.prompts(name, n, cache_dir=args.cache_dir)
        provenance[name] = datasets.describe(name)
    if any(p["chat"] for p in prompts) and \
            not _tokenizer(hub.resolve(args.target, args.cache_dir)).chat_template:
        raise ValueError(f"{args.target}: its tokenizer has no chat template, which the chat sets "
                         f"need (--datasets humaneval runs without one)")
    cores = list(args.cores or _default_cores())
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("benchmarks") / "results" / f"paper-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    for note in notes:
        print(f"ssd-jax: {note}", file=sys.stderr)
    base = dict(target=args.target, draft=args.draft, dtype=args.dtype, cache_dir=args.cache_dir,
                prompts=prompts, max_new_tokens=args.max_new_tokens, k=args.k,
                saguaro_c=args.saguaro_c, backup=args.backup, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, warmup=args.warmup,
                max_len=args.max_len, cores=cores, hf_dtype="float32",
                draft_quant=args.draft_quant, draft_vocab=args.draft_vocab)
    report = dict(command=shlex.join(["ssd-jax", *getattr(args, "argv", sys.argv[1:])]),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), loadavg_start=_loadavg(), note=args.note,
                  datasets=provenance, notes=notes, layouts={}, errors={},
                  interval=dict(method="percentile bootstrap over prompts (paired), ratio of "
                                "summed tokens over summed seconds", resamples=N_BOOT,
                                level=LEVEL, seed=0))
    per_mode = len(prompts) + (1 if args.warmup else 0)
    jobs = [("colocated", [cores[0]], 1, dict(base, modes=["ar", "sd"], fanout=None,
                                               k_modes={"sd": args.k}))]
    fanout = args.fanout_used
    for kind, cs, threads, job in jobs + [("two-process", cores, 2, None)]:
        if job is None:  # SSD, after the plan (if any) is known
            if fanout is None:
                fanout = _plan(report["layouts"]["colocated"], args.k)
            job = dict(base, modes=["ssd"], fanout=list(fanout), k_modes={"ssd": len(fanout) - 1})
        job_path = out / f"job-{kind}.json"
        job_path.write_text(json.dumps(job, indent=1))
        try:
            report["layouts"][kind] = _run_worker(kind, cs, threads, job_path, out,
                                                  per_mode * len(job["modes"]))
        except BenchError as e:
            report["errors"][kind] = str(e)
            break
    report["config"] = dict({k: v for k, v in base.items() if k != "prompts"},
                            k_sd=args.k, k_ssd=len(fanout) - 1 if fanout else args.k_ssd,
                            fanout=list(fanout) if fanout else None,
                            planned=args.fanout == "plan", per_dataset=args.per_dataset,
                            datasets=list(args.datasets))
    report["loadavg_end"] = _loadavg()
    if not report["errors"]:
        cfg = report["config"]
        rows = {}
        for name in args.datasets:
            def of(kind, mode, name=name):
                return [r for r in report["layouts"][kind]["modes"][mode]["prompts"]
                        if r["dataset"] == name]
            rows[name] = summarize(of("colocated", "ar"), of("colocated", "sd"),
                                   of("two-process", "ssd"), cfg["k_sd"], cfg["k_ssd"])
        report["results"], report["average"] = rows, average_row(list(rows.values()))
    report = _jsonable(report)
    (out / "paper.json").write_text(json.dumps(report, indent=1))
    if report["errors"]:
        raise BenchError("; ".join(report["errors"].values()) + f" (partial results: {out})")
    md = render_markdown(report)
    (out / "paper.md").write_text(md)
    pngs = plot(report, out)
    print(md)
    print(f"wrote {out / 'paper.json'}, {out / 'paper.md'}"
          + "".join(f", {p}" for p in pngs))
    return 0
