"""`ssd-jax bench`: AR, SD and SSD side by side over the benchmark set (or your prompts), in each
device layout, plus HF transformers' AR and assisted generation when torch is installed.

    ssd-jax bench --limit 4 --max-new-tokens 32 --layouts colocated,two-process
    ssd-jax bench --prompts-file my_prompts.jsonl --k 4 --fanout 3,2,1,1,1 --out /tmp/bench

Layouts (each measured in its own subprocess, pinned with `taskset -c` to the cores it names;
`--cores A,B` picks them, default the first two CPUs this process may use):

* `colocated`: target and draft in one process on core A (the SD baseline of the paper);
* `split`: one process on cores A,B with two JAX CPU devices, target on the first, draft on the
  second (two meshes in one process, overlap by async dispatch);
* `two-process`: the target's process on core A, the draft in its own process on core B
  (`ssd_jax.transport.start_two_process`; jax.distributed has to start before any other JAX use,
  hence the subprocess per layout).

Each layout's worker runs AR first (the engine needs a plain-decoding step time T_1 for
`metrics.predicted_speedup`), then SD, then SSD, each over every prompt after one short warm-up
generate. HF transformers (when torch and transformers import) runs in its own subprocess on core A
with one thread: `generate` and `generate(assistant_model=draft)` with K constant draft tokens, on the
same weights and token ids (the logic of benchmarks/sd_vs_hf.py, generalised to any model ssd_jax
loads).

Tokens/s is steady state: tokens of the rounds in which nothing compiled over their time
(`Metrics.tokens_per_s`), summed over prompts; HF: (new tokens - 1) / (generate time - a separately
timed prefill). Writes `bench.json` (machine, versions, command, per-prompt figures and token ids),
`bench.md` (the table) and PNG plots to `--out` (default `benchmarks/results/<timestamp>/`).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from models import registry

LAYOUTS = ("colocated", "split", "two-process")
MODES = ("ar", "sd", "ssd")
EVENT = "@@ssd-jax-bench "  # prefix of the worker's progress lines on stdout


class BenchError(RuntimeError):
    """A layout's worker failed (its log has the details)."""


# ------------------------------------------------------------------------------------------ options
def _csv(choices: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"{what} must be a comma-separated subset of {','.join(choices)}, got {text!r}")
        return tuple(dict.fromkeys(items))
    return parse


def _cores(text: str) -> tuple[int, int]:
    try:
        cores = tuple(int(x) for x in text.split(","))
    except ValueError:
        cores = ()
    if len(cores) != 2 or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"--cores takes two CPU ids A,B (target, draft), got {text!r}")
    return cores


def add_arguments(b: argparse.ArgumentParser, fanout_type) -> None:
    b.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help="a default model name, a .gguf file or an HF folder")
    b.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    b.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with a \"text\" key per line "
                        "(default: the benchmark set, ssd_jax.benchmark_set)")
    b.add_argument("--limit", type=int, default=0, help="use the first N prompts (default all)")
    b.add_argument("--max-new-tokens", type=int, default=None,
                   help="default ssd_jax.benchmark_set.MAX_NEW_TOKENS (128)")
    b.add_argument("--k", type=int, default=4, help="lookahead K (draft tokens per round)")
    b.add_argument("--fanout", type=fanout_type, default=None,
                   help="SSD F_0..F_K, e.g. 2,2,1,1,1, or 'plan' (from this layout's AR and SD runs)")
    b.add_argument("--saguaro-c", type=float, default=1.0)
    b.add_argument("--backup", choices=("neural", "random", "ngram", "auto"), default="neural")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", default="float32", help="float32/fp32 or bfloat16/bf16")
    b.add_argument("--draft-quant", choices=("none", "int8", "int4"), default="none",
                   help="the draft's matmul weights as int8, or its layers as int4 (models/quant.py)")
    b.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="cut the draft's head to token ids [0, N) (models/draft_head.py)")
    b.add_argument("--layouts", type=_csv(LAYOUTS, "--layouts"), default=("colocated", "two-process"),
                   help="comma-separated subset of colocated,split,two-process "
                        "(default colocated,two-process)")
    b.add_argument("--modes", type=_csv(MODES, "--modes"), default=MODES,
                   help="comma-separated subset of ar,sd,ssd (always run in that order)")
    b.add_argument("--cores", type=_cores, default=None,
                   help="CPU ids A,B: target (and colocated) on A, draft on B "
                        "(default: the first two CPUs this process may use)")
    b.add_argument("--hf", choices=("auto", "yes", "no"), default="auto",
                   help="also run HF transformers AR + assisted generation (auto: when torch and "
                        "transformers are installed)")
    b.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32")
    b.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short warm-up generate before each mode")
    b.add_argument("--max-len", type=int, default=4096)
    b.add_argument("--note", default="", help="a remark stored with the results (e.g. machine load)")
    b.add_argument("--out", default=None, help="output folder (default benchmarks/results/<timestamp>/)")
    b.add_argument("--cache-dir", default=None)


