"""The statistics the issue-24 study scripts report (benchmarks/saguaro_study.py,
outcome_prediction.py, frontier.py), on cases computed by hand: the bootstrap intervals of a ratio
of sums and of a paired difference, the Wilson interval, and the frontier's rows and Pareto set.
The scripts are loaded from their files (benchmarks/ is not a package); nothing here runs a model."""
import os

import pytest

from _benchmark_scripts import load as _script


saguaro = _script("saguaro_study")
outcome = _script("outcome_prediction")
frontier = _script("frontier")


# ------------------------------------------------------------------------------- saguaro_study
def test_ratio_bootstrap_of_two_prompts_by_hand():
    # prompt 0 hits 2 of 10, prompt 1 hits 9 of 10. The resamples {0,0}, {1,1}, {0,1} have
    # ratios 0.2, 0.9, 0.55 with probabilities 1/4, 1/4, 1/2: the 2.5% and 97.5% quantiles are
    # the one-prompt ratios exactly, and the point is the pooled 11/20.
    point, lo, hi = saguaro._boot([(2, 10), (9, 10)])
    assert point == pytest.approx(0.55)
    assert (lo, hi) == (pytest.approx(0.2), pytest.approx(0.9))


def test_ratio_bootstrap_pools_counts_not_per_prompt_rates():
    # 1 of 1 and 0 of 99: pooled 1/100, where the mean of the two rates would be 0.5
    assert saguaro._boot([(1, 1), (0, 99)])[0] == pytest.approx(0.01)


def test_paired_difference_is_exact_when_every_prompt_differs_by_the_same_count():
    # every prompt has 10 lookups at both points and one more hit at x: in every resample the
    # difference of pooled rates is 1/10, so the interval is a point
    x = [(4, 10), (7, 10), (1, 10)]
    y = [(3, 10), (6, 10), (0, 10)]
    assert saguaro._boot_diff(x, y) == pytest.approx((0.1, 0.1, 0.1))
    assert saguaro._boot_diff(x, x) == pytest.approx((0.0, 0.0, 0.0))


def test_paired_difference_draws_both_points_of_a_prompt_together():
    # Unpaired, prompt-to-prompt spread (0.1 vs 0.9) would swamp the +0.05 per prompt; paired,
    # every resample's difference lies between the two prompts' own differences.
    x = [(2, 20), (19, 20)]
    y = [(1, 20), (18, 20)]
    point, lo, hi = saguaro._boot_diff(x, y)
    assert point == pytest.approx(0.05) and lo == pytest.approx(0.05) and hi == pytest.approx(0.05)


def test_per_prompt_pairs_from_metrics():
    class M:  # the Metrics fields _per_prompt reads, K = 2
        k = 2
        hits, lookups = 3, 4
        accept_hist = [1, 2, 3]  # 1 round accepted 0, 2 accepted 1, 3 accepted 2
        timed_tokens, decode_s = 20, 4.0
        hits_by_accept, lookups_by_accept = [0, 1, 2], [1, 1, 2]

    r = saguaro._per_prompt([M(), M()])
    assert r["hits"] == [(3, 4), (3, 4)]
    # acceptance a: accepted tokens 0*1 + 1*2 + 2*3 = 8 over trials 8 + rejections (1 + 2) = 11
    assert r["acceptance"][0] == (8, 11)
    # tokens per round: (1*1 + 2*2 + 3*3) / 6 rounds
    assert r["tokens_per_round"][0] == (14, 6)
    assert r["hits_by_accept"] == [0, 2, 4] and r["lookups_by_accept"] == [2, 2, 4]


# -------------------------------------------------------------------------- outcome_prediction
def test_wilson_interval_against_the_formula_tables():
    lo, hi = outcome.wilson(5, 10)  # the textbook 95% Wilson interval of 5/10
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    lo, hi = outcome.wilson(0, 20)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.1611, abs=1e-4)
    lo, hi = outcome.wilson(20, 20)
    assert lo == pytest.approx(0.8389, abs=1e-4) and hi == pytest.approx(1.0)


def test_wilson_of_no_lookups_is_nan_not_a_number_made_up():
    lo, hi = outcome.wilson(0, 0)
    assert lo != lo and hi != hi


# ------------------------------------------------------------------------------------- frontier
def _point(decode_s, timed, wall=1.0, tokens=10, hits=0, lookups=0):
    return dict(decode_s=decode_s, timed_tokens=timed, wall_s=wall, tokens=tokens, compile_s=0.0,
                tokens_per_round=1.0, hits=hits, lookups=lookups, backups={}, token_ids=[[1]])


