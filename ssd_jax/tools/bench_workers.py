"""`ssd-jax bench`'s workers: one subprocess per device layout (AR, SD, SSD over the prompts on
ssd_jax's engine) and one for HF transformers (AR and assisted generation on the same weights).
ssd_jax/tools/bench.py starts them as `python -m ssd_jax.tools.bench_workers --worker KIND --job JOB --result
OUT` under taskset; progress lines on stdout start with EVENT."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

from ssd_jax.models import hub
from ssd_jax.tools.bench_report import _jsonable

LAYOUTS = ("colocated", "split", "two-process")
MODES = ("ar", "sd", "ssd")
EVENT = "@@ssd-jax-bench "  # prefix of the worker's progress lines on stdout


# ------------------------------------------------------------------------------------------ workers
def encode_prompt(tok, p: dict) -> list[int]:
    """A prompt's token ids: its text, or with "chat" set, its text as one user turn in the
    tokenizer's chat template (as `Engine.generate(..., chat=True)` does)."""
    text = p["text"]
    if p.get("chat"):
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text)


def _event(desc: str, n: int = 1) -> None:
    print(EVENT + json.dumps(dict(desc=desc, n=n)), flush=True)


def _steady(timeline: list) -> list:
    return [r for r in timeline if not r.compiled]


def _sd_prediction(m, t1: float | None, k: int) -> float | None:
    """S_SD = T_1 E / (T_v + K T_d) from this run's steady rounds (ALGORITHM.md §6)."""
    import numpy as np

    from ssd_jax.algorithm.policy import sd_speedup
    steady = _steady(m.timeline)
    a = m.per_token_acceptance
    if t1 is None or not steady or a is None or math.isnan(a):
        return None
    tv = float(np.median([r.verify_s for r in steady]))
    td = float(np.median([r.draft_s for r in steady])) / k
    return sd_speedup(t1, tv, td, k, a)


def _aggregate(mode: str, per: list[dict], k: int) -> dict:
    timed = sum(p["timed_tokens"] for p in per)
    decode = sum(p["decode_s"] for p in per)
    agg = dict(tokens_per_s=timed / decode if decode > 0 else None, timed_tokens=timed,
               decode_s=decode, new_tokens=sum(p["new_tokens"] for p in per),
               compile_s=sum(p["compile_s"] for p in per), prompts=per)
    if mode != "ar":
        hist = [sum(h) for h in zip(*(p["accept_hist"] for p in per))] or [0] * (k + 1)
        total = sum(hist)
        acc = sum(j * c for j, c in enumerate(hist))
        rej = sum(hist[:-1])
        agg.update(accept_hist=hist,
                   tokens_per_round=sum((j + 1) * c for j, c in enumerate(hist)) / total if total else None,
                   acceptance_rate=acc / (total * k) if total else None,
                   per_token_acceptance=acc / (acc + rej) if acc + rej else None)
        preds = [p["predicted_speedup"] for p in per if p.get("predicted_speedup") is not None]
        agg["predicted_speedup"] = sum(preds) / len(preds) if preds else None
    if mode == "ssd":
        for key in ("accept_hist_after_hit", "accept_hist_after_miss"):
            agg[key] = [sum(h) for h in zip(*(p[key] for p in per))]
        hits, lookups = sum(p["hits"] for p in per), sum(p["lookups"] for p in per)
        agg.update(hits=hits, lookups=lookups, hit_rate=hits / lookups if lookups else None)
        backups: dict[str, int] = {}
        for p in per:
            for b, c in p["backups"].items():
                backups[b] = backups.get(b, 0) + c
        agg["backups"] = backups
    return agg


