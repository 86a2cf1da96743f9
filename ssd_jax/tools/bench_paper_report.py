"""`ssd-jax bench --suite paper`'s report: the paper's published numbers (its §7;
docs/ALGORITHM.md cites it), paper.md (this run's table per dataset, the paper's beside it) and paper_ratios.png
(ssd_jax/tools/bench_paper.py runs the suite)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# The paper's numbers (its §7): batch 1, greedy, 512 output tokens, 128 prompts per dataset.
# (AR, SD, SSD tokens/s, SSD/SD, SSD/AR); None where the paper gives no figure.
PAPER = {
    "llama": dict(pair="Llama-3.1-70B / Llama-3.2-1B", hardware="target on 4 H100 (TP 4), draft "
                  "on a 5th H100; SD K=6, SSD K=7, F=3",
                  rows={"HumanEval": (54.7, 176, 283, 1.60, 5.17),
                        "UltraFeedback": (54.7, 138, 215, 1.55, 3.93),
                        "Alpaca": (54.7, 145, 224, 1.55, 4.10),
                        "GSM8K": (54.7, 188, 301, 1.60, 5.50),
                        "average": (54.7, 162, 256, 1.58, 4.68)}),
    "qwen": dict(pair="Qwen3-32B / Qwen3-0.6B", hardware="as above",
                 rows={"average": (88.8, 136.8, 203.8, 1.49, None)}),
}


# ------------------------------------------------------------------------------------------ report
def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _ci(r):
    if not r or r.get("point") is None:
        return "—"
    if r.get("low") is None:
        return f"{r['point']:.2f}x"
    return f"{r['point']:.2f}x ({r['low']:.2f}-{r['high']:.2f})"


def render_markdown(rep: dict) -> str:
    """paper.md: the run's table per dataset, then the paper's."""
    from ssd_jax.tools.bench_report import _features

    cfg, mach = rep["config"], rep["machine"]
    versions = ", ".join(f"{m} {mach[m]}" for m in ("jax", "jaxlib") if m in mach)
    out = ["# ssd-jax bench --suite paper", "",
           f"- command: `{rep['command']}`", f"- date: {rep['date']}",
           f"- machine: {mach.get('cpu', '?')}, {mach.get('cpu_count')} CPUs (usable "
           f"{mach.get('usable_cpus', '?')}), {mach.get('memory_gib', '?')} GiB; {versions}",
           f"- CPU features: {_features(mach)}",
           f"- load average (1/5/15 min) at start {rep.get('loadavg_start')}, at end "
           f"{rep.get('loadavg_end')}",
           f"- target `{cfg['target']}` ({cfg['dtype']}), draft `{cfg['draft']}` "
           f"({cfg['draft_quant']}); SD K={cfg['k_sd']}; SSD K={cfg['k_ssd']}, fan-out "
           f"{','.join(map(str, cfg['fanout']))}{' (planned)' if cfg.get('planned') else ''}, "
           f"backup {cfg['backup']}, Saguaro C={cfg['saguaro_c']}; temperature "
           f"{cfg['temperature']}; batch 1; at most {cfg['max_new_tokens']} new tokens",
           f"- layout: AR and SD in one process on core {cfg['cores'][0]} (target and draft "
           f"colocated); SSD with the target on core {cfg['cores'][0]} and the draft in its own "
           f"process on core {cfg['cores'][1]}"]
    if rep.get("note"):
        out.append(f"- note: {rep['note']}")
    out += ["", "Tokens/s: steady state, summed over the dataset's prompts. Ratios: one mode's "
            "tokens/s over another's, with a 95% percentile-bootstrap interval over prompts "
            f"({rep['interval']['resamples']} resamples). Predicted: the §6 model (ssd_jax.algorithm.policy) from the "
            "dataset's measured medians, acceptance and hit rate. Average: the mean of the rows.",
            "", "| dataset (serves as) | prompts | AR tok/s | SD tok/s | SSD tok/s | SSD/SD | SSD/AR "
            "| SD/AR | tokens/round SD / SSD | hit rate | predicted SSD/AR | predicted SSD/SD |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(f"{name} ({rep['datasets'][name]['paper']})", rep["results"][name])
            for name in rep["results"]]
    if len(rows) > 1:
        rows.append(("average", rep["average"]))
    for label, r in rows:
        p = r["predicted"]
        out.append(f"| {label} | {r['prompts']} | {_f(r['ar_tokens_per_s'])} "
                   f"| {_f(r['sd_tokens_per_s'])} | {_f(r['ssd_tokens_per_s'])} "
                   f"| {_ci(r['ssd_over_sd'])} | {_ci(r['ssd_over_ar'])} | {_ci(r['sd_over_ar'])} "
                   f"| {_f(r['sd_tokens_per_round'])} / {_f(r['ssd_tokens_per_round'])} "
                   f"| {_f(r['hit_rate'])} | {_f(p['ssd_over_ar'], '{:.2f}x')} "
                   f"| {_f(p['ssd_over_sd'], '{:.2f}x')} |")
    agree = [f"{n}: SD {r['agree_with_ar']['sd']}/{r['prompts']}, SSD "
             f"{r['agree_with_ar']['ssd']}/{r['prompts']}" for n, r in rep["results"].items()]
    out += ["", "Outputs equal to AR's, token for token (greedy; a near-tie may differ): "
            + "; ".join(agree) + ".", ""]
    stand = [f"{n} for {d['paper']} ({d['stand_in']})" for n, d in rep["datasets"].items()
             if d.get("stand_in")]
    if stand:
        out += ["Stand-ins: " + "; ".join(stand) + ".", ""]
    for key in ("llama", "qwen"):
        paper = PAPER[key]
        out += [f"The paper, {paper['pair']} ({paper['hardware']}; 128 prompts, 512 tokens, "
                "greedy, batch 1):", "", "| dataset | AR tok/s | SD tok/s | SSD tok/s | SSD/SD "
                "| SSD/AR |", "|---|---|---|---|---|---|"]
        for name, (a, s, ss, r1, r2) in paper["rows"].items():
            out.append(f"| {name} | {a} | {s} | {ss} | {r1:.2f}x | {_f(r2, '{:.2f}x')} |")
        out.append("")
    if rep.get("errors"):
        out += ["Failed:"] + [f"- {k}: {v}" for k, v in rep["errors"].items()]
    return "\n".join(out) + "\n"


def plot(rep: dict, out: Path) -> list[Path]:
    """paper_ratios.png: SSD/SD and SSD/AR per dataset with their intervals, the paper's beside."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e \".[notebooks]\")",
              file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rep["results"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, pcol in ((axes[0], "ssd_over_sd", 3), (axes[1], "ssd_over_ar", 4)):
        x = np.arange(len(names))
        pts = [rep["results"][n][key] or {} for n in names]
        y = [p.get("point") or 0.0 for p in pts]
        err = [[max(p["point"] - p["low"], 0) if p.get("low") is not None else 0 for p in pts],
               [max(p["high"] - p["point"], 0) if p.get("high") is not None else 0 for p in pts]]
        ax.bar(x - 0.2, y, 0.4, yerr=err, capsize=3, label="this run (95% interval)")
        paper = [PAPER["llama"]["rows"].get(rep["datasets"][n]["paper"], (None,) * 5)[pcol]
                 for n in names]
        ax.bar(x + 0.2, [p or 0 for p in paper], 0.4, label="paper (70B/1B, 5 H100)")
        ax.axhline(1.0, color="k", lw=0.7)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{n}\n({rep['datasets'][n]['paper']})" for n in names], fontsize=8)
        ax.set_title(key.replace("_over_", "/").upper())
        ax.legend(fontsize=7)
    fig.suptitle("ssd-jax bench --suite paper: speed-ups per dataset")
    fig.tight_layout()
    path = out / "paper_ratios.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