# ------------------------------------------------------------------------------------------ prompts
def load_prompt_file(path: str | os.PathLike) -> list[dict]:
    """A prompt file -> [{"id", "kind", "text"}]. JSONL when every non-empty line is a JSON object
    with a "text" string (optional "id", "kind"); otherwise one prompt per non-empty line."""
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (empty file)")
    rows = []
    for ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError:
            break
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            break
        rows.append(obj)
    if len(rows) == len(lines):
        return [dict(id=str(r.get("id", f"line/{i}")), kind=str(r.get("kind", "user")), text=r["text"])
                for i, r in enumerate(rows)]
    if lines[0].lstrip().startswith("{") and Path(path).suffix == ".jsonl":
        raise ValueError(f"{path}: every JSONL line needs a \"text\" string")
    return [dict(id=f"line/{i}", kind="user", text=ln) for i, ln in enumerate(lines)]


def _prompts(args) -> tuple[list[dict], str]:
    if args.prompts_file:
        prompts, source = load_prompt_file(args.prompts_file), str(args.prompts_file)
    else:
        from ssd_jax.benchmark_set import load_prompts
        prompts, source = load_prompts(), "ssd_jax.benchmark_set"
    if args.limit:
        prompts = prompts[: args.limit]
    if any(not p["text"] for p in prompts):
        raise ValueError("empty prompt in the prompt set")
    return prompts, source


# ------------------------------------------------------------------------------------------ machine
def machine_info() -> dict:
    import numpy as np
    info = dict(platform=platform.platform(), python=platform.python_version(),
                cpu_count=os.cpu_count(), numpy=np.__version__)
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = sorted(os.sched_getaffinity(0))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    for mod in ("jax", "jaxlib", "flax", "torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            continue
        try:
            from importlib.metadata import version
            info[mod] = version(mod)
        except Exception:  # noqa: BLE001
            pass
    return info


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _default_cores() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    return (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])


def _hf_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


# ------------------------------------------------------------------------------------------ parent
def _validate(args) -> None:
    from ssd_jax.engine import SSDConfig
    from ssd_jax.sampling import SamplingParams

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.fanout == "plan":
        if not {"ar", "sd", "ssd"} <= set(args.modes):
            raise ValueError("--fanout plan needs --modes ar,sd,ssd: the plan is made from the AR "
                             "and SD runs of the same layout")
    else:
        SSDConfig(fanout=args.fanout, saguaro_c=args.saguaro_c, backup=args.backup).lists(args.k)
    from models.config import canonical_dtype
    args.dtype = canonical_dtype(args.dtype)
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.cores and usable is not None and not set(args.cores) <= set(usable):
        raise ValueError(f"--cores {args.cores[0]},{args.cores[1]}: this process may only use CPUs "
                         f"{usable}")
    if args.hf == "yes" and not _hf_available():
        raise ValueError("--hf yes needs torch and transformers (pip install -e \".[test]\")")


def _check_models(args) -> None:
    """Resolve both models (one-line errors for missing / unfetched ones) and check that they share
    a tokenizer, before any worker starts."""
    from models.load import _tokenizer

    tpath = registry.resolve(args.target, args.cache_dir)
    dpath = registry.resolve(args.draft, args.cache_dir)
    tt, dt = _tokenizer(tpath), _tokenizer(dpath)
    if tt.fingerprint() != dt.fingerprint():
        raise ValueError("draft and target have different tokenizers: speculative decoding needs one "
                         "shared vocabulary")


