"""The latency-throughput frontier over batch sizes (issue 24, item 3): AR, SD and SSD with the
neural backup, the random backup and the policy's choice (`backup="auto"`), on the real pair.

    python benchmarks/frontier.py --batches 1,2,4,8,16 --max-new-tokens 48

Layouts, the paper's (each its own pinned process): AR and SD with target and draft colocated on
core 0; SSD with the target on core 0 and the draft in its own process on core 1. Greedy, every
request emits exactly --max-new-tokens tokens (no EOS stop), so every request of a call finishes
with the call. Two views: decode, the frontier proper (a request's time per output token,
steady-state decode seconds over its tokens, against the batch's steady-state tokens/s:
`Metrics.decode_s`, `tokens_per_s`, compile rounds excluded) and the whole call (the wall time a
request waits, prefill included, against b x tokens / wall). The shape was compiled by a short
warm-up call first. Prompts: the first b of the benchmark set (HumanEval/0..15,
ssd_jax.tools.benchmark_set), the same at every mode.

Prints one table (b, mode, both latencies and throughputs, SSD hit rate and backups) and writes frontier-<time>.json, .md and .png (throughput against latency,
one line per mode, a point per b) to --out (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"colocated": ("ar", "sd"), "two-process": ("ssd-neural", "ssd-random", "ssd-auto")}


def _prompts(n: int) -> list[dict]:
    from ssd_jax.tools.benchmark_set import load_prompts
    prompts = load_prompts()
    if n > len(prompts):
        raise SystemExit(f"batch {n} needs {n} prompts; the benchmark set has {len(prompts)}")
    return [dict(text=p["text"]) for p in prompts[:n]]


def worker(args) -> None:
    """One layout in this process; prints one RESULT line of JSON."""
    remote = None
    if args.layout == "two-process":
        from ssd_jax.runtime.transport import start_two_process
        remote = start_two_process(args.draft, dtype=args.dtype, quant=args.draft_quant,
                                   cores=tuple(args.cores))
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.tools.bench_workers import encode_prompt

    target = load_model(args.target, args.dtype)
    if remote is not None:
        eng = Engine(target, remote_draft=remote)
    else:
        eng = Engine(target, load_draft(args.draft, args.dtype, args.draft_quant), placement="colocated")
    fan = tuple(int(x) for x in args.fanout.split(","))
    out = {}
    for b in [int(x) for x in args.batches.split(",")]:
        ids = [encode_prompt(target.tokenizer, p) for p in _prompts(b)]
        for name in MODES[args.layout]:
            mode = name[:3].rstrip("-")
            kw = dict(mode=mode, max_new_tokens=args.max_new_tokens, eos_ids=[])
            if mode == "sd":
                kw.update(k=args.k_sd)
            if mode == "ssd":
                kw.update(k=len(fan) - 1, ssd=SSDConfig(fanout=fan, backup=name.split("-")[1]))
            eng.generate(ids, **dict(kw, max_new_tokens=8))  # compiles this shape
            t0 = time.perf_counter()
            res = eng.generate(ids, **kw)
            wall = time.perf_counter() - t0
            m = res.metrics
            out[f"{name}@{b}"] = dict(
                wall_s=wall, tokens=sum(len(t) for t in res.token_ids), compile_s=m.compile_s,
                decode_s=m.decode_s, timed_tokens=m.timed_tokens,
                prefill_s=m.prefill_s, tokens_per_round=m.tokens_per_round if mode != "ar" else 1.0,
                hits=m.hits, lookups=m.lookups, backups=m.backups, token_ids=res.token_ids)
            print(f"{name}@{b}: {out[f'{name}@{b}']['tokens'] / wall:.2f} tok/s", file=sys.stderr,
                  flush=True)
    if remote is not None:
        remote.close()
    print("RESULT " + json.dumps(out))


def rows(res: dict, batches: list[int], n_tokens: int) -> list[dict]:
    out = []
    for b in batches:
        for layout, modes in MODES.items():
            for name in modes:
                r = res[layout][f"{name}@{b}"]
                out.append(dict(b=b, mode=name, ms_per_token=1e3 * r["decode_s"] * b / r["timed_tokens"],
                                tokens_per_s=r["timed_tokens"] / r["decode_s"], latency_s=r["wall_s"],
                                call_tokens_per_s=r["tokens"] / r["wall_s"], compile_s=r["compile_s"],
                                tokens_per_round=r["tokens_per_round"],
                                hit_rate=r["hits"] / r["lookups"] if r["lookups"] else None,
                                backups=r["backups"]))
    return out


def report(table: list[dict], res: dict, batches: list[int]) -> str:
    lines = ["| b | mode | decode ms / token (a request) | decode tokens/s (all) | vs AR at this b | "
             "request latency s (call) | call tokens/s | tokens / round | hit rate | backups |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ar = {r["b"]: r["tokens_per_s"] for r in table if r["mode"] == "ar"}
    for r in table:
        hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else ""
        bk = ", ".join(f"{k} {v}" for k, v in r["backups"].items())
        lines.append(f"| {r['b']} | {r['mode']} | {r['ms_per_token']:.1f} | {r['tokens_per_s']:.2f} | "
                     f"{r['tokens_per_s'] / ar[r['b']]:.2f}x | {r['latency_s']:.2f} | "
                     f"{r['call_tokens_per_s']:.2f} | {r['tokens_per_round']:.2f} | {hit} | {bk} |")
    same = all(len({json.dumps(res[lay][f"{n}@{b}"]["token_ids"]) for lay, ms in MODES.items() for n in ms}) == 1
               for b in batches)
    lines.append(f"\n- greedy outputs identical across every mode at every b: {same}")
    front = []
    for r in sorted(table, key=lambda r: (r["ms_per_token"], -r["tokens_per_s"])):
        if not front or r["tokens_per_s"] > front[-1]["tokens_per_s"]:
            front.append(r)
    lines.append("- the decode frontier (no other point has both a lower ms / token and a higher "
                 "tokens/s), fastest request first: " + ", ".join(f"{r['mode']}@{r['b']}" for r in front))
    return "\n".join(lines)


def plot(table: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in table):
        pts = [r for r in table if r["mode"] == mode]
        ax.plot([r["ms_per_token"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o", label=mode)
        for r in pts:
            ax.annotate(str(r["b"]), (r["ms_per_token"], r["tokens_per_s"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("decode latency of a request, ms per token")
    ax.set_ylabel("decode throughput, tokens/s (all requests)")
    ax.set_title("Latency-throughput over batch size b (labels), default pair, this CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="default %(default)s")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="default %(default)s")
    p.add_argument("--batches", default="1,2,4,8,16", help="increasing batch sizes <= 16 (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="default %(default)s")
    p.add_argument("--k-sd", type=int, default=4, help="SD lookahead K (default %(default)s)")
    p.add_argument("--fanout", default="1,1,1,1,1,1", help="SSD F_0..F_K; its length sets K "
                   "(default %(default)s: one guess per outcome, as ssd_crossover.py; the CLI's "
                   "0,...,0,1 leaves the random backup no way back to a hit, see benchmarks/README.md at 8faea7c)")
    p.add_argument("--dtype", default="bfloat16", help="default %(default)s")
    p.add_argument("--draft-quant", default="int4", choices=("none", "int8", "int4"),
                   help="default %(default)s")
    p.add_argument("--cores", default="0,1", type=lambda s: [int(x) for x in s.split(",")],
                   help="CPU ids A,B: target (and colocated) on A, the draft's process on B (default 0,1)")
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="output folder")
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        [int(x) for x in args.fanout.split(",")]
    except ValueError as e:
        raise SystemExit(f"--batches and --fanout are comma-separated integers: {e}")
    if sorted(batches) != batches or batches[0] < 1 or batches[-1] > 16:
        raise SystemExit(f"--batches must be increasing sizes in 1..16, got {args.batches}")
    if args.layout:
        return worker(args)
    res = {}
    for layout in MODES:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--layout", layout]
        if layout == "colocated":
            cmd = ["taskset", "-c", str(args.cores[0]), *cmd]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise SystemExit(f"layout {layout} failed (its stderr is above)")
        res[layout] = json.loads(line[0][7:])
    from ssd_jax.runtime.defaults import describe
    table = rows(res, batches, args.max_new_tokens)
    text = report(table, res, batches) + f"\n- CPU: {describe()}"
    print(text)
    from _results import write_results
    write_results("frontier", args.out, dict(table=table, results=res), text,
                  plot=lambda path: plot(table, path))


if __name__ == "__main__":
    main()
