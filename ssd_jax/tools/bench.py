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
  (`ssd_jax.runtime.transport.start_two_process`; each layout runs in its own subprocess, pinned to
  its cores before JAX starts).

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
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ssd_jax.models import registry
from ssd_jax.runtime.config import BACKUPS
from ssd_jax.tools.bench_report import _agreement, _jsonable, plot, render_markdown
from ssd_jax.tools.bench_workers import EVENT, LAYOUTS, MODES
from ssd_jax.tools.flags import add_suite_arguments, naming_flags, resolve_formats


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
    """The `ssd-jax bench` flags on parser `b`; `fanout_type` parses a --fanout value."""
    b.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help=f"a default model name, a .gguf file, an HF folder or an HF Hub id "
                        f"(Org/Name) in the local HF cache (default {registry.DEFAULT_TARGET})")
    b.add_argument("--draft", default=registry.DEFAULT_DRAFT,
                   help=f"the draft model, as --target (default {registry.DEFAULT_DRAFT})")
    b.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with a \"text\" key per line "
                        "(default: the benchmark set, ssd_jax.tools.benchmark_set)")
    b.add_argument("--limit", type=int, default=0, help="use the first N prompts (default 0: all)")
    b.add_argument("--max-new-tokens", type=int, default=None,
                   help="default ssd_jax.tools.benchmark_set.MAX_NEW_TOKENS (128)")
    b.add_argument("--k", type=int, default=4,
                   help="lookahead K (draft tokens per round, 1..8; default 4)")
    b.add_argument("--fanout", type=fanout_type, default=None,
                   help="SSD F_0..F_K, e.g. 2,2,1,1,1, or 'plan' (from this layout's AR and SD runs; "
                        "default: one candidate per position, 1,1,...,1)")
    b.add_argument("--saguaro-c", type=float, default=1.0, help="Saguaro C in (0, 1] (default 1)")
    b.add_argument("--backup", choices=BACKUPS, default="neural",
                   help="what SSD proposes after a miss (default neural: the draft; auto: "
                        "chosen each round, ssd_jax.runtime.auto_backup)")
    b.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy (default)")
    b.add_argument("--top-k", type=int, default=0, help=">= 0; 0 = off (default)")
    b.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off (default)")
    b.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    b.add_argument("--dtype", default=None,
                   help="float32/fp32, bfloat16/bf16 or auto (ssd_jax.runtime.defaults.choose); "
                        "default float32, auto with --suite paper")
    b.add_argument("--draft-quant", choices=("auto", "none", "int8", "int4"), default=None,
                   help="the draft's matmul weights as int8, or its layers as int4 (models/quant.py), "
                        "or auto; default none, auto with --suite paper")
    b.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="cut the draft's head to token ids [0, N) (models/draft_head.py; "
                        "default: the whole head)")
    b.add_argument("--layouts", type=_csv(LAYOUTS, "--layouts"), default=None,
                   help="comma-separated subset of colocated,split,two-process "
                        "(default colocated,two-process)")
    b.add_argument("--modes", type=_csv(MODES, "--modes"), default=None,
                   help="comma-separated subset of ar,sd,ssd (always run in that order; default all)")
    b.add_argument("--cores", type=_cores, default=None,
                   help="CPU ids A,B: target (and colocated) on A, draft on B "
                        "(default: the first two CPUs this process may use)")
    b.add_argument("--hf", choices=("auto", "yes", "no"), default="auto",
                   help="also run HF transformers AR + assisted generation (auto: when torch and "
                        "transformers are installed; the default)")
    b.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="HF transformers weights dtype (default float32)")
    b.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short warm-up generate before each mode")
    b.add_argument("--max-len", type=int, default=4096, help="KV cache length (default 4096)")
    b.add_argument("--note", default="",
                   help="a remark stored with the results, e.g. machine load (default: none)")
    b.add_argument("--out", default=None, help="output folder (default benchmarks/results/<timestamp>/)")
    b.add_argument("--cache-dir", default=None,
                   help="where models are cached (default $SSD_JAX_HOME or ~/.cache/ssd_jax)")
    add_suite_arguments(b)


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
        from ssd_jax.tools.benchmark_set import load_prompts
        prompts, source = load_prompts(), "ssd_jax.tools.benchmark_set"
    if args.limit:
        prompts = prompts[: args.limit]
    if any(not p["text"] for p in prompts):
        raise ValueError("empty prompt in the prompt set")
    return prompts, source


# ------------------------------------------------------------------------------------------ machine
def machine_info() -> dict:
    """Platform, Python, CPUs (count, usable, model, `cpu_features`: the instruction-set flags the
    kernels use and SSD_JAX_CPU_ISA), memory and library versions: recorded beside every figure."""
    import numpy as np

    from ssd_jax.runtime.defaults import cpu_features
    info = dict(platform=platform.platform(), python=platform.python_version(),
                cpu_count=os.cpu_count(), numpy=np.__version__, cpu_features=cpu_features())
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
    from ssd_jax.runtime.engine import SSDConfig
    from ssd_jax.algorithm.sampling import SamplingParams

    args.layouts = args.layouts or ("colocated", "two-process")
    args.modes = args.modes or MODES
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    from ssd_jax.runtime.config import MAX_K, MAX_NEW_TOKENS, check_max_len
    if args.k < 1 or args.k > MAX_K:
        raise ValueError(f"--k must be in [1, MAX_K={MAX_K}], got {args.k}")
    if args.max_new_tokens is not None and args.max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} is past the bound "
                         f"MAX_NEW_TOKENS={MAX_NEW_TOKENS}")
    if getattr(args, "max_len", None) is not None:
        check_max_len(args.max_len)
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.fanout == "plan":
        if not {"ar", "sd", "ssd"} <= set(args.modes):
            raise ValueError("--fanout plan needs --modes ar,sd,ssd: the plan is made from the AR "
                             "and SD runs of the same layout")
    else:
        SSDConfig(fanout=args.fanout, saguaro_c=args.saguaro_c, backup=args.backup).lists(args.k)
    resolve_formats(args, "float32", "none")
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.cores and usable is not None and not set(args.cores) <= set(usable):
        raise ValueError(f"--cores {args.cores[0]},{args.cores[1]}: this process may only use CPUs "
                         f"{usable}")
    if args.hf == "yes" and not _hf_available():
        raise ValueError("--hf yes needs torch and transformers (pip install -e \".[oracle]\")")


def _check_models(args) -> None:
    """Resolve both models (one-line errors for missing / unfetched ones) and check that they share
    a tokenizer, before any worker starts."""
    from ssd_jax.models.load import _tokenizer

    from ssd_jax.models import hub

    tpath = hub.resolve(args.target, args.cache_dir)
    dpath = hub.resolve(args.draft, args.cache_dir)
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
    cmd = [sys.executable, "-m", "ssd_jax.tools.bench_workers", "--worker", kind, "--job", str(job_path),
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
    """The `ssd-jax bench` command without `--suite` (`--suite paper` is
    ssd_jax.tools.bench_paper's `run`, which the CLI calls instead)."""
    if args.suite is not None:
        raise ValueError(f"bench.run runs no --suite; --suite {args.suite}: "
                         "ssd_jax.tools.bench_paper.run")
    with naming_flags():
        _validate(args)
    _check_models(args)
    prompts, source = _prompts(args)
    if args.max_new_tokens is None:
        from ssd_jax.tools.benchmark_set import MAX_NEW_TOKENS
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


