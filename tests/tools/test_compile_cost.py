"""benchmarks/compile_cost.py: which programs a mode's first call is charged, and the side-by-side
table (medians per commit, base / new). Loaded from its file (benchmarks/ is not a package);
nothing here compiles a model (`inspect_step` is replaced by a recorder)."""
from __future__ import annotations

import pytest

from _benchmark_scripts import load

cc = load("compile_cost")


def test_a_mode_is_charged_its_prefills_and_its_loop():
    progs = {"prefill": 1.0, "draft_prefill": 2.0, "ar_chunk": 4.0, "sd_chunk": 8.0,
             "ssd_chunk": 16.0}
    assert cc.mode_seconds(progs) == {"AR": 5.0, "SD": 11.0, "SSD": 19.0}
    # a mode with a program missing is left out, not summed short
    assert cc.mode_seconds({"prefill": 1.0, "ar_chunk": 4.0}) == {"AR": 5.0}


def test_the_draft_prefill_is_the_prefill_step_on_the_draft(monkeypatch):
    from ssd_jax.tools import inspect as ins

    seen = []

    class Report:
        compile_s = 0.5

    def fake(step, cfg, shapes, target, device, pair=None):
        seen.append((step, cfg, shapes.batch, shapes.k, target))
        return Report()

    monkeypatch.setattr(ins, "inspect_step", fake)
    monkeypatch.setattr(ins, "target_device", lambda target: None)
    pair = ins.default_pair()
    out = cc.compile_seconds("local", 16, 6)
    assert out == dict.fromkeys(cc.PROGRAMS, 0.5)
    assert seen == [("prefill", pair["target"], 16, 6, "local"),
                    ("prefill", pair["draft"], 16, 6, "local"),
                    ("ar_chunk", pair["target"], 16, 6, "local"),
                    ("sd_chunk", pair["target"], 16, 6, "local"),
                    ("ssd_chunk", pair["target"], 16, 6, "local")]


def _run(rev, secs, target="h100", batch=1, k=4):
    return dict(rev=rev, target=target, batch=batch, k=k,
                programs={"prefill": secs[0], "draft_prefill": secs[1], "ar_chunk": secs[2],
                          "sd_chunk": secs[3], "ssd_chunk": secs[4]})


def test_the_table_takes_medians_per_commit_and_divides_base_by_new():
    runs = [_run("base", [4, 4, 2, 10, 20]), _run("new", [2, 2, 1, 5, 5]),
            _run("new", [2, 2, 1, 5, 7]), _run("base", [6, 4, 2, 10, 24]),
            _run("base", [5, 4, 2, 10, 22]), _run("new", [2, 2, 1, 5, 6])]
    rows = {r["name"]: r for r in cc.summarise(runs)}
    assert list(rows) == [*cc.PROGRAMS, *cc.MODES]
    assert (rows["prefill"]["base"], rows["prefill"]["new"]) == (5, 2)
    assert rows["ssd_chunk"]["ratio"] == pytest.approx(22 / 6)
    # a mode's median is the median of its per-run sums: SSD base 28, 34, 31 -> 31; new 9, 11, 10
    assert (rows["SSD"]["base"], rows["SSD"]["new"]) == (31, 10)
    assert "| h100 | 1 | 4 | SSD | 31.0 | 10.0 | 3.10 |" in cc.table(cc.summarise(runs)).splitlines()


def test_a_configuration_measured_on_one_commit_only_is_an_error():
    with pytest.raises(ValueError, match="local b=16 K=6: runs of \\['new'\\] only"):
        cc.summarise([_run("base", [1] * 5), _run("new", [1] * 5),
                      _run("new", [1] * 5, target="local", batch=16, k=6)])
