"""A PROJECTION, not a measurement: AR, SD and SSD tokens/s on the paper's machines (H100 SXM; the
target TP 4 over four GPUs, the draft on a fifth), from a roofline model of each forward and the
acceptance, hit rates and tokens per round that we measured on our pair (Qwen2.5-Coder-1.5B /
0.5B on a CPU), put through the formulas the planner uses (ssd_jax.algorithm.policy: sd_speedup,
ssd_speedup, Costs.tree, hit_probability, plan). Printed beside the paper's numbers
(the paper's §7; docs/ALGORITHM.md cites it).

    python benchmarks/paper_projection.py --results benchmarks/results/paper-<date>/paper.json
    python benchmarks/paper_projection.py --acceptance 0.86 --hit-rate 0.85   # no results file
    python benchmarks/paper_projection.py --results paper.json --measure      # on a GPU: measured

`--measure` (a GPU at hand) measures instead of predicting: `EngineCosts` times the engine itself
(AR, SD at K = 1 and 8, the draft's width) on random pairs of the published shapes cut to
`--layers`, on the one device, and the same formulas turn our acceptance and hit rates into
tokens/s; the Qwen pair's full 32B target fits one H200 in bf16 (`--layers 64`), the 70B does not.

The roofline: one forward over T tokens (R rows of them: tree branches) of a model at TP t takes
max(bytes / HBM bandwidth, FLOPs / peak FLOP/s) on each GPU, with bytes = the weights it streams
(every layer's matrices and norms, the LM head; bf16) / t + the KV cache it reads, and FLOPs =
2 x matrix parameters x T R + the attention's 4 x layers x heads x head_dim x context x T R, both
split over t; plus, at t > 1, two ring all-reduces a layer of T R x hidden bf16 values over NVLink
(2 (t-1)/t x bytes / link bandwidth). Machines: H100 SXM, 3.35 TB/s HBM3, 989 TFLOP/s dense bf16,
NVLink 4 at 450 GB/s a direction. Shapes: the published configs of Llama-3.1-70B / Llama-3.2-1B and
Qwen3-32B / Qwen3-0.6B (layers, hidden size, heads, KV heads, head_dim, MLP width, vocabulary, tied
embeddings).

The branches of a tree step share one cached prefix, read once (as a tree-attention kernel
reads it). `--overhead-us` adds a fixed time to every forward, to see how launch overheads move
the figures; by default there is none.

From the roofline: T_1 (a target decode step), T_v (a K+1-token verify), T_d (a draft step), the
width slope of a draft forward (its cost per extra branch), hence T_p = `Costs.tree(K, MQ)` and
the neural backup T_b = K T_d. Three configurations per dataset:
- ours: SD at our SD K with our measured tokens per round; SSD at our K and fan-out with our
  measured hit rate and tokens per round after hits and misses;
- paper's K: SD at K = 6, SSD at K = 7 with F = 3 per position (the paper's settings), tokens per
  round E = (1 - a^(K+1)) / (1 - a) from our per-token acceptance a, the hit rate from the
  planner's miss model (c = 1 - a, r = 1: `policy.plan_from_sd`'s defaults);
- planner: `policy.plan` on these costs (K 1..8, every budget up to 4 (K+1)), SD at the same K.
"implied a": the acceptance at which this roofline's SD at K = 6 gives the paper's SD/AR.

WHAT THE MODEL LEAVES OUT (so read ratios, not absolute tokens/s): kernel efficiency (no kernel
reaches the roofline: the paper's 54.7 tok/s AR is ~57% of this model's 70B decode); kernel launch
and framework overheads per step (they dominate a 1B draft's ~0.7 ms step: a real one takes a few
ms, which lengthens T_d and T_p and is the largest error here); all-reduce latency (two a layer,
~5-10 us each: 0.8-1.6 ms per 70B step) and the NVSwitch's in-network reduction; the transfers
between the draft's GPU and the target's (a few integers a round, but each a latency); sampling,
verification and scheduling time; prefill; the KV cache growing along 512 tokens (a fixed mean
context is used); batch > 1; and, most of all, the acceptance: ours is the Qwen2.5-Coder 1.5B /
0.5B pair's on our sample of our stand-in datasets, not the Llama or Qwen3 pairs' on theirs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ssd_jax.algorithm import fanout as fo  # noqa: E402
from ssd_jax.algorithm import policy  # noqa: E402

BF16 = 2  # bytes a value


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's published config: what a forward streams and computes."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # the LM head is the embedding table
    qk_norm: bool = False  # Qwen3: an RMSNorm over q and k heads (head_dim weights each)

    def layer_matrix_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate  # q, k, v, o; gate, up, down

    def layer_params(self) -> int:
        return self.layer_matrix_params() + 2 * self.hidden + (2 * self.head_dim if self.qk_norm
                                                               else 0)

    def matrix_params(self) -> int:
        """Parameters in matrix products per token: every layer's and the LM head's."""
        return self.layers * self.layer_matrix_params() + self.vocab * self.hidden

    def streamed_params(self) -> int:
        """What one forward reads: the layers, the final norm and the LM head (embedding rows
        for the T input tokens are negligible)."""
        return self.layers * self.layer_params() + self.hidden + self.vocab * self.hidden

    def params(self) -> int:
        """All parameters (the published count): streamed + the embedding when untied."""
        return self.streamed_params() + (0 if self.tied else self.vocab * self.hidden)

    def kv_bytes(self, context: int) -> int:
        """K and V of `context` positions, every layer (bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * context * BF16


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float  # one direction, per GPU


H100 = Machine("H100 SXM", 3.35e12, 989e12, 450e9)

# Published configs (config.json of each model on its hub page).
LLAMA_70B = Shape("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, tied=False)
LLAMA_1B = Shape("Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, tied=True)
QWEN3_32B = Shape("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, tied=False, qk_norm=True)
QWEN3_06B = Shape("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, tied=True, qk_norm=True)
PAIRS = {"llama": (LLAMA_70B, LLAMA_1B), "qwen": (QWEN3_32B, QWEN3_06B)}


def forward_time(shape: Shape, machine: Machine, tokens: int = 1, context: int = 512,
                 tp: int = 1, rows: int = 1, overhead_s: float = 0.0) -> float:
    """Seconds of one forward over `tokens` tokens in each of `rows` rows (tree branches sharing
    one cached prefix of `context` positions, read once), split over `tp` GPUs: the roofline
    max(bytes / HBM, FLOPs / peak) + the ring all-reduces (2 a layer) over the link at tp > 1 +
    `overhead_s` (launches and framework: 0 unless given)."""
    n = tokens * rows
    bytes_ = (shape.streamed_params() * BF16 + shape.kv_bytes(context)) / tp
    flops = (2 * shape.matrix_params() * n
             + 4 * shape.layers * shape.heads * shape.head_dim * context * n) / tp
    t = max(bytes_ / machine.hbm_bytes_per_s, flops / machine.flops_per_s)
    if tp > 1:
        msg = n * shape.hidden * BF16
        t += 2 * shape.layers * 2 * (tp - 1) / tp * msg / machine.link_bytes_per_s
    return t + overhead_s


def costs(target: Shape, draft: Shape, machine: Machine, k: int, mq: int, tp: int = 4,
          context: int = 512, overhead_s: float = 0.0) -> policy.Costs:
    """policy.Costs from the roofline: T_1, T_v at K, T_d, and the draft's width slope measured
    between 1 and mq rows (`policy.width_slope_from_times`)."""
    t1 = forward_time(target, machine, 1, context, tp, overhead_s=overhead_s)
    tv = forward_time(target, machine, k + 1, context, tp, overhead_s=overhead_s)
    td = forward_time(draft, machine, 1, context, overhead_s=overhead_s)
    slope = policy.width_slope_from_times({1: td, max(mq, 2): forward_time(
        draft, machine, 1, context, rows=max(mq, 2), overhead_s=overhead_s)})
    return policy.Costs(t1=t1, tv=tv, td=td, width_slope=slope)


def implied_acceptance(c: policy.Costs, k: int, sd_over_ar: float) -> float | None:
    """The a at which sd_speedup(T_1, T_v, T_d, K, a) equals `sd_over_ar` (bisection); None when
    no a in [0, 1] reaches it."""
    f = lambda a: policy.sd_speedup(c.t1, c.tv, c.td, k, a) - sd_over_ar  # noqa: E731
    lo, hi = 0.0, 1.0
    if f(lo) > 0 or f(hi) < 0:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass
class Measured:
    """What our run measured for one dataset (only `acceptance` is required)."""
    acceptance: float
    hit_rate: float | None = None
    k_sd: int = 4
    k_ssd: int = 5
    fanout: tuple[int, ...] | None = None
    sd_tokens_per_round: float | None = None
    e_hit: float | None = None
    e_miss: float | None = None


class RooflineCosts:
    """The roofline's T_1, T_v, T_d and width slope (module docstring) as `policy.Costs`."""
    label = "roofline"

    def __init__(self, target: Shape, draft: Shape, machine: Machine = H100, tp: int = 4,
                 context: int = 512, overhead_s: float = 0.0):
        self.target, self.draft, self.machine = target, draft, machine
        self.tp, self.context, self.overhead_s = tp, context, overhead_s

    def costs(self, k: int, mq: int) -> policy.Costs:
        return costs(self.target, self.draft, self.machine, k, mq, self.tp, self.context,
                     self.overhead_s)

    def tv(self, k: int) -> float:
        return forward_time(self.target, self.machine, k + 1, self.context, self.tp,
                            overhead_s=self.overhead_s)


class EngineCosts:
    """The same quantities MEASURED by the engine on this process's default JAX device (a GPU:
    `--measure`), with a random pair shaped like (target, draft), each cut to `layers` layers:

    T_1 the median steady AR round; T_v and T_d from SD runs at K = 1 and K = 8 (median verify;
    median drafting / K), T_v linear in K between them; the draft's width slope from
    `Engine.draft_width_slope` (one draft forward 1 and 8 rows wide). A cut model's times are
    scaled to the full depth by the bytes a forward streams (`Shape.streamed_params` and the KV
    cache: batch-1 decode is memory-bound). Random weights make the times real and the acceptance
    meaningless: the acceptance and hit rates stay ours. One device: no TP, the draft beside the
    target (the formulas assume the overlap the paper's fifth GPU gives)."""
    label = "measured"

    def __init__(self, target: Shape, draft: Shape, layers: int = 4, context: int = 512,
                 new_tokens: int = 24, ks: tuple[int, int] = (1, 8), seed: int = 0):
        import jax
        import numpy as np

        from ssd_jax.models.config import tiny_config
        from ssd_jax.models.model import Model
        from ssd_jax.models.params import init_params
        from ssd_jax.runtime.engine import Engine

        def build(shape: Shape, seed: int) -> tuple[Model, float]:
            n = min(layers, shape.layers)
            cfg = tiny_config("qwen3" if shape.qk_norm else "llama", vocab_size=shape.vocab,
                              hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                              num_layers=n, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                              head_dim=shape.head_dim, tie_embeddings=shape.tied,
                              max_position_embeddings=context + new_tokens + 64, dtype="bfloat16")
            cut = dataclasses.replace(shape, layers=n)
            scale = ((shape.streamed_params() * BF16 + shape.kv_bytes(context))
                     / (cut.streamed_params() * BF16 + cut.kv_bytes(context)))
            # drawn on the device: a 32B layer's NumPy draw would take the host minutes
            return Model(cfg, init_params(cfg, jax.random.key(seed), scale=0.02)), scale

        (t_model, self.t_scale), (d_model, self.d_scale) = build(target, seed), build(draft, seed + 1)
        self.device = str(jax.devices()[0])
        self.layers = layers
        eng = Engine(t_model, d_model, placement="colocated", max_len=context + new_tokens + 64,
                     compilation_cache=False)
        prompt = [int(x) for x in np.random.default_rng(seed).integers(0, min(target.vocab, draft.vocab),
                                                                       context)]
        kw = dict(max_new_tokens=new_tokens, eos_ids=[])

        def steady(metrics, field):
            rounds = [r for r in metrics.timeline if not r.compiled] or metrics.timeline
            return float(np.median([getattr(r, field) for r in rounds]))

        for mode in ("ar",) + ("sd",) * len(ks):  # compile every shape outside the timing
            eng.generate([prompt], mode=mode, k=ks[0], max_new_tokens=4, eos_ids=[])
        self.t1 = steady(eng.generate([prompt], mode="ar", **kw).metrics, "round_s") * self.t_scale
        self._tv, self._td = {}, {}
        for k in ks:
            eng.generate([prompt], mode="sd", k=k, max_new_tokens=4, eos_ids=[])
            m = eng.generate([prompt], mode="sd", k=k, timeline=True, **kw).metrics
            self._tv[k] = steady(m, "verify_s") * self.t_scale
            self._td[k] = steady(m, "draft_s") / k * self.d_scale
        self.td = float(np.mean(list(self._td.values())))
        self.width_slope = float(eng.draft_width_slope())
        self.ks = ks

    def costs(self, k: int, mq: int) -> policy.Costs:
        return policy.Costs(t1=self.t1, tv=self.tv(k), td=self.td, width_slope=self.width_slope)

    def tv(self, k: int) -> float:
        (k0, k1), (v0, v1) = self.ks, (self._tv[self.ks[0]], self._tv[self.ks[1]])
        if k in (k0, k1):  # the measured values themselves (the line's arithmetic can miss
            return v0 if k == k0 else v1  # them by a rounding)
        return v0 + (v1 - v0) * (k - k0) / (k1 - k0)


def project(m: Measured, target: Shape, draft: Shape, machine: Machine = H100, tp: int = 4,
            context: int = 512, overhead_s: float = 0.0, cost_model=None) -> dict:
    """{config: {ar, sd, ssd (tokens/s), ssd_over_sd, ssd_over_ar, k_sd, k_ssd, fanout, p_hit}}
    for the configurations "ours", "paper's K" and "planner" (module docstring). `cost_model`:
    where T_1, T_v, T_d and the width slope come from (`RooflineCosts` of the other arguments
    unless given; `EngineCosts` for measured ones)."""
    cm = cost_model or RooflineCosts(target, draft, machine, tp, context, overhead_s)
    a = m.acceptance
    out = {}

    def row(c: policy.Costs, k_sd, e_sd, k_ssd, fan, p_hit, e_hit, e_miss, backup="neural"):
        ar = 1.0 / c.t1
        sd = ar * c.t1 * e_sd / (c.tv + k_sd * c.td)  # = ar * policy.sd_speedup(...) at E = e_sd
        tp_ = c.tree(k_ssd, sum(fan))
        tv = cm.tv(k_ssd)
        tb = k_ssd * c.td if backup == "neural" else c.t_backup_fast
        s = policy.ssd_speedup(c.t1, tv, tp_, tb, p_hit, e_hit, e_miss)
        return dict(ar=ar, sd=sd, ssd=ar * s, ssd_over_sd=ar * s / sd, ssd_over_ar=s,
                    k_sd=k_sd, k_ssd=k_ssd, fanout=list(fan), p_hit=p_hit, backup=backup,
                    t1_ms=c.t1 * 1e3, tv_ms=tv * 1e3, td_ms=c.td * 1e3, tree_ms=tp_ * 1e3)

    fan = tuple(m.fanout) if m.fanout else (0,) * m.k_ssd + (1,)
    c = cm.costs(m.k_sd, sum(fan))
    e_sd = m.sd_tokens_per_round or policy.expected_tokens(a, m.k_sd)
    e = policy.expected_tokens(a, m.k_ssd)
    p_ours = m.hit_rate if m.hit_rate is not None else \
        fo.hit_probability(fan, a, max(1 - a, 1e-3), 1.0)
    out["ours"] = row(c, m.k_sd, e_sd, m.k_ssd, fan, p_ours, m.e_hit or e, m.e_miss or e)

    fan7 = fo.uniform(7, 3)
    c6 = cm.costs(6, sum(fan7))
    p7 = fo.hit_probability(fan7, a, max(1 - a, 1e-3), 1.0)
    e7 = policy.expected_tokens(a, 7)
    out["paper's K"] = row(c6, 6, policy.expected_tokens(a, 6), 7, fan7, p7, e7, e7)

    # the planner: its own K and fan-out on the roofline's costs (width slope at MQ = 4 (K+1))
    best = None
    for k in range(1, 9):
        ck = cm.costs(k, 4 * (k + 1))
        p = policy.plan(ck, a, miss_c=max(1 - a, 1e-3), ks=(k,), vocab=target.vocab)
        if best is None or p.predicted_speedup > best[0].predicted_speedup:
            best = (p, ck)
    p, ck = best
    e = policy.expected_tokens(a, p.k)
    out["planner"] = row(ck, p.k, e, p.k, p.fanout, p.p_hit, e,
                         e if p.backup == "neural" else policy.expected_tokens(0.0, p.k), p.backup)
    return out


# ------------------------------------------------------------------------------------------ inputs
def measured_from_results(path: str) -> dict[str, tuple[str, Measured]]:
    """{dataset: (the paper's name for it, Measured)} from an `ssd-jax bench --suite paper`
    paper.json (ssd_jax.tools.bench_paper)."""
    rep = json.loads(open(path).read())
    cfg = rep["config"]
    out = {}
    for name, r in rep["results"].items():
        if r.get("sd_acceptance") is None:
            continue
        inp = r["predicted"]["inputs"]
        out[name] = (rep["datasets"][name]["paper"], Measured(
            acceptance=r["sd_acceptance"], hit_rate=r.get("hit_rate"), k_sd=cfg["k_sd"],
            k_ssd=cfg["k_ssd"], fanout=tuple(cfg["fanout"]),
            sd_tokens_per_round=r.get("sd_tokens_per_round"), e_hit=inp.get("e_hit"),
            e_miss=inp.get("e_miss")))
    if not out:
        raise SystemExit(f"{path}: no dataset with a measured SD acceptance")
    return out


def _f(x, fmt="{:.1f}"):
    return "—" if x is None else fmt.format(x)


def render(measured: dict, context: int, tp: int, overhead_s: float = 0.0,
           models: dict | None = None) -> str:
    """The markdown report; `models` ({pair key: EngineCosts}) switches every pair to measured
    costs (and the pairs to those keys)."""
    from ssd_jax.tools.bench_paper_report import PAPER

    if models:
        any_m = next(iter(models.values()))
        lines = [f"# MEASURED costs on {any_m.device} (the engine with random weights), not the "
                 "paper's machines", "",
                 f"T_1, T_v, T_d and the draft's width slope measured by `EngineCosts` (random pairs "
                 f"of the published shapes cut to {any_m.layers} layers, times scaled to full depth "
                 "by bytes streamed; one device, no TP); acceptance and hit rates: OURS, not the "
                 "paper's pairs'.", ""]
    else:
        lines = ["# A PROJECTION to the paper's hardware (roofline; not a measurement)", "",
                 f"H100 SXM ({H100.hbm_bytes_per_s / 1e12:.2f} TB/s HBM3, "
             f"{H100.flops_per_s / 1e12:.0f} TFLOP/s bf16, NVLink {H100.link_bytes_per_s / 1e9:.0f}"
             f" GB/s a direction); target TP {tp}, draft on a fifth GPU; batch 1, greedy; mean "
             f"context {context} positions; {overhead_s * 1e6:.0f} us of overhead a forward"
             f"{' (none: the roofline alone)' if not overhead_s else ''}. Acceptance and hit rates: OURS (Qwen2.5-Coder "
             "1.5B / 0.5B on a CPU, stand-in datasets), not the paper's pairs'. What the model "
             "leaves out: see the script's docstring (kernel efficiency, launch overheads, "
             "all-reduce latency, the paper's acceptance vs ours, ...).", ""]
    for key, (target, draft) in PAIRS.items():
        if models and key not in models:
            continue
        cm = models[key] if models else RooflineCosts(target, draft, H100, tp, context, overhead_s)
        paper = PAPER[key]
        lines += [f"## {target.name} / {draft.name} ({target.params() / 1e9:.1f}B / "
                  f"{draft.params() / 1e9:.2f}B parameters)", "",
                  "| dataset (ours → paper's) | a ours | implied a | config | K SD / SSD | "
                  "fan-out | p_hit | AR tok/s | SD tok/s | SSD tok/s | SSD/SD | SSD/AR | paper AR "
                  "/ SD / SSD | paper SSD/SD |", "|" + "---|" * 14]
        for name, (paper_name, m) in measured.items():
            proj = project(m, target, draft, H100, tp, context, overhead_s, cost_model=cm)
            prow = paper["rows"].get(paper_name) or paper["rows"].get("average")
            which = paper_name if paper_name in paper["rows"] else "average"
            c6 = cm.costs(6, 24)
            implied = implied_acceptance(c6, 6, prow[1] / prow[0]) if prow else None
            for i, (cfg, r) in enumerate(proj.items()):
                first = i == 0
                lines.append(
                    f"| {name + ' → ' + paper_name if first else ''} "
                    f"| {_f(m.acceptance, '{:.3f}') if first else ''} "
                    f"| {_f(implied, '{:.3f}') + f' ({which})' if first and implied else ''} "
                    f"| {cfg} | {r['k_sd']} / {r['k_ssd']} | {','.join(map(str, r['fanout']))} "
                    f"| {r['p_hit']:.2f} | {r['ar']:.1f} | {r['sd']:.1f} | {r['ssd']:.1f} "
                    f"| {r['ssd_over_sd']:.2f}x | {r['ssd_over_ar']:.2f}x "
                    f"| {f'{prow[0]} / {prow[1]} / {prow[2]}' if first else ''} "
                    f"| {f'{prow[3]:.2f}x ({which})' if first else ''} |")
        t = next(iter(measured.values()))[1]
        c = cm.costs(t.k_sd, 1)
        eff = paper["rows"]["average"][0] * c.t1
        lines += ["", f"{cm.label.capitalize()} times: T_1 {c.t1 * 1e3:.2f} ms (AR {1 / c.t1:.1f} tok/s; the "
                  f"paper's {paper['rows']['average'][0]} tok/s is {eff:.0%} of it), T_d "
                  f"{c.td * 1e3:.3f} ms.", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", help="paper.json of `ssd-jax bench --suite paper`")
    ap.add_argument("--acceptance", type=float, help="per-token acceptance a (no --results)")
    ap.add_argument("--hit-rate", type=float, default=None, help="our SSD hit rate (no --results)")
    ap.add_argument("--k-sd", type=int, default=4, help="our SD K (no --results; default 4)")
    ap.add_argument("--fanout", default=None,
                    help="our SSD fan-out F_0..F_K (no --results; default 0,0,0,0,0,1)")
    ap.add_argument("--sd-tokens-per-round", type=float, default=None,
                    help="our SD tokens per round (no --results; default from a)")
    ap.add_argument("--label", default="given", help="the row's name (no --results)")
    ap.add_argument("--context", type=int, default=512,
                    help="mean cached positions during generation (default 512)")
    ap.add_argument("--tp", type=int, default=4, help="the target's tensor parallelism (default 4)")
    ap.add_argument("--overhead-us", type=float, default=0.0,
                    help="microseconds added to every forward, target's and draft's (launches, "
                         "framework; default 0: left out)")
    ap.add_argument("--measure", action="store_true",
                    help="measure T_1, T_v, T_d and the width slope with the engine on this "
                         "machine's accelerator (random pairs of the published shapes, cut to "
                         "--layers) instead of the roofline; refuses a CPU unless --allow-cpu")
    ap.add_argument("--layers", type=int, default=4, help="--measure: layers of each random model "
                    "(default 4; times scaled to the full depth)")
    ap.add_argument("--pairs", default="qwen,llama", help="--measure: which pairs (default qwen,llama)")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: tiny shapes
    ap.add_argument("--json", help="also write the projection as JSON here")
    a = ap.parse_args(argv)
    models = None
    if a.measure:
        import jax
        keys = [x for x in a.pairs.split(",") if x]
        if not keys or any(x not in PAIRS for x in keys) or a.layers < 1:
            ap.error(f"--pairs: a subset of {','.join(PAIRS)}; --layers >= 1")
        if jax.default_backend() == "cpu" and not a.allow_cpu:
            ap.error("--measure measures on an accelerator; this JAX has only the CPU (the "
                     "roofline projection needs no --measure)")
    if (a.results is None) == (a.acceptance is None):
        ap.error("give --results paper.json, or --acceptance (and optionally --hit-rate ...)")
    if a.results:
        measured = measured_from_results(a.results)
    else:
        if not 0 <= a.acceptance <= 1 or (a.hit_rate is not None and not 0 <= a.hit_rate <= 1):
            ap.error("--acceptance and --hit-rate are in [0, 1]")
        fan = tuple(int(x) for x in a.fanout.split(",")) if a.fanout else (0,) * 5 + (1,)
        measured = {a.label: ("average", Measured(a.acceptance, a.hit_rate, a.k_sd, len(fan) - 1,
                                                  fan, a.sd_tokens_per_round))}
    over = a.overhead_us * 1e-6
    if a.measure:
        models = {key: EngineCosts(*PAIRS[key], layers=a.layers, context=a.context) for key in keys}
    text = render(measured, a.context, a.tp, over, models)
    print(text)
    if a.json:
        data = {key: {name: project(m, t, d, H100, a.tp, a.context, over,
                                    cost_model=models[key] if models else None)
                      for name, (_, m) in measured.items()}
                for key, (t, d) in PAIRS.items() if not models or key in models}
        with open(a.json, "w") as fh:
            json.dump(dict(projection=not models, measured_on=models and next(iter(models.values())).device, context=a.context, tp=a.tp, overhead_s=over,
                           machine=H100.__dict__,
                           inputs={n: dataclasses.asdict(m) for n, (_, m) in measured.items()},
                           pairs=data), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
