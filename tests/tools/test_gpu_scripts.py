"""The GPU session's scripts (benchmarks/gpu_engine_check.py, benchmarks/gpu_session.py) run
end to end here in their --smoke form (tiny shapes, the kernels in Pallas interpret mode), so a
lease of the GPU is not spent finding a script's own bug; and the engine check's verdicts are
checked on cases made by hand. The scripts are loaded from their files (benchmarks/ is not a
package)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax

from _benchmark_scripts import BENCHMARKS, load
from ssd_jax.models.config import tiny_config
from ssd_jax.models.params import random_params

check = load("gpu_engine_check")


def _result(tokens, hits=0, lookups=0, rounds=3, backend=None):
    return SimpleNamespace(token_ids=tokens, metrics=SimpleNamespace(
        hits=hits, lookups=lookups, rounds=rounds, backend=backend or {"draft": "xla"}))


def _runs(ar, **over):
    out = {name: _result(ar, hits=5, lookups=8) for name in check.EXACT}
    out["ar"] = _result(ar)
    out["ssd pallas"] = _result(ar, hits=5, lookups=8, backend={"target": "pallas", "draft": "pallas"})
    out.update(over)
    return out


def test_engine_check_requires_tokens_not_hits_of_two_programs():
    """The H200 run of 2026-12-04 failed its old check: chunked SSD 144/190 hits, round by round
    145/191. Hits of two programs may differ at a draft near-tie; the tokens may not."""
    cfg = tiny_config("qwen2", vocab_size=64)
    params = random_params(cfg, 0)
    prompts, ar = [[1, 2, 3]], [[5, 6, 7, 8]]
    ok, lines = check.verdicts(_runs(ar, **{"ssd rounds": _result(ar, hits=6, lookups=9)}),
                               prompts, params, cfg)
    assert ok, lines
    assert any("ssd reference vs ssd rounds: same tokens, hits 5/8 vs 6/9" in s for s in lines)
    # a token that is not plain decoding's (nor tied with it) in any one run fails the check;
    # `ar` here is not the model's greedy output, so neither token is the argmax: no near-tie
    bad = [[5, 6, 9, 8]]
    for name in check.EXACT:
        ok, lines = check.verdicts(_runs(ar, **{name: _result(bad, hits=5, lookups=8,
                                                              backend={"draft": "pallas"})}),
                                   prompts, params, cfg)
        assert not ok and any(f"{name}: MISMATCH" in s for s in lines), name
    # the pallas engine must have run the draft's kernels and hit its cache
    for ker in (_result(ar, hits=0, lookups=8, backend={"draft": "pallas"}),
                _result(ar, hits=5, lookups=8, backend={"draft": "xla"})):
        ok, _ = check.verdicts(_runs(ar, **{"ssd pallas": ker}), prompts, params, cfg)
        assert not ok


def test_engine_check_smoke_end_to_end(tmp_path):
    out = tmp_path / "check.json"
    assert check.main(["--smoke", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and set(data["runs"]) == {"ar", *check.EXACT}
    assert data["backend"]["draft"] == "pallas"
    assert all(r["rounds"] > 0 and r["ms_per_round"] > 0 for r in data["runs"].values())
    # the host's own share of a round: positive, and never more than the whole round; at most
    # one device->host sync a round (AR: a chunk of tokens) plus the call's own few (the
    # prefill's report, the results, the counters: 4 in SD / SSD here)
    for name, r in data["runs"].items():
        assert 0 < r["host_ms_per_round"] <= r["ms_per_round"], (name, r)
        assert 0 < r["syncs"] <= r["rounds"] + 4, (name, r)
    # bf16: timed side by side, the kernels checked, the tokens not (a short run)
    assert check.main(["--smoke", "--dtype", "bfloat16", "--max-new-tokens", "4",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dtype"] == "bfloat16" and data["backend"]["draft"] == "pallas"


def test_gpu_session_smoke_writes_one_json_with_each_step(tmp_path):
    """Some steps of the session (the whole one runs ~2 min here): the bare decode step, the
    pair's engine on tiny shapes, a cold process then a warm one on the same compile cache and
    step store, and its chunks' temporaries."""
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_session.py"),
                        "--smoke", "--out", str(out), "--work", str(work),
                        "--only", "env,step,pair_b1_cold,pair_b1_warm,chunk_memory"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["gpu_session.json", "logs.txt"]  # what a lease returns
    steps = json.loads((out / "gpu_session.json").read_text())["steps"]
    assert list(steps) == ["env", "step", "pair_b1_cold", "pair_b1_warm", "chunk_memory"]
    assert all(s["status"] == "ok" for s in steps.values())
    # each model with the engine's ops here (the cpu backend) and the XLA ones, side by side
    assert [(r["model"], r["backend"], r["batch"]) for r in steps["step"]["result"]["runs"]] == [
        (m, o, b) for m in ("target", "draft") for o in ("cpu", "xla") for b in (1, 16)]
    for r in steps["step"]["result"]["runs"]:
        assert r["host_loop_ms"] > 0 and r["device_loop_ms"] > 0 and r["fusions"] > 0
    cold, warm = steps["pair_b1_cold"]["result"], steps["pair_b1_warm"]["result"]
    assert [(r["batch"], r["mode"]) for r in cold["runs"]] == [(1, m) for m in ("ar", "sd", "ssd")]
    assert [(r["batch"], r["mode"]) for r in warm["runs"]] == [(r["batch"], r["mode"])
                                                              for r in cold["runs"]]
    for r in cold["runs"]:
        assert r["tokens"] == r["batch"] * cold["new_tokens"] and r["first_call_s"] > 0
        if r["mode"] != "ar":
            assert r["verify_ms"] > 0 and r["draft_ms"] > 0
            assert sum(r["acceptance_hist"]) > 0
    assert "wall_s" not in warm["runs"][0]  # --first-calls-only
    assert jax.__version__ == cold["jax"]
    chunks = steps["chunk_memory"]["result"]["runs"]
    assert [r["mode"] for r in chunks] == ["ar", "sd", "ssd"]
    for r in chunks:  # each chunk compiled and measured (the bound is tests/unit/test_chunk_memory's)
        assert r["chunk_temp_mib"] > 0 and r["chunk_args_mib"] > 0, r
        assert set(r["embed_mib"]) == {"target", "draft"}, r
