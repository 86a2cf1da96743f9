"""End-to-end greedy generation on the benchmark set: ssd_jax AR and SD (colocated) vs HF transformers AR
and assisted generation, each framework in its own subprocess pinned to the same cores.

    python benchmarks/sd_vs_hf.py --cores 0 --prompts 4 --max-new-tokens 48
    python benchmarks/sd_vs_hf.py --cores 0,1            # all prompts, 128 new tokens

Target Qwen2.5-Coder-1.5B, draft Qwen2.5-Coder-0.5B, both fp32 in both frameworks, on the same
weights (the dequantized GGUFs). Prompts are raw text (`ssd_jax.tools.benchmark_set`), tokenized once by
our tokenizer and given to both frameworks as ids; both stop at the tokenizer's EOS ids.

Tokens/s is steady state for both: ssd_jax's `metrics.tokens_per_s` (rounds after prefill in which
nothing compiled; a warm-up generate runs first). HF: one warm-up generate, then per prompt
(new tokens - 1) / (generate time - prefill time), the prefill time being a separately timed
forward of the prompt through the target (and, for assisted generation, the draft too), so both
count the same tokens over the same phase. HF assisted generation is configured to match SD with K:
`num_assistant_tokens=K`, schedule "constant", `assistant_confidence_threshold=0`. With several
K (`--k 4,6`) both frameworks run at each (AR once) and the headline ratio compares each at its own
fastest K: our draft step costs ~0.18 of a target step and HF's ~0.37, so one shared K favours one.
Each framework runs its modes prompt by prompt (AR, then SD / assisted at each K, then the next
prompt), after one warm-up of each: this VM's bandwidth drifts over minutes (the 2-core decode
step has moved between ~70 and ~100 ms within a run), and modes run minutes apart saw different
machines (one run measured our AR at 14.5 tok/s and, minutes later, SD at 22).
The JSON of the run (machine, versions, command, per-prompt figures) goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_vs_hf import ROOT, machine_info, run_worker  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def _prompt_ids(n: int | None) -> tuple[list[dict], list[list[int]], tuple[int, ...]]:
    from ssd_jax.models import registry
    from ssd_jax.models.tokenizer import Tokenizer
    from ssd_jax.tools.benchmark_set import load_prompts

    prompts = load_prompts()
    prompts = prompts[:n] if n else prompts
    tok = Tokenizer.from_gguf(registry.resolve(TARGET))
    return prompts, [tok.encode(p["text"]) for p in prompts], tuple(tok.eos_ids)


def worker_jax(n, max_new, ks, dtype: str = "float32", draft_quant: str = "none",
               draft_vocab: int | None = None) -> dict:
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine
    from ssd_jax.algorithm.sampling import SamplingParams

    prompts, ids, _ = _prompt_ids(n)
    engine = Engine(load_model(TARGET, dtype),
                    load_draft(DRAFT, dtype, draft_quant, draft_vocab),
                    placement="colocated")
    sp = SamplingParams(temperature=0.0)
    out = dict(kind="jax", dtype=dtype, draft_quant=draft_quant, draft_vocab=draft_vocab, sd_by_k={})
    runs = [("ar", ks[0])] + [("sd", k) for k in ks]
    for mode, k in runs:
        engine.generate([ids[0]], mode=mode, max_new_tokens=min(8, max_new), k=k, sampling=sp)  # warm-up
    per = {run: [] for run in runs}
    hist = {run: [0] * (run[1] + 1) for run in runs}
    # Prompt by prompt, every mode in turn: the shared VM's bandwidth drifts over minutes, and
    # modes run back to back see the same machine.
    for p, x in zip(prompts, ids):
        for mode, k in runs:
            r = engine.generate([x], mode=mode, max_new_tokens=max_new, k=k, sampling=sp)
            m = r.metrics
            if mode == "sd":
                hist[mode, k] = [a + b for a, b in zip(hist[mode, k], m.accept_hist)]
            per[mode, k].append(dict(id=p["id"], prompt_tokens=len(x), new_tokens=m.new_tokens,
                                     tokens_per_s=m.tokens_per_s, timed_tokens=m.timed_tokens,
                                     decode_s=m.decode_s, compile_s=m.compile_s,
                                     prefill_s=m.prefill_s,
                                     tokens_per_round=m.tokens_per_round if mode == "sd" else None,
                                     acceptance_rate=m.acceptance_rate if mode == "sd" else None,
                                     token_ids=[int(t) for t in r.token_ids[0]]))
    for (mode, k), rows in per.items():
        tok_sum, time_sum = sum(r["timed_tokens"] for r in rows), sum(r["decode_s"] for r in rows)
        agg = dict(tokens_per_s=tok_sum / time_sum if time_sum else float("nan"),
                   timed_tokens=tok_sum, decode_s=time_sum, prompts=rows)
        if mode == "sd":
            h = hist[mode, k]
            total = sum(h)
            agg.update(accept_hist=h,
                       tokens_per_round=sum((j + 1) * c for j, c in enumerate(h)) / total,
                       acceptance_rate=sum(j * c for j, c in enumerate(h)) / (total * k))
            out["sd_by_k"][str(k)] = agg
            out.setdefault("sd", agg)  # the first K
        else:
            out[mode] = agg
    return out


def worker_torch(n, max_new, ks, threads, dtype) -> dict:
    """HF AR and assisted generation: `ssd_jax.tools.bench_workers.worker_hf` (the loop `ssd-jax bench` runs),
    greedy, on the same prompts; (new tokens - 1) / (generate time - separately timed prefill)."""
    from ssd_jax.tools.bench_workers import worker_hf
    from ssd_jax.tools.benchmark_set import load_prompts

    prompts = load_prompts()
    job = dict(target=TARGET, draft=DRAFT, cache_dir=None, prompts=prompts[:n] if n else prompts,
               hf_dtype=dtype, k=ks[0], ks=ks, temperature=0.0, top_k=0, top_p=1.0, seed=0,
               warmup=True, max_new_tokens=max_new)
    r = worker_hf(job, threads)
    modes = r["modes"]
    by_k = {str(k): modes["assisted" if k == ks[0] else f"assisted@{k}"] for k in ks}
    return dict(kind="torch", dtype=dtype, threads=r["torch_threads"], ar=modes["ar"],
                assisted=modes["assisted"], assisted_by_k=by_k)


def _agree(a: list[int], b: list[int]) -> int:
    from ssd_jax.tools.bench_report import leading_equal
    return leading_equal(a, b)


def _best(by_k: dict, ar: float) -> tuple[str, float]:
    """(K, speed-up over AR) of the fastest K."""
    k = max(by_k, key=lambda k: by_k[k]["tokens_per_s"])
    return k, by_k[k]["tokens_per_s"] / ar


def render(rep: dict) -> str:
    from ssd_jax.runtime.defaults import describe
    feats = rep.get("machine", {}).get("cpu_features")
    out = [f"CPU: {describe(feats) if feats else 'features not recorded'}.", ""]
    for row in rep["results"]:
        j, h = row["jax"], row["torch"]
        jk = j.get("sd_by_k") or {str(rep["k"]): j["sd"]}
        hk = h.get("assisted_by_k") or {str(rep["k"]): h["assisted"]}
        j_ar, h_ar = j["ar"]["tokens_per_s"], h["ar"]["tokens_per_s"]
        quant = j.get("draft_quant", "none")
        draft = f" + {quant} draft" if quant != "none" else ""
        if j.get("draft_vocab"):
            draft += f" (head cut to {j['draft_vocab']} ids)"
        out += [f"Cores {row['cores']}: {rep['prompts']} prompts, max {rep['max_new_tokens']} new "
                f"tokens, greedy, {j.get('dtype', 'float32')}{draft} (ssd_jax) / {h['dtype']} (HF).", "",
                "| framework | K | AR tok/s | SD / assisted tok/s | SD/AR speed-up | tokens/round "
                "| acceptance |", "|---|---|---|---|---|---|---|"]
        for k, sd in jk.items():
            out.append(f"| ssd_jax (colocated) | {k} | {j_ar:.2f} | {sd['tokens_per_s']:.2f} "
                       f"| {sd['tokens_per_s'] / j_ar:.2f}x | {sd['tokens_per_round']:.2f} "
                       f"| {sd['acceptance_rate']:.2f} |")
        for k, a in hk.items():
            out.append(f"| HF transformers | {k} | {h_ar:.2f} | {a['tokens_per_s']:.2f} "
                       f"| {a['tokens_per_s'] / h_ar:.2f}x | — | — |")
        (bj, sj), (bh, sh) = _best(jk, j_ar), _best(hk, h_ar)
        out += ["", f"- speed-up ratio, each framework at its fastest K (ssd_jax K={bj}, HF K={bh}): "
                    f"{sj:.2f}x / {sh:.2f}x = **{sj / sh:.2f}**",
                f"- ssd_jax SD / HF assisted tok/s at the first K: "
                f"{j['sd']['tokens_per_s'] / h['assisted']['tokens_per_s']:.2f}; ssd_jax AR / HF AR: "
                f"{j_ar / h_ar:.2f}",
                f"- greedy agreement (leading tokens equal, ssd_jax SD vs HF AR): "
                f"{row['agreement']}", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", default="0", help="taskset core list for both frameworks, e.g. 0 or 0,1; "
                    "several sets separated by ';'")
    ap.add_argument("--prompts", type=int, default=0, help="use the first N prompts (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default benchmark_set.MAX_NEW_TOKENS")
    ap.add_argument("--k", default="4", help="draft tokens per round; several separated by commas "
                    "(e.g. 4,6,8) run SD and assisted generation at each, AR once")
    ap.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="ssd_jax's dtype (bfloat16 is its fastest on a CPU with the kernel)")
    ap.add_argument("--draft-quant", default="none", choices=("none", "int8", "int4"),
                    help="ssd_jax's draft weights as int8, or its layers as int4 (models/quant.py); "
                         "HF's draft stays in --hf-dtype")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="cut ssd_jax's draft head to token ids [0, N) (models/draft_head.py); HF's "
                         "draft keeps its whole head")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sd_vs_hf-<time>.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.max_new_tokens is None:
        from ssd_jax.tools.benchmark_set import MAX_NEW_TOKENS
        a.max_new_tokens = MAX_NEW_TOKENS
    n = a.prompts or None
    try:
        ks = [int(k) for k in a.k.split(",")]
    except ValueError:
        ap.error(f"--k takes integers separated by commas, got {a.k!r}")
    if not ks or min(ks) < 1:
        ap.error(f"--k takes positive integers, got {a.k!r}")

    if a.worker:
        sys.path.insert(0, str(ROOT))
        r = (worker_jax(n, a.max_new_tokens, ks, a.dtype, a.draft_quant, a.draft_vocab) if a.worker == "jax"
             else worker_torch(n, a.max_new_tokens, ks, a.threads, a.hf_dtype))
        print(json.dumps(r))
        return 0

    from ssd_jax.tools.benchmark_set import load_prompts
    n_prompts = len(load_prompts()[:n] if n else load_prompts())
    script = Path(__file__).resolve()
    common = ["--prompts", str(a.prompts), "--max-new-tokens", str(a.max_new_tokens), "--k", str(a.k)]
    results = []
    for cores in a.cores.split(";"):
        th = len(cores.split(","))
        print(f"[cores {cores}] ssd_jax ...", file=sys.stderr, flush=True)
        vocab = ["--draft-vocab", str(a.draft_vocab)] if a.draft_vocab else []
        j = run_worker(script, cores, ["jax", "--dtype", a.dtype, "--draft-quant", a.draft_quant, *vocab,
                                       *common], th)
        print(f"[cores {cores}] HF ...", file=sys.stderr, flush=True)
        h = run_worker(script, cores, ["torch", "--threads", str(th), "--hf-dtype", a.hf_dtype, *common], th)
        agree = [f"{_agree(x['token_ids'], y['token_ids'])}/{len(y['token_ids'])}"
                 for x, y in zip(j["sd"]["prompts"], h["ar"]["prompts"])]
        results.append(dict(cores=cores, threads=th, jax=j, torch=h, agreement=agree))
    rep = dict(machine=machine_info(), command=" ".join(["python", *sys.argv]),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               target=TARGET, draft=DRAFT, prompts=n_prompts, max_new_tokens=a.max_new_tokens, k=ks,
               results=results)
    text = render(rep)
    print(text)
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / (
        f"sd_vs_hf-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