def test_frontier_rows_and_pareto_set_by_hand():
    # b = 2: AR decodes 40 tokens in 2 s (20 tok/s; a request waits 2 s for its 20, 100 ms a
    # token); SD 40 in 1 s (40 tok/s, 50 ms); each SSD 40 in 4 s (10 tok/s, 200 ms).
    two = {"colocated": {"ar@2": _point(2.0, 40), "sd@2": _point(1.0, 40)},
           "two-process": {f"{m}@2": _point(4.0, 40, hits=3, lookups=4)
                           for m in frontier.MODES["two-process"]}}
    table = frontier.rows(two, [2], 48)
    by = {r["mode"]: r for r in table}
    assert by["ar"]["ms_per_token"] == pytest.approx(100.0) and by["ar"]["tokens_per_s"] == 20.0
    assert by["sd"]["ms_per_token"] == pytest.approx(50.0) and by["sd"]["tokens_per_s"] == 40.0
    assert by["ssd-neural"]["hit_rate"] == 0.75 and by["ar"]["hit_rate"] is None
    text = frontier.report(table, two, [2])
    # SD is faster per request and has more throughput: it alone is the frontier
    assert "fastest request first: sd@2\n" in text + "\n"
    assert "| 2 | ssd-neural | 200.0 | 10.00 | 0.50x |" in text


# ------------------------------------------------------------------------------ the result files
def test_result_files_hold_the_command_the_payload_and_the_report(tmp_path, monkeypatch):
    import json
    results = _script("_results")
    monkeypatch.setattr("sys.argv", ["frontier.py", "--batches", "1,2"])
    plotted = []
    stem = results.write_results("frontier", str(tmp_path / "out"), dict(table=[1], results={"a": 2}),
                                 "| the table |", plot=plotted.append)
    assert os.path.basename(stem).startswith("frontier-") and plotted == [stem + ".png"]
    with open(stem + ".json") as f:
        d = json.load(f)
    assert d["meta"]["command"] == "python benchmarks/frontier.py --batches 1,2"
    assert {"date", "cpu_features", "loadavg"} <= d["meta"].keys()
    assert d["table"] == [1] and d["results"] == {"a": 2} and d["report"] == "| the table |"
    with open(stem + ".md") as f:
        assert f.read() == "`python benchmarks/frontier.py --batches 1,2`\n\n| the table |\n"


def test_top_mass_report_by_hand():
    # m = 1 leaves q' = q on the scaled tokens (factor 1); m = 0.5 at C = 0.5 gives
    # 0.5 / (0.25 + 0.5) = 2/3: mean 5/6
    text = saguaro.report_mass({"n_top": 2, "mass": {"0.7": {"prompt": [1.0, 0.5]}}}, [0.5])
    assert "| 0.7 | prompt | 2 | 0.750 | 0.750 | 0.833 |" in text


# ---------------------------------------------------------------------------- host_overhead
def test_host_overhead_rows_on_a_tiny_case():
    import argparse
    host = _script("host_overhead")
    from ssd_jax.runtime.engine import Engine
    a = argparse.Namespace(vocab=32, prompt_len=4, tokens=4, k=2, repeats=0)  # counts only
    target, draft = host.build_pair(a.vocab, 1, 0.3)
    engine = Engine(target, draft, placement="colocated", backend="xla", compilation_cache=False)
    row = host.measure(engine, target, "ar", 1, a)
    # 4 tokens: the first comes with the prefill, then 3 decode steps, each fetching its token
    assert row["rounds"] in (3, 4) and row["same_tokens_every_call"]
    assert row["py_calls_per_round"] > 0 and row["c_calls_per_round"] > 0
    assert row["syncs"] >= row["rounds"] and row["ratio"] is None
    text = host.table([row])
    assert text.splitlines()[0] == "| " + " | ".join(host.COLUMNS) + " |"
    assert text.splitlines()[2].startswith("| AR | 1 | ")


def test_host_overhead_cpu_line_from_cpuinfo():
    host = _script("host_overhead")
    c = host.cpu_info("model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f amx_tile\n"
                      "model name\t: other\nflags\t\t: fpu\n")
    assert c["model"] == "Some CPU" and c["avx2"] and c["avx512f"] and c["amx"]
    assert not c["avx512_bf16"] and not c["avx512_vnni"]
    assert host.cpu_line(c).endswith("flags: avx2 avx512f amx")