def worker_layout(layout: str, job: dict) -> dict:
    """One layout: load the pair, run AR then SD then SSD over the prompts."""
    remote = None
    cores = job["cores"]
    if layout == "two-process":
        from ssd_jax.runtime.transport import start_two_process  # before any other JAX use
        remote = start_two_process(job["draft"], dtype=job["dtype"], quant=job.get("draft_quant", "none"),
                                   draft_vocab=job.get("draft_vocab"), cores=tuple(cores),
                                   cache_dir=job["cache_dir"])
    import jax
    if layout == "split":  # two CPU devices (one per mesh); other platforms keep their devices
        jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np

    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.algorithm.sampling import SamplingParams

    target = load_model(job["target"], job["dtype"], cache_dir=job["cache_dir"])
    if remote is not None:
        engine = Engine(target, remote_draft=remote, max_len=job["max_len"])
    else:
        draft = (load_draft(job["draft"], job["dtype"], job.get("draft_quant", "none"),
                            job.get("draft_vocab"), cache_dir=job["cache_dir"])
                 if set(job["modes"]) - {"ar"} else None)
        engine = Engine(target, draft, placement="colocated" if layout == "colocated" else "split",
                        max_len=job["max_len"])
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"{job['target']}: the benchmark needs a tokenizer for text prompts")
    ids = [encode_prompt(tok, p) for p in job["prompts"]]
    sampling = SamplingParams(temperature=job["temperature"], top_k=job["top_k"], top_p=job["top_p"])
    fan = job["fanout"]
    ssd = SSDConfig(fanout=fan if fan == "plan" else tuple(fan) if fan else None,
                    saguaro_c=job["saguaro_c"], backup=job["backup"])
    modes, t1 = {}, None
    for mode in [m for m in MODES if m in job["modes"]]:
        k = job.get("k_modes", {}).get(mode, job["k"])  # --suite paper: SD's K and SSD's differ
        # timed rounds: the report's predictions and --fanout plan need a round's verify and
        # draft times, which an untimed round does not measure apart
        kw = dict(sampling=sampling, k=k, ssd=ssd, seed=job["seed"],
                  timeline=job.get("timeline", True))
        if job["warmup"]:
            engine.generate([ids[0]], mode=mode, max_new_tokens=min(8, job["max_new_tokens"]), **kw)
            _event(f"{mode} warm-up")
        per = []
        for p, x in zip(job["prompts"], ids):
            r = engine.generate([x], mode=mode, max_new_tokens=job["max_new_tokens"], **kw)
            m = r.metrics
            rec = dict(id=p["id"], dataset=p.get("dataset"), prompt_tokens=len(x),
                       new_tokens=m.new_tokens,
                       finish_reason=r.finish_reasons[0], tokens_per_s=m.tokens_per_s,
                       timed_tokens=m.timed_tokens, decode_s=m.decode_s, compile_s=m.compile_s,
                       prefill_s=m.prefill_s, rounds=m.rounds,
                       token_ids=[int(t) for t in r.token_ids[0]])
            if mode == "ar":
                rec["step_s"] = [r_.round_s for r_ in _steady(m.timeline)]
            else:
                steady = _steady(m.timeline)
                rec.update(accept_hist=list(m.accept_hist), tokens_per_round=m.tokens_per_round,
                           per_token_acceptance=m.per_token_acceptance,
                           verify_s=m.verify_s, draft_s=m.draft_s,
                           # the steady rounds' times, for the §6 prediction over many prompts
                           steady=dict(verify_s=[r_.verify_s for r_ in steady],
                                       draft_s=[r_.draft_s for r_ in steady],
                                       backup_s=[r_.backup_s for r_ in steady]))
            if mode == "sd":
                rec["predicted_speedup"] = _sd_prediction(m, t1, k)
            if mode == "ssd":
                rec.update(hits=m.hits, lookups=m.lookups, hit_rate=m.hit_rate,
                           fanout=list(m.fanout) if m.fanout else None,
                           backups=dict(m.backups), backup_s=m.backup_s,
                           accept_hist_after_hit=list(m.accept_hist_after_hit),
                           accept_hist_after_miss=list(m.accept_hist_after_miss),
                           predicted_speedup=m.predicted_speedup)
            per.append(rec)
            _event(f"{mode} {p['id']}")
        if mode == "ar":
            steps = [s for rec in per for s in rec["step_s"]]
            t1 = float(np.median(steps)) if steps else None
        modes[mode] = _aggregate(mode, per, k)
    if remote is not None:
        remote.close()
    from ssd_jax.runtime.defaults import cpu_features
    # what ran these figures: the op table per model and the CPU's features as this worker saw them
    return dict(layout=layout, t1_s=t1, modes=modes, backend=engine.backend,
                cpu_features=cpu_features())


def hf_model_on_our_weights(spec: str, dtype: str, cache_dir: str | None):
    """An HF transformers model (torch, eval mode) on the weights ssd_jax loads for `spec` (a default
    name, a .gguf file or an HF folder), as in benchmarks/decode_vs_hf.py."""
    import torch
    import transformers

    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.load import _read

    config, tensors = _read(hub.resolve(spec, cache_dir))
    cfg = ModelConfig.from_hf(config, "float32")
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    del tensors, state
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (rotary inv_freq) were created on the meta device: rebuild those modules.
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)):
                setattr(parent, cname, type(child)(model.config))
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return model.to(tdtype).eval()