def _run_worker(kind: str, cores: list[int], threads: int, job_path: Path, out: Path,
                total: int) -> dict:
    """Run one layout's (or HF's) worker under taskset; progress lines drive a tqdm bar."""
    from tqdm import tqdm

    result = out / "raw" / f"{kind}.json"
    log = out / "logs" / f"{kind}.log"
    result.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "ssd_jax.bench", "--worker", kind, "--job", str(job_path),
           "--result", str(result)]
    pinned = shutil.which("taskset") is not None
    if pinned:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(set(cores)))), *cmd]
    t0 = time.perf_counter()
    with open(log, "w") as logf, tqdm(total=total, desc=kind, unit="gen", file=sys.stderr,
                                      disable=None, leave=True) as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, text=True, env=env)
        for line in proc.stdout:
            if line.startswith(EVENT):
                ev = json.loads(line[len(EVENT):])
                bar.set_postfix_str(ev.get("desc", ""), refresh=False)
                bar.update(ev.get("n", 1))
            else:
                logf.write(line)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    res = json.loads(result.read_text()) if result.exists() else {}
    if rc != 0 or "error" in res or not res:
        msg = res.get("error") or _last_line(log) or f"exit code {rc}"
        raise BenchError(f"{kind} worker failed: {msg} (log: {log})")
    res.update(cores=sorted(set(cores)), pinned=pinned, threads=threads, wall_s=wall)
    return res


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def run(args) -> int:
    """The `ssd-jax bench` command."""
    _validate(args)
    _check_models(args)
    prompts, source = _prompts(args)
    if args.max_new_tokens is None:
        from ssd_jax.benchmark_set import MAX_NEW_TOKENS
        args.max_new_tokens = MAX_NEW_TOKENS
    cores = args.cores or _default_cores()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("benchmarks") / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    hf = args.hf == "yes" or (args.hf == "auto" and _hf_available())
    job = dict(target=args.target, draft=args.draft, dtype=args.dtype, cache_dir=args.cache_dir,
               prompts=prompts, max_new_tokens=args.max_new_tokens, k=args.k,
               fanout=(args.fanout if args.fanout == "plan" else
                       list(args.fanout) if args.fanout else None), saguaro_c=args.saguaro_c,
               backup=args.backup, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
               seed=args.seed, modes=list(args.modes), warmup=args.warmup, max_len=args.max_len,
               cores=list(cores), hf_dtype=args.hf_dtype, draft_quant=args.draft_quant,
               draft_vocab=args.draft_vocab)
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job, indent=1))
    report = dict(
        command=shlex.join(["ssd-jax", *getattr(args, "argv", sys.argv[1:])]), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), machine=machine_info(), loadavg_start=_loadavg(), note=args.note,
        config={k: v for k, v in job.items() if k != "prompts"}, prompt_source=source,
        prompts=[dict(id=p["id"], kind=p["kind"]) for p in prompts], layouts={}, errors={})
    per_mode = len(prompts) + (1 if args.warmup else 0)
    plan = [(lay, [cores[0]] if lay == "colocated" else list(cores), 1 if lay == "colocated" else 2,
             per_mode * len(args.modes)) for lay in args.layouts]
    if hf:
        plan.append(("hf", [cores[0]], 1, per_mode * 2))
    for kind, cs, threads, total in plan:
        try:
            res = _run_worker(kind, cs, threads, job_path, out, total)
        except BenchError as e:
            report["errors"][kind] = str(e)
            continue
        if kind == "hf":
            report["hf"] = res
        else:
            report["layouts"][kind] = res
    report["loadavg_end"] = _loadavg()
    _agreement(report)
    report = _jsonable(report)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    md = render_markdown(report)
    (out / "bench.md").write_text(md)
    pngs = plot(report, out)
    print(md)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, " + ", ".join(str(p) for p in pngs))
    if report["errors"]:
        raise BenchError("; ".join(report["errors"].values()))
    return 0


def leading_equal(a: list[int], b: list[int]) -> int:
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


