"""What a cold first call of AR, SD and SSD compiles, per program, on the default pair's shapes:
an old commit and this checkout side by side in one run, as ratios (issue 56, item 1).

    JAX_PLATFORMS=cpu python benchmarks/compile_cost.py --base <commit>        # h100 and local
    JAX_PLATFORMS=cpu python benchmarks/compile_cost.py --base <commit> --targets h100 --batch 1 -k 4

A first call compiles the prompt's prefill on the target and (SD, SSD) on the draft, then the loop
it dispatches: AR's decode chunk, SD's round chunk or SSD's (`ssd_jax.tools.inspect` builds each
as the engine does, greedy, on abstract arrays: no weights). Their compile seconds (trace +
lowering + XLA's compile, `inspect_step`'s `compile_s`) are measured for `--targets`: `h100` is
sm_90a compiled deviceless (needs `ssd_jax[inspect]`, the CUDA plugin), `local` this machine's
default backend with the table the engine picks here. A mode's figure is the sum of its programs.

Each (commit, target, batch, K) compiles in a fresh Python process (nothing cached in memory; the
persistent compilation cache is off), the base commit from a `git worktree` of it, the two
interleaved A B B A over `--repeats`; the table gives each program's and mode's median seconds
and new / base. The JSON (with the CPU's features) goes to benchmarks/results/compile_cost-<time>.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = ("prefill", "draft_prefill", "ar_chunk", "sd_chunk", "ssd_chunk")
MODES = {"AR": ("prefill", "ar_chunk"), "SD": ("prefill", "draft_prefill", "sd_chunk"),
         "SSD": ("prefill", "draft_prefill", "ssd_chunk")}


def compile_seconds(target: str, batch: int, k: int, programs=PROGRAMS) -> dict[str, float]:
    """{program: compile seconds} of `programs` for `target` at batch `batch` and K = `k`, built
    by the `ssd_jax` this process imports (the worker's own checkout)."""
    import dataclasses

    from ssd_jax.tools import inspect as ins
    pair = ins.default_pair()
    device = ins.target_device(target)
    shapes = dataclasses.replace(ins.Shapes(), batch=batch, k=k)
    out = {}
    for name in programs:
        step, cfg = ("prefill", pair["draft"]) if name == "draft_prefill" else (name, pair["target"])
        out[name] = ins.inspect_step(step, cfg, shapes, target, device, pair=pair).compile_s
    return out


def mode_seconds(programs: dict[str, float]) -> dict[str, float]:
    """{mode: the sum of its first call's programs' seconds} for every mode whose programs are all
    in `programs`."""
    return {m: sum(programs[p] for p in ps) for m, ps in MODES.items()
            if all(p in programs for p in ps)}


def summarise(runs: list[dict]) -> list[dict]:
    """Rows (target, batch, k, name, base, new, ratio) of median seconds per program and mode from
    worker results {"rev": "base"|"new", "target", "batch", "k", "programs": {...}}."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in runs:
        groups.setdefault((r["target"], r["batch"], r["k"]), {}).setdefault(r["rev"], []).append(
            {**r["programs"], **mode_seconds(r["programs"])})
    rows = []
    for (target, batch, k), revs in groups.items():
        if set(revs) != {"base", "new"}:
            raise ValueError(f"{target} b={batch} K={k}: runs of {sorted(revs)} only, both needed")
        for name in (*PROGRAMS, *MODES):
            if all(name in x for x in revs["base"] + revs["new"]):
                base = statistics.median(x[name] for x in revs["base"])
                new = statistics.median(x[name] for x in revs["new"])
                rows.append(dict(target=target, batch=batch, k=k, name=name, base=base, new=new,
                                 ratio=base / new if new > 0 else float("inf")))
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of `summarise`'s rows: base / new is how many times faster new compiles."""
    lines = ["| target | b | K | program or mode | base s | new s | base / new |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['target']} | {r['batch']} | {r['k']} | {r['name']} | {r['base']:.1f} | "
              f"{r['new']:.1f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def _worker(checkout: Path, target: str, batch: int, k: int) -> dict[str, float]:
    """compile_seconds in a fresh interpreter that imports `checkout`'s ssd_jax."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); "
            f"import compile_cost as c, ssd_jax; "
            f"print('FROM', ssd_jax.__file__); "
            f"print('RESULT', json.dumps(c.compile_seconds({target!r}, {batch}, {k})))")
    p = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True,
                       text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"the worker at {checkout} ({target} b={batch} K={k}) failed:\n"
                           f"{p.stderr[-3000:]}")
    origin = next(x for x in p.stdout.splitlines() if x.startswith("FROM "))[len("FROM "):]
    if not Path(origin).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"the worker for {checkout} imported ssd_jax from {origin}")
    return json.loads(line[len("RESULT "):])


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if min(vals) < 1:
        raise SystemExit(f"{flag} takes positive integers, got {text!r}")
    return vals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against (a worktree)")
    p.add_argument("--targets", default="h100,local", help="comma-separated: h100, h200, local")
    p.add_argument("--batch", default="1,16")
    p.add_argument("-k", default="4,6", help="comma-separated K values (default 4,6)")
    p.add_argument("--repeats", type=int, default=1, help="A B B A pairs per configuration")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    if not targets or any(t not in ("h100", "h200", "local") for t in targets):
        raise SystemExit(f"--targets takes h100, h200, local, got {a.targets!r}")
    batches, ks = _ints(a.batch, "--batch"), _ints(a.k, "-k")
    if a.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    base_rev = subprocess.run(["git", "rev-parse", "--verify", a.base + "^{commit}"], cwd=REPO,
                              capture_output=True, text=True)
    if base_rev.returncode:
        raise SystemExit(f"--base {a.base!r} is not a commit of {REPO}")
    sha = base_rev.stdout.strip()
    new_rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
    runs = []
    # a kill (SIGTERM) unwinds too, so the worktree below is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), sha], cwd=REPO,
                       check=True, capture_output=True)
        try:
            for target in targets:
                for batch in batches:
                    for k in ks:
                        for i in range(a.repeats):
                            order = (("base", base), ("new", REPO))
                            for rev, checkout in (order if i % 2 == 0 else order[::-1]):
                                progs = _worker(checkout, target, batch, k)
                                runs.append(dict(rev=rev, target=target, batch=batch, k=k,
                                                 programs=progs))
                                print(f"{rev:4s} {target} b={batch} K={k}: " + ", ".join(
                                    f"{n} {s:.1f} s" for n, s in progs.items()), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO,
                           capture_output=True)
    rows = summarise(runs)
    text = (f"base {sha[:10]}, new {new_rev[:10]} (the working tree's ssd_jax)\n\n" + table(rows))
    print(text)
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    from _results import write_results
    write_results("compile_cost", a.out, dict(base=sha, new=new_rev, runs=runs, rows=rows), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