def worker_hf(job: dict, threads: int = 1) -> dict:
    """HF transformers: greedy/sampled `generate` and assisted generation with K constant tokens."""
    import torch

    from ssd_jax.models.load import _tokenizer

    torch.set_num_threads(threads)
    tok = _tokenizer(hub.resolve(job["target"], job["cache_dir"]))
    ids = [encode_prompt(tok, p) for p in job["prompts"]]
    eos = list(tok.eos_ids)
    target = hf_model_on_our_weights(job["target"], job["hf_dtype"], job["cache_dir"])
    draft = hf_model_on_our_weights(job["draft"], job["hf_dtype"], job["cache_dir"])
    pad = eos[0] if eos else 0
    for m in (target, draft):
        m.generation_config.pad_token_id = pad
        m.generation_config.eos_token_id = eos or None
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    # job["ks"] (optional): more K to run assisted generation at, as modes "assisted@K"
    runs = [("ar", None)] + [("assisted" if kk == job["k"] else f"assisted@{kk}", kk)
                             for kk in dict.fromkeys([job["k"], *job.get("ks", ())])]
    t = job["temperature"]
    sample = (dict(do_sample=True, temperature=t, top_k=job["top_k"], top_p=job["top_p"])
              if t > 0 else dict(do_sample=False))

    def gen(x, new, assisted):
        kw = dict(max_new_tokens=new, eos_token_id=eos or None, pad_token_id=pad,
                  attention_mask=torch.ones_like(x), **sample)
        if assisted:
            kw["assistant_model"] = draft
        return target.generate(x, **kw)

    def prefill_s(model, x):
        t0 = time.perf_counter()
        model(x, use_cache=True)
        return time.perf_counter() - t0

    torch.manual_seed(job["seed"])
    per = {mode: [] for mode, _ in runs}
    with torch.inference_mode():
        if job["warmup"]:
            for mode, k in runs:
                if k is not None:
                    draft.generation_config.num_assistant_tokens = k
                gen(torch.tensor([ids[0]]), min(8, job["max_new_tokens"]), k is not None)
                _event(f"hf {mode} warm-up")
        # Prompt by prompt, every mode in turn: a shared machine's speed drifts over minutes, and
        # modes run back to back see the same machine.
        for p, x in zip(job["prompts"], ids):
            x = torch.tensor([x])
            for mode, k in runs:
                assisted = k is not None
                if assisted:
                    draft.generation_config.num_assistant_tokens = k
                pre = prefill_s(target, x) + (prefill_s(draft, x) if assisted else 0.0)
                t0 = time.perf_counter()
                y = gen(x, job["max_new_tokens"], assisted)
                total = time.perf_counter() - t0
                new = int(y.shape[1] - x.shape[1])
                steady = max(total - pre, 1e-9)
                per[mode].append(dict(id=p["id"], prompt_tokens=int(x.shape[1]), new_tokens=new,
                                      total_s=total, prefill_s=pre, steady_s=steady,
                                      tokens_per_s=(new - 1) / steady,
                                      token_ids=[int(v) for v in y[0, x.shape[1]:]]))
                _event(f"hf {mode} {p['id']}")
    modes = {}
    for mode, rows in per.items():
        tok_sum = sum(r["new_tokens"] - 1 for r in rows)
        time_sum = sum(r["steady_s"] for r in rows)
        modes[mode] = dict(tokens_per_s=tok_sum / time_sum if time_sum > 0 else None,
                           timed_tokens=tok_sum, decode_s=time_sum, prompts=rows)
    return dict(layout="hf", dtype=job["hf_dtype"], torch_threads=torch.get_num_threads(), modes=modes)


def _worker_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssd_jax.tools.bench_workers")
    p.add_argument("--worker", required=True, choices=(*LAYOUTS, "hf"))
    p.add_argument("--job", required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args(argv)
    job = json.loads(Path(a.job).read_text())
    try:
        res = worker_hf(job) if a.worker == "hf" else worker_layout(a.worker, job)
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line, traceback in the log
        traceback.print_exc()
        Path(a.result).write_text(json.dumps(dict(error=f"{type(e).__name__}: {e}".splitlines()[0])))
        return 1
    Path(a.result).write_text(json.dumps(_jsonable(res)))
    return 0



if __name__ == "__main__":
    sys.exit(_worker_main())