def render_markdown(rep: dict) -> str:
    cfg, mach = rep["config"], rep["machine"]
    versions = ", ".join(f"{m} {mach[m]}" for m in ("jax", "jaxlib", "flax", "torch", "transformers")
                         if m in mach)
    out = ["# ssd-jax bench", "",
           f"- command: `{rep['command']}`",
           f"- date: {rep['date']}",
           f"- machine: {mach.get('cpu', '?')}, {mach.get('cpu_count')} CPUs "
           f"(usable {mach.get('usable_cpus', '?')}), {mach.get('memory_gib', '?')} GiB, "
           f"{mach.get('platform')}, Python {mach.get('python')}",
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
            "AR of the same layout. Predicted: spec §6 from this run's measured times and rates "
            "(SSD: `metrics.predicted_speedup`; SD: T_1 E / (T_v + K T_d)), mean over prompts. "
            "Agree: leading tokens equal to AR of the same layout, per prompt.", "",
            "| layout | cores | mode | tok/s | speed-up vs AR | predicted | tokens/round "
            "| acceptance | hit rate | agree with AR |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, lay in rep["layouts"].items():
        ar = lay["modes"].get("ar", {}).get("tokens_per_s")
        for mode, m in lay["modes"].items():
            sp = m["tokens_per_s"] / ar if ar and m.get("tokens_per_s") else None
            out.append(
                f"| {name} | {','.join(map(str, lay['cores']))} | {mode.upper()} "
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
                       f"| {','.join(map(str, h['cores']))} | {'AR' if mode == 'ar' else 'assisted'} "
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
    ax.set_xlabel("predicted speed-up over AR (spec §6)")
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


# ------------------------------------------------------------------------------------------ workers
def _event(desc: str, n: int = 1) -> None:
    print(EVENT + json.dumps(dict(desc=desc, n=n)), flush=True)


def _steady(timeline: list) -> list:
    return [r for r in timeline if not r.compiled]


def _sd_prediction(m, t1: float | None, k: int) -> float | None:
    """S_SD = T_1 E / (T_v + K T_d) from this run's steady rounds (spec §6)."""
    import numpy as np

    from ssd_jax.policy import sd_speedup
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
        from ssd_jax.transport import start_two_process  # before any other JAX use
        remote = start_two_process(job["draft"], dtype=job["dtype"], quant=job.get("draft_quant", "none"),
                                   draft_vocab=job.get("draft_vocab"), cores=tuple(cores),
                                   cache_dir=job["cache_dir"])
    import jax
    if layout == "split":  # two CPU devices (one per mesh); other platforms keep their devices
        jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np

    from models.load import load_draft, load_model
    from ssd_jax.engine import Engine, SSDConfig
    from ssd_jax.sampling import SamplingParams

    # Under jax.distributed orbax coordinates every process, and only this one loads: no orbax
    # cache for the target of the two-process layout (as in ssd_jax.draft_process).
    target = load_model(job["target"], job["dtype"], cache_dir=job["cache_dir"],
                        use_cache=remote is None)
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
    ids = [tok.encode(p["text"]) for p in job["prompts"]]
    k = job["k"]
    sampling = SamplingParams(temperature=job["temperature"], top_k=job["top_k"], top_p=job["top_p"])
    fan = job["fanout"]
    ssd = SSDConfig(fanout=fan if fan == "plan" else tuple(fan) if fan else None,
                    saguaro_c=job["saguaro_c"], backup=job["backup"])
    kw = dict(sampling=sampling, k=k, ssd=ssd, seed=job["seed"])
    modes, t1 = {}, None
    for mode in [m for m in MODES if m in job["modes"]]:
        if job["warmup"]:
            engine.generate([ids[0]], mode=mode, max_new_tokens=min(8, job["max_new_tokens"]), **kw)
            _event(f"{mode} warm-up")
        per = []
        for p, x in zip(job["prompts"], ids):
            r = engine.generate([x], mode=mode, max_new_tokens=job["max_new_tokens"], **kw)
            m = r.metrics
            rec = dict(id=p["id"], prompt_tokens=len(x), new_tokens=m.new_tokens,
                       finish_reason=r.finish_reasons[0], tokens_per_s=m.tokens_per_s,
                       timed_tokens=m.timed_tokens, decode_s=m.decode_s, compile_s=m.compile_s,
                       prefill_s=m.prefill_s, rounds=m.rounds,
                       token_ids=[int(t) for t in r.token_ids[0]])
            if mode == "ar":
                rec["step_s"] = [r_.round_s for r_ in _steady(m.timeline)]
            else:
                rec.update(accept_hist=list(m.accept_hist), tokens_per_round=m.tokens_per_round,
                           per_token_acceptance=m.per_token_acceptance,
                           verify_s=m.verify_s, draft_s=m.draft_s)
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
    return dict(layout=layout, t1_s=t1, modes=modes)


def hf_model_on_our_weights(spec: str, dtype: str, cache_dir: str | None):
    """An HF transformers model (torch, eval mode) on the weights ssd_jax loads for `spec` (a default
    name, a .gguf file or an HF folder), as in benchmarks/decode_vs_hf.py."""
    import torch
    import transformers

    from models.config import ModelConfig
    from models.load import _read

    config, tensors = _read(registry.resolve(spec, cache_dir))
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

    from models.load import _tokenizer

    torch.set_num_threads(threads)
    tok = _tokenizer(registry.resolve(job["target"], job["cache_dir"]))
    ids = [tok.encode(p["text"]) for p in job["prompts"]]
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
    p = argparse.ArgumentParser(prog="python -m ssd_jax.bench")
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
