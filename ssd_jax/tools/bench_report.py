"""`ssd-jax bench`'s report: the markdown table, the plots, the token agreement between modes and
the JSON conversion of the workers' results (ssd_jax/tools/bench.py runs the workers, bench_workers.py
is what they run)."""
from __future__ import annotations

import math
import sys
from pathlib import Path


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many leading tokens two id lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _agreement(report: dict) -> None:
    """Per mode: leading tokens equal to AR of the same layout, per prompt (greedy outputs should
    agree up to fp near-ties); HF rows against the colocated (or first) layout's AR."""
    ref = None
    for lay in report["layouts"].values():
        ar = lay["modes"].get("ar")
        if ar is not None and ref is None:
            ref = ar
        for name, m in lay["modes"].items():
            if ar is not None:
                m["agree_with_ar"] = [f"{leading_equal(p['token_ids'], q['token_ids'])}/"
                                      f"{len(q['token_ids'])}" for p, q in zip(m["prompts"], ar["prompts"])]
    if "hf" in report and ref is not None:
        for m in report["hf"]["modes"].values():
            m["agree_with_ar"] = [f"{leading_equal(p['token_ids'], q['token_ids'])}/"
                                  f"{len(q['token_ids'])}" for p, q in zip(m["prompts"], ref["prompts"])]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        return _jsonable(x.item())
    return x


# ------------------------------------------------------------------------------------------ report
def _f(x, fmt="{:.2f}", none="—") -> str:
    return none if x is None else fmt.format(x)


def _features(mach: dict) -> str:
    """The machine's `cpu_features` in one line (ssd_jax.runtime.defaults.describe)."""
    from ssd_jax.runtime.defaults import describe
    f = mach.get("cpu_features")
    return describe(f) if f else "not recorded"


def _backend(lay: dict) -> str:
    """"cpu" or "target cpu, draft xla": the op tables a layout ran with."""
    b = lay.get("backend") or {}
    names = sorted(set(b.values()))
    if len(names) == 1:
        return names[0]
    return ", ".join(f"{k} {v}" for k, v in b.items()) or "?"


