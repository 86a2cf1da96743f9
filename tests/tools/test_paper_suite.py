"""`ssd-jax bench --suite paper` (ssd_jax.tools.bench_paper): the bootstrap interval on cases
computed by hand, a dataset's row and its §6 prediction from records made up here, the table, the
flag checks, and the whole suite end to end on tiny random models (the workers, both layouts, the
JSON, markdown and plot) with prompts made up here in place of the pinned sets."""
import importlib.util
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ssd_jax.models.config import tiny_config
from ssd_jax.models.params import perturb_hf_tensors, random_hf_tensors
from ssd_jax.models.tokenizer import _byte_alphabet
from ssd_jax.tools import bench_paper, cli, datasets
from ssd_jax.tools.bench_paper import ratio_interval, summarize


# ------------------------------------------------------------------------------------------ interval
def test_interval_of_two_prompts_by_hand():
    # prompt 0: 10 tokens/s against 5; prompt 1: 30 against 10 (one second each). The resamples
    # are {0,0} -> 10/5 = 2, {1,1} -> 30/10 = 3, {0,1} -> (40/2)/(15/2) = 8/3, with
    # probabilities 1/4, 1/4, 1/2: the 2.5% and 97.5% quantiles are 2 and 3 exactly.
    point, lo, hi = ratio_interval([10, 30], [1, 1], [5, 10], [1, 1])
    assert point == pytest.approx(8 / 3)
    assert (lo, hi) == (2.0, 3.0)


def test_interval_is_the_ratio_of_summed_figures_not_the_mean_ratio():
    # prompt 0: 100 tokens in 10 s against 100 in 20 s (2x); prompt 1: 10 in 1 s against 10 in
    # 1 s (1x). Summed: (110 / 11) / (110 / 21) = 21 / 11, not the mean ratio 1.5.
    point, lo, hi = ratio_interval([100, 10], [10, 1], [100, 10], [20, 1])
    assert point == pytest.approx(21 / 11)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(2.0)


def test_interval_collapses_when_every_prompt_agrees():
    assert ratio_interval([7], [2], [3], [1]) == pytest.approx((7 / 6,) * 3)
    got = ratio_interval([10, 20, 40], [1, 2, 4], [5, 10, 20], [1, 2, 4])
    assert got == pytest.approx((2.0, 2.0, 2.0))


def test_interval_is_seeded_and_its_width_shrinks_with_more_prompts():
    rng = np.random.default_rng(1)
    def draw(n):
        sec = rng.uniform(1, 2, n)
        return [rng.uniform(8, 12, n) * sec, sec, rng.uniform(4, 6, n) * sec, sec]
    few, many = draw(8), draw(512)
    assert ratio_interval(*few) == ratio_interval(*few)
    w = [ratio_interval(*x)[2] - ratio_interval(*x)[1] for x in (few, many)]
    assert w[1] < w[0] / 3  # ~ 1 / sqrt(n): 8x for 64x the prompts
    p, lo, hi = ratio_interval(*many)
    assert lo < 2.0 < hi  # the true ratio (10 / 5) lies inside


def test_interval_errors():
    with pytest.raises(ValueError, match="same number"):
        ratio_interval([1, 2], [1], [1, 2], [1, 2])
    with pytest.raises(ValueError, match="same number"):
        ratio_interval([], [], [], [])
    with pytest.raises(ValueError, match="> 0"):
        ratio_interval([0], [1], [1], [1])


# ------------------------------------------------------------------------------------------ one row
def _rec(pid, tokens, secs, **kw):
    return dict(id=pid, dataset="toy", timed_tokens=tokens, decode_s=secs, token_ids=[1, 2, 3], **kw)


def _records():
    ar = [_rec("a", 10, 1.0, step_s=[0.1] * 10), _rec("b", 10, 1.0, step_s=[0.1] * 10)]
    # SD at K = 2: 4 rounds a prompt, hist [1, 1, 2] -> tokens/round (1 + 2 + 6) / 4 = 2.25,
    # acceptance (0 + 1 + 4) / (5 + 2) = 5/7; verify 0.12 s, drafting 0.04 s (0.02 a step)
    sd = [_rec(p, 9, 0.64, accept_hist=[1, 1, 2],
               steady=dict(verify_s=[0.12] * 4, draft_s=[0.04] * 4, backup_s=[0.0] * 4))
          for p in ("a", "b")]
    # SSD at K = 2: 3 hits of 4 lookups a prompt; after a hit 3 tokens a round, after a miss 2;
    # verify 0.12 s, tree 0.1 s, backup 0.05 s when it ran
    ssd = [_rec(p, 9, 0.45, accept_hist=[0, 1, 3], hits=3, lookups=4,
                accept_hist_after_hit=[0, 0, 3], accept_hist_after_miss=[0, 1, 0],
                steady=dict(verify_s=[0.12] * 4, draft_s=[0.1] * 4,
                            backup_s=[0.0, 0.05, 0.0, 0.0]))
           for p in ("a", "b")]
    return ar, sd, ssd