def render_markdown(rep: dict) -> str:
    """bench.md from a bench report dict (machine, config, per-layout and per-mode figures)."""
    cfg, mach = rep["config"], rep["machine"]
    versions = ", ".join(f"{m} {mach[m]}" for m in ("jax", "jaxlib", "flax", "torch", "transformers")
                         if m in mach)
    out = ["# ssd-jax bench", "",
           f"- command: `{rep['command']}`",
           f"- date: {rep['date']}",
           f"- machine: {mach.get('cpu', '?')}, {mach.get('cpu_count')} CPUs "
           f"(usable {mach.get('usable_cpus', '?')}), {mach.get('memory_gib', '?')} GiB, "
           f"{mach.get('platform')}, Python {mach.get('python')}",
           f"- CPU features: {_features(mach)}",
           f"- versions: {versions}",
           f"- load average (1/5/15 min) at start {rep.get('loadavg_start')}, at end "
           f"{rep.get('loadavg_end')}",
           f"- target `{cfg['target']}`, draft `{cfg['draft']}`, {cfg['dtype']}, K={cfg['k']}, "
           f"fan-out {cfg['fanout'] or 'uniform 1'}, Saguaro C={cfg['saguaro_c']}, backup "
           f"{cfg['backup']}, temperature {cfg['temperature']}, {len(rep['prompts'])} prompts "
           f"({rep['prompt_source']}), max {cfg['max_new_tokens']} new tokens"]
    if rep.get("note"):
        out.append(f"- note: {rep['note']}")
    out += ["",
            "Tokens/s: steady state (rounds without compiles), summed over prompts. Speed-up: over "
            "AR of the same layout. Predicted: ALGORITHM.md §6 from this run's measured times and rates "
            "(SSD: `metrics.predicted_speedup`; SD: T_1 E / (T_v + K T_d)), mean over prompts. "
            "Agree: leading tokens equal to AR of the same layout, per prompt.", "",
            "| layout | cores | backend | mode | tok/s | speed-up vs AR | predicted | tokens/round "
            "| acceptance | hit rate | agree with AR |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, lay in rep["layouts"].items():
        ar = lay["modes"].get("ar", {}).get("tokens_per_s")
        for mode, m in lay["modes"].items():
            sp = m["tokens_per_s"] / ar if ar and m.get("tokens_per_s") else None
            out.append(
                f"| {name} | {','.join(map(str, lay['cores']))} | {_backend(lay)} | {mode.upper()} "
                f"| {_f(m.get('tokens_per_s'))} | {_f(sp, '{:.2f}x') if mode != 'ar' else '1.00x'} "
                f"| {_f(m.get('predicted_speedup'), '{:.2f}x')} "
                f"| {_f(m.get('tokens_per_round')) if mode != 'ar' else '1.00'} "
                f"| {_f(m.get('per_token_acceptance')) if mode != 'ar' else '—'} "
                f"| {_f(m.get('hit_rate')) if mode == 'ssd' else '—'} "
                f"| {' '.join(m.get('agree_with_ar', [])) if mode != 'ar' else '—'} |")
    if "hf" in rep:
        h = rep["hf"]
        ar = h["modes"]["ar"]["tokens_per_s"]
        for mode, m in h["modes"].items():
            sp = m["tokens_per_s"] / ar if ar and m.get("tokens_per_s") else None
            out.append(f"| HF transformers ({h['dtype']}, {h['threads']} thread) "
                       f"| {','.join(map(str, h['cores']))} | torch "
                       f"| {'AR' if mode == 'ar' else 'assisted'} "
                       f"| {_f(m.get('tokens_per_s'))} | {_f(sp, '{:.2f}x')} | — | — | — | — "
                       f"| {' '.join(m.get('agree_with_ar', []))} |")
    if rep.get("errors"):
        out += ["", "Failed:"] + [f"- {k}: {v}" for k, v in rep["errors"].items()]
    return "\n".join(out) + "\n"


def plot(rep: dict, out: Path) -> list[Path]:
    """tokens_per_s.png, hit_rate.png, accepted_lengths.png, speedup.png (matplotlib, Agg)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e \".[notebooks]\")", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    groups = [(name, {m.upper(): v.get("tokens_per_s") for m, v in lay["modes"].items()})
              for name, lay in rep["layouts"].items()]
    if "hf" in rep:
        groups.append(("HF transformers", {("AR" if m == "ar" else "assisted"): v.get("tokens_per_s")
                                           for m, v in rep["hf"]["modes"].items()}))
    labels = list(dict.fromkeys(lbl for _, g in groups for lbl in g))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups) + 2), 4))
    width = 0.8 / max(len(labels), 1)
    for i, lbl in enumerate(labels):
        xs = [j + i * width for j, (_, g) in enumerate(groups) if g.get(lbl) is not None]
        ys = [g[lbl] for _, g in groups if g.get(lbl) is not None]
        bars = ax.bar(xs, ys, width, label=lbl)
        ax.bar_label(bars, fmt="%.2f" if max(ys or [0]) < 100 else "%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([name for name, _ in groups])
    ax.set_ylabel("tokens/s (steady state)")
    ax.set_title("tokens/s per mode and layout")
    top = max([v for _, g in groups for v in g.values() if v is not None] or [1.0])
    ax.set_ylim(0, top * 1.25)
    ax.legend(fontsize=8, loc="upper center", ncol=len(labels))
    paths.append(_save(fig, out / "tokens_per_s.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    names, hit, acc_sd, acc_ssd = [], [], [], []
    for name, lay in rep["layouts"].items():
        names.append(name)
        hit.append(lay["modes"].get("ssd", {}).get("hit_rate") or 0.0)
        acc_sd.append(lay["modes"].get("sd", {}).get("per_token_acceptance") or 0.0)
        acc_ssd.append(lay["modes"].get("ssd", {}).get("per_token_acceptance") or 0.0)
    x = np.arange(len(names))
    for off, ys, lbl in ((-0.27, hit, "SSD hit rate"), (0.0, acc_sd, "SD acceptance"),
                         (0.27, acc_ssd, "SSD acceptance")):
        bars = ax.bar(x + off, ys, 0.27, label=lbl)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels(names)
    ax.set_ylim(0, 1.25)
    ax.set_title("speculation-cache hit rate and per-token acceptance")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    paths.append(_save(fig, out / "hit_rate.png", plt))

    lays = list(rep["layouts"].items())
    fig, axes = plt.subplots(1, max(len(lays), 1), figsize=(4.5 * max(len(lays), 1), 3.6),
                             squeeze=False)
    k = rep["config"]["k"]
    for ax, (name, lay) in zip(axes[0], lays):
        series = [("SD", lay["modes"].get("sd", {}).get("accept_hist")),
                  ("SSD after hit", lay["modes"].get("ssd", {}).get("accept_hist_after_hit")),
                  ("SSD after miss", lay["modes"].get("ssd", {}).get("accept_hist_after_miss"))]
        series = [(lbl, h) for lbl, h in series if h and sum(h)]
        w = 0.8 / max(len(series), 1)
        for i, (lbl, h) in enumerate(series):
            ax.bar(np.arange(k + 1) + i * w, np.asarray(h) / sum(h), w, label=f"{lbl} (n={sum(h)})")
        ax.set_xticks(np.arange(k + 1) + w * (len(series) - 1) / 2)
        ax.set_xticklabels(range(k + 1))
        ax.set_xlabel("draft tokens accepted per round")
        ax.set_title(name)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of sequence-rounds")
    fig.suptitle("accepted-length distributions")
    paths.append(_save(fig, out / "accepted_lengths.png", plt))

    fig, ax = plt.subplots(figsize=(5, 4.5))
    top = 1.0
    for name, lay in rep["layouts"].items():
        ar = lay["modes"].get("ar", {}).get("tokens_per_s")
        for mode in ("sd", "ssd"):
            m = lay["modes"].get(mode)
            if not m or not ar or m.get("predicted_speedup") is None or not m.get("tokens_per_s"):
                continue
            meas, pred = m["tokens_per_s"] / ar, m["predicted_speedup"]
            ax.scatter([pred], [meas], s=50, marker="o" if mode == "ssd" else "s")
            ax.annotate(f"{name} {mode.upper()}", (pred, meas), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
            top = max(top, meas, pred)
    ax.plot([0, top * 1.15], [0, top * 1.15], "k--", lw=0.8, label="measured = predicted")
    ax.set_xlim(0, top * 1.15)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("predicted speed-up over AR (ALGORITHM.md §6)")
    ax.set_ylabel("measured speed-up over AR")
    ax.set_title("predicted vs measured speed-up")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "speedup.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