def test_a_datasets_row_and_its_prediction_by_hand():
    row = summarize(*_records(), k_sd=2, k_ssd=2)
    assert row["prompts"] == 2 and row["ids"] == ["a", "b"]
    assert row["ar_tokens_per_s"] == pytest.approx(10.0)
    assert row["sd_tokens_per_s"] == pytest.approx(18 / 1.28)
    assert row["ssd_tokens_per_s"] == pytest.approx(20.0)
    assert row["ssd_over_sd"]["point"] == pytest.approx(20 / (18 / 1.28))
    assert row["ssd_over_sd"]["low"] == pytest.approx(row["ssd_over_sd"]["point"])  # equal prompts
    assert row["sd_tokens_per_round"] == pytest.approx(2.25)
    assert row["ssd_tokens_per_round"] == pytest.approx((2 + 9) / 4)
    assert row["hit_rate"] == pytest.approx(0.75) and row["lookups"] == 8
    assert row["agree_with_ar"] == {"sd": 2, "ssd": 2}
    p = row["predicted"]
    a = 5 / 7
    e_sd = (1 - a ** 3) / (1 - a)  # E = (1 - a^(K+1)) / (1 - a)
    assert p["sd_over_ar"] == pytest.approx(0.1 * e_sd / (0.12 + 2 * 0.02))
    # S = T_1 [p E_hit + (1 - p) E_miss] / (max(T_v, T_p) + (1 - p) T_b)
    ssd = 0.1 * (0.75 * 3 + 0.25 * 2) / (0.12 + 0.25 * 0.05)
    assert p["ssd_over_ar"] == pytest.approx(ssd)
    assert p["ssd_over_sd"] == pytest.approx(ssd / p["sd_over_ar"])


def test_rows_must_pair_by_prompt():
    ar, sd, ssd = _records()
    with pytest.raises(ValueError, match="the ssd run's prompts differ"):
        summarize(ar, sd, ssd[::-1], 2, 2)


def test_the_table_and_the_papers_beside_it():
    row = summarize(*_records(), k_sd=2, k_ssd=2)
    rep = dict(command="ssd-jax bench --suite paper", date="d", machine={}, note="",
               config=dict(target="t", draft="d", dtype="bfloat16", draft_quant="int4", k_sd=2,
                           k_ssd=2, fanout=[0, 0, 1], backup="neural", saguaro_c=1.0,
                           temperature=0.0, max_new_tokens=8, cores=[0, 1]),
               datasets={n: datasets.describe(n) for n in ("humaneval", "asdiv")},
               results={"humaneval": row, "asdiv": row},
               average=bench_paper.average_row([row, row]), errors={},
               interval=dict(resamples=bench_paper.N_BOOT))
    md = bench_paper.render_markdown(rep)
    assert "| humaneval (HumanEval) | 2 | 10.00 | 14.06 | 20.00 | 1.42x (1.42-1.42) |" in md
    assert "| asdiv (GSM8K) |" in md and "| average | 4 | 10.00 |" in md
    assert "| GSM8K | 54.7 | 188 | 301 | 1.60x | 5.50x |" in md  # the paper's row
    assert "| average | 88.8 | 136.8 | 203.8 | 1.49x | — |" in md  # Qwen3: no SSD/AR given
    assert "Stand-ins: asdiv for GSM8K" in md
    assert "SSD with the target on core 0 and the draft in its own process on core 1" in md


def test_plan_from_the_ar_and_sd_records():
    ar, sd, _ = _records()
    res = {"modes": {"ar": {"prompts": ar}, "sd": {"prompts": sd}}}
    fan = bench_paper._plan(res, 2)
    assert len(fan) == 3 and sum(fan) >= 1 and all(f >= 0 for f in fan)


# ------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize("extra, needle", [
    (["--prompts-file", "x.txt"], "--datasets and --per-dataset"),
    (["--limit", "3"], "--datasets and --per-dataset"),
    (["--layouts", "colocated"], "drop --layouts / --modes"),
    (["--modes", "ar,sd"], "drop --layouts / --modes"),
    (["--hf", "yes"], "drop --hf yes"),
    (["--per-dataset", "0"], "--per-dataset must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--fanout", "0,0,0"], "fan"),
    (["--datasets", "gsm9k"], "--datasets must be a comma-separated subset"),
])
def test_suite_flags_are_checked_before_any_model(extra, needle, capsys, tmp_path):
    try:
        rc = cli.main(["bench", "--suite", "paper", "--target", str(tmp_path / "none"),
                       "--out", str(tmp_path / "o"), *extra])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.startswith("ssd-jax: error:"), err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ end to end
CHAT = "{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}Assistant:"


def _tiny_pair(root):
    alpha = _byte_alphabet()
    chars = [alpha[b] for b in range(32, 127)] + [alpha[10]]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    cfg = tiny_config("qwen2", vocab_size=tok.get_vocab_size(with_added_tokens=True))
    t = random_hf_tensors(cfg, 0, scale=1.0)
    out = {}
    for name, tensors in (("target", t), ("draft", perturb_hf_tensors(t, 0.05, seed=1))):
        folder = root / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT}))
        out[name] = str(folder)
    return out


def test_the_suite_end_to_end_on_tiny_models(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SSD_JAX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SSD_JAX_COMPILE_CACHE", "0")
    texts = {"humaneval": ["def add(a, b):", "import os\n", "class A:"],
             "asdiv": ["Tom has 3 apples. How many?", "2 plus 2?", "Half of 8?"]}
    asked = []

    def fake_prompts(name, n=None, cache_dir=None, download=True):  # no pinned files needed
        asked.append((name, n))
        ds = datasets.get(name)
        return [dict(id=f"{name}/{i}", kind=ds.kind, text=t, chat=ds.chat, dataset=name)
                for i, t in enumerate(texts[name][:n])]
    monkeypatch.setattr(datasets, "prompts", fake_prompts)
    pair = _tiny_pair(tmp_path)
    out = tmp_path / "paper"
    rc = cli.main(["bench", "--suite", "paper", "--target", pair["target"], "--draft",
                   pair["draft"], "--datasets", "humaneval,asdiv", "--per-dataset", "2",
                   "--max-new-tokens", "10", "--k", "3", "--fanout", "1,0,1", "--max-len", "256",
                   "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert asked == [("humaneval", 2), ("asdiv", 2)]
    rep = json.loads((out / "paper.json").read_text())
    assert list(rep["results"]) == ["humaneval", "asdiv"] and not rep["errors"]
    assert rep["config"]["k_sd"] == 3 and rep["config"]["k_ssd"] == 2
    assert rep["config"]["fanout"] == [1, 0, 1] and rep["config"]["cores"]
    lay = rep["layouts"]
    assert list(lay["colocated"]["modes"]) == ["ar", "sd"] and lay["colocated"]["cores"] == \
        rep["config"]["cores"][:1]
    assert list(lay["two-process"]["modes"]) == ["ssd"]
    assert lay["two-process"]["cores"] == sorted(set(rep["config"]["cores"]))
    ar = lay["colocated"]["modes"]["ar"]["prompts"]
    assert [r["dataset"] for r in ar] == ["humaneval"] * 2 + ["asdiv"] * 2
    assert all(len(r["accept_hist"]) == 4 for r in lay["colocated"]["modes"]["sd"]["prompts"])
    assert all(len(r["accept_hist"]) == 3 for r in lay["two-process"]["modes"]["ssd"]["prompts"])
    for name, row in rep["results"].items():
        assert row["prompts"] == 2
        for key in ("ar_tokens_per_s", "sd_tokens_per_s", "ssd_tokens_per_s", "hit_rate"):
            assert row[key] is not None and row[key] > 0, (name, key)
        r = row["ssd_over_sd"]
        assert r["low"] <= r["point"] <= r["high"]
        assert row["agree_with_ar"] == {"sd": 2, "ssd": 2}  # greedy: the target's own tokens
        assert row["predicted"]["ssd_over_ar"] is not None
    # the chat set was wrapped in the template, the code set was not
    md = (out / "paper.md").read_text()
    assert md in stdout and "| asdiv (GSM8K) | 2 |" in md and "| average | 4 |" in md
    assert rep["datasets"]["asdiv"]["member_sha256"] == datasets.get("asdiv").member_sha256
    assert (out / "job-colocated.json").exists() and (out / "raw" / "two-process.json").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "paper_ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # prompt tokens: the chat prompts are longer than their text by the template's words
    lens = {r["id"]: r["prompt_tokens"] for r in ar}
    assert lens["asdiv/1"] == len("User: 2 plus 2?\nAssistant:")  # one id a byte here
    assert lens["humaneval/1"] == len("import os\n")
    assert os.path.getsize(out / "paper.json") > 0


# ------------------------------------------------------------------------------------------ projection
def _projection():
    """benchmarks/paper_projection.py (a script, not in the package), imported once."""
    from _benchmark_scripts import load
    return load("paper_projection")


def test_roofline_arithmetic_by_hand():
    pp = _projection()
    # one layer, hidden 2, one head of 2 (q = k = v = 2 wide), MLP 4, vocabulary 8, tied:
    # q 2x2 + k, v 2x2 each + o 2x2 + gate, up, down 3 x 2x4 = 40 matrix weights a layer,
    # + 2 norms of 2 = 44; LM head 8x2 = 16; final norm 2 -> 62 streamed, 56 in matrix products
    toy = pp.Shape("toy", layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=4,
                   vocab=8, tied=True)
    assert (toy.layer_matrix_params(), toy.layer_params()) == (40, 44)
    assert (toy.streamed_params(), toy.matrix_params(), toy.params()) == (62, 56, 62)
    assert pp.Shape(**{**toy.__dict__, "tied": False}).params() == 62 + 16
    assert toy.kv_bytes(3) == 2 * 1 * 1 * 2 * 3 * 2  # K and V, bf16
    m = pp.Machine("toy", hbm_bytes_per_s=124.0, flops_per_s=224.0, link_bytes_per_s=8.0)
    # 124 bytes at 124 B/s = 1 s; 2 x 56 = 112 FLOPs at 224/s = 0.5 s: memory-bound, 1 s
    assert pp.forward_time(toy, m, tokens=1, context=0) == pytest.approx(1.0)
    # 4 tokens: 448 FLOPs = 2 s > 1 s: compute-bound
    assert pp.forward_time(toy, m, tokens=4, context=0) == pytest.approx(2.0)
    # 3 cached positions: + 24 bytes of K/V; + 4 x 1 x 1 x 2 x 3 = 24 attention FLOPs
    assert pp.forward_time(toy, m, tokens=1, context=3) == pytest.approx(148 / 124)
    assert pp.forward_time(toy, m, tokens=4, context=3) == pytest.approx((448 + 96) / 224)
    # 2 rows of 1 token share the prefix: bytes once (148 / 124 = 1.19 s), FLOPs twice
    # (2 x (112 + 24) = 272 FLOPs = 1.21 s): compute-bound
    assert pp.forward_time(toy, m, rows=2, context=3) == pytest.approx(272 / 224)
    # TP 2: half the bytes (0.5 s) + 2 all-reduces of 1 x 2 values x 2 bytes = 4 bytes, a ring
    # moving 2 (2 - 1) / 2 x 4 = 4 bytes over 8 B/s: 0.5 s each
    assert pp.forward_time(toy, m, tokens=1, context=0, tp=2) == pytest.approx(0.5 + 2 * 0.5)
    assert pp.forward_time(toy, m, context=0, overhead_s=0.1) == pytest.approx(1.1)


def test_the_published_shapes_parameter_counts():
    pp = _projection()
    for shape, published in ((pp.LLAMA_70B, 70.6e9), (pp.LLAMA_1B, 1.24e9),
                             (pp.QWEN3_32B, 32.8e9), (pp.QWEN3_06B, 0.6e9)):
        assert shape.params() == pytest.approx(published, rel=0.01), shape.name
    # Qwen3-0.6B: "0.44B non-embedding" (its model card)
    q = pp.QWEN3_06B
    assert q.params() - q.vocab * q.hidden == pytest.approx(0.44e9, rel=0.01)


def test_the_projection_uses_the_planners_formulas():
    pp = _projection()
    got = pp.project(pp.Measured(acceptance=0.8, hit_rate=0.7, k_sd=4, k_ssd=4,
                                 fanout=(1, 1, 1, 1, 2), sd_tokens_per_round=3.0),
                     pp.LLAMA_70B, pp.LLAMA_1B)
    ours = got["ours"]
    t1, tv, td, tree = (ours[k] / 1e3 for k in ("t1_ms", "tv_ms", "td_ms", "tree_ms"))
    assert ours["ar"] == pytest.approx(1 / t1)
    assert ours["sd"] == pytest.approx(3.0 / (tv + 4 * td))  # E_SD / (T_v + K T_d)
    e = (1 - 0.8 ** 5) / (1 - 0.8)
    # S = T_1 [p E + (1 - p) E] / (max(T_v, T_p) + (1 - p) K T_d)
    assert ours["ssd_over_ar"] == pytest.approx(t1 * e / (max(tv, tree) + 0.3 * 4 * td))
    assert ours["ssd_over_sd"] == pytest.approx(ours["ssd"] / ours["sd"])
    assert got["paper's K"]["k_sd"] == 6 and got["paper's K"]["fanout"] == [3] * 8
    assert 0 < got["paper's K"]["p_hit"] <= 1 and got["planner"]["ssd_over_ar"] > 1
    c = pp.costs(pp.LLAMA_70B, pp.LLAMA_1B, pp.H100, 6, 24)
    a = pp.implied_acceptance(c, 6, 162 / 54.7)
    from ssd_jax.algorithm import policy
    assert policy.sd_speedup(c.t1, c.tv, c.td, 6, a) == pytest.approx(162 / 54.7, rel=1e-6)
    assert pp.implied_acceptance(c, 6, 1e3) is None


def test_the_projection_reads_a_suite_result(tmp_path, capsys):
    pp = _projection()
    row = summarize(*_records(), k_sd=2, k_ssd=2)
    rep = dict(config=dict(k_sd=2, k_ssd=2, fanout=[0, 0, 1]), results={"asdiv": row},
               datasets={"asdiv": datasets.describe("asdiv")})
    path = tmp_path / "paper.json"
    path.write_text(json.dumps(rep))
    assert pp.main(["--results", str(path), "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "A PROJECTION" in out and "| asdiv → GSM8K | 0.714 |" in out
    assert "54.7 / 188 / 301" in out  # the paper's GSM8K row beside
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["projection"] is True and set(data["pairs"]) == {"llama", "qwen"}


def test_measure_mode_takes_the_times_from_the_engine(monkeypatch, capsys):
    """`--measure` (on a GPU; here on the CPU, on a tiny shape): T_1, T_v, T_d and the width
    slope come from engine runs on a random pair of the pair's shapes, and the same formulas make
    the table; `--measure` on a CPU-only JAX is refused."""
    pp = _projection()
    tiny_t = pp.Shape("tiny-target", layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=96, tied=False, qk_norm=True)
    tiny_d = pp.Shape("tiny-draft", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16,
                      intermediate=64, vocab=96, tied=True, qk_norm=True)
    monkeypatch.setattr(pp, "PAIRS", {"qwen": (tiny_t, tiny_d)})
    with pytest.raises(SystemExit):
        pp.main(["--acceptance", "0.8", "--measure", "--pairs", "qwen"])
    assert "only the CPU" in capsys.readouterr().err
    cm = pp.EngineCosts(tiny_t, tiny_d, layers=2, context=16, new_tokens=8)
    # the cut target (2 of 3 layers) is scaled up by its streamed bytes; the draft is whole
    assert cm.t_scale > 1 and cm.d_scale == 1
    assert cm.t1 > 0 and cm.td > 0 and cm.width_slope >= 0
    assert cm.tv(1) == cm._tv[1] and cm.tv(8) == cm._tv[8]
    assert cm.tv(4) == pytest.approx(cm._tv[1] + (cm._tv[8] - cm._tv[1]) * 3 / 7)
    m = pp.Measured(acceptance=0.8, hit_rate=0.7, k_sd=4, k_ssd=4, fanout=(1, 1, 1, 1, 2))
    ours = pp.project(m, tiny_t, tiny_d, cost_model=cm)["ours"]
    assert ours["t1_ms"] == pytest.approx(cm.t1 * 1e3) and ours["tv_ms"] == pytest.approx(cm.tv(4) * 1e3)
    assert ours["tree_ms"] == pytest.approx(cm.costs(4, 6).tree(4, 6) * 1e3)
    out = pp.render({"given": ("average", m)}, 16, 4, models={"qwen": cm})
    assert out.startswith("# MEASURED costs on") and "tiny-target / tiny-draft" in out
    assert "Measured times: T_1" in out and "Roofline" not in out
