"""Shared pieces of the engine's statistical exactness tests (tests/test_engine_*.py).

A tiny target / draft pair over vocabulary V = 4 ids in ROWS = 6 embedding rows (shaped like a
released model, whose rows outnumber its tokenizer's ids: the two padded rows' logits would win
most steps if a path let them, `ssd_jax.testing.pad_vocabulary`), the exact window distribution
enumerated from the target's forward, and `sample_windows`: N independent requests (distinct request ids, so
independent keys) through a real `Engine`, their generated tokens `skip .. skip + window - 1`
[N, window]. `verdict` tests them with the calibrated chi-square of `ssd_jax.testing`, cells of
probability below POOL pooled (`min_expected`; why: tests/statistical/test_engine_exactness.py's docstring).
Each generate call is recorded round by round (tests/_round_record.py), and
`assert_every_path_ran` reads that record: a window's tokens came through a hit and a miss at
every accept length.

The registry. Every statistical case of the engine suite is a `StatCase` in STAT_CASES (the path
it covers, the test that runs it, its sampling, n, window, prompt, the TV at which its power is
enforced), and `verdict` / `check_windows` take the case's name: a case that is not registered
cannot be checked, one that is takes its n and window from here, and
test_engine_exactness.py's power test iterates STAT_CASES, so it covers every case there is.
DETERMINISTIC_CHECKS and UNCOVERED_PATHS are the coverage table's other rows; `coverage_rows`
renders it, docs/ALGORITHM.md §3 holds the rendered copy (checked current by
test_the_coverage_table_is_current, its power column by the power test), and
`python tests/_engine_stats.py` prints it afresh (`--write`: rewrites that copy).
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import jax
import numpy as np

from _compile_level import optimized
from _round_record import generate_recorded
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.models.quant import quantize_model
from ssd_jax.models.transformer import forward
from ssd_jax.runtime.engine import Engine
from ssd_jax.testing import (detection_power_by_alternative, distribution_test,
                             enumerate_window_distribution, pad_vocabulary, window_counts)

V = 4     # the tokenizer's ids: every generated token, every window cell
ROWS = 6  # the models' embedding rows: ids 0..3 and two padded rows
K = 2
WINDOW = K + 2
N = 100_000
CHUNK = 2_500  # rows per generate call: 2,500 took ~15% less CPU a case than 25,000 (same tokens)
PROMPT = [1, 3, 0]
MAX_LEN = 16  # one cache length for every window here (prompt 3 + up to 9 tokens + K + 2), one compile
POOL = 0.01   # cells of exact probability below 1% are pooled into groups of >= 1%
# the unpadded shape the weights are drawn in (the ids' weights are those of the pair before it
# was padded: the cases' distributions, and so their n and power, did not move)
CFG = tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_kv_heads=1, head_dim=16, num_layers=2)
T07 = SamplingParams(temperature=0.7)
T10 = SamplingParams(temperature=1.0)


def make_pair(rows: int = ROWS) -> tuple[Model, Model]:
    """(target, draft): a random tiny transformer and, as its draft, its first layer perturbed (a
    layer-skip draft), each padded to `rows` embedding rows (V ids: `rows=V` leaves them
    unpadded). One layer halves the draft's work, most of an SSD case's time; every accept
    length, hits and misses still occur in each case's window (benchmarks/README.md at 8faea7c, "A one-layer
    draft for the statistical pair")."""
    target = Model(CFG, random_params(CFG, 3, scale=2.0))
    perturbed = perturb(target.params, jax.random.key(5), 0.6)
    draft = Model(dataclasses.replace(CFG, num_layers=1),
                  dataclasses.replace(perturbed, layers=perturbed.layers[:1]))
    if rows == V:
        return target, draft
    return pad_vocabulary(target, rows), pad_vocabulary(draft, rows)


def min_expected(n: int) -> float:
    """The pooling bar for n samples: cells expected fewer than POOL * n times are pooled."""
    return max(5.0, POOL * n)


TARGETS = ("f32", "bf16", "int8")


@functools.lru_cache(maxsize=None)
def target_model(kind: str = "f32") -> Model:
    """The tiny target in `kind`: make_pair's ("f32"), the same weights rounded to bf16 ("bf16"),
    or quantized to int8 ("int8")."""
    if kind == "f32":
        return make_pair()[0]
    if kind == "bf16":
        cfg = dataclasses.replace(CFG, dtype="bfloat16")
        return pad_vocabulary(Model(cfg, random_params(cfg, 3, scale=2.0)), ROWS)
    if kind == "int8":
        return quantize_model(make_pair()[0], "int8")
    raise ValueError(f"target {kind!r}: one of {TARGETS}")


@functools.lru_cache(maxsize=None)
def target_logits_fn(target: str = "f32"):
    """`target_model(target)`'s full cache-free forward, tokens [N, T] -> logits [N, T, ROWS] (the
    enumeration gives the padded rows probability 0, as the engine's mask does), one jitted function for every case (the enumeration calls it on one shape per prompt and window
    length, so the cases of one process that share those compile it once)."""
    tm = target_model(target)

    @jax.jit
    def logits_fn(tokens):
        cache = init_cache(tm.cfg, tokens.shape[0], tokens.shape[1])
        return forward(tm.params, tm.cfg, tokens, cache)[0]
    return logits_fn


@functools.lru_cache(maxsize=None)
def exact(sampling: SamplingParams, window: int = WINDOW, prompt: tuple = tuple(PROMPT),
          skip: int = 0, target: str = "f32") -> np.ndarray:
    """The exact distribution [V ** window] of generated tokens skip .. skip + window - 1 under
    plain sampling (the marginal of the first skip + window tokens) of `target_model(target)`,
    enumerated from that model's own forward."""
    full = enumerate_window_distribution(target_logits_fn(target), list(prompt), skip + window,
                                         sampling, V)
    return full.reshape(V ** skip, V ** window).sum(axis=0)


def sample_windows(pair, mode, sampling, *, n: int = N, chunk: int = CHUNK, window: int = WINDOW,
                   prompt=PROMPT, engine_kw=None, engine=None, skip: int = 0, first_id: int = 0,
                   **kw):
    """n requests (ids first_id ..) through one Engine (`engine`, or one of `pair` made with
    `engine_kw`), each generating skip + window tokens; returns (tokens skip .. skip + window - 1
    of each [n, window], [Metrics per chunk])."""
    windows, metrics = [], []
    with optimized():  # one program over n requests: the runs, not the compile, are its time
        eng = engine or Engine(*pair, max_len=MAX_LEN, compilation_cache=False,
                               **(engine_kw or {}))
        for c in range(-(-n // chunk)):
            lo, hi = first_id + c * chunk, first_id + min(n, (c + 1) * chunk)
            out = generate_recorded(eng, [list(prompt)] * (hi - lo), skip=skip, window=window,
                                    mode=mode, k=K, sampling=sampling,
                                    request_ids=range(lo, hi), seed=11, **kw)
            windows.append(np.asarray(out.token_ids)[:, skip:skip + window])
            metrics.append(out.metrics)
    return np.concatenate(windows), metrics


def assert_every_path_ran(mode: str, metrics, k: int = K, backup: str | None = None) -> None:
    """What a statistical case's run must have exercised, from its chunks' Metrics: every accept
    length 0..k; for SSD, hits and misses, and inside the tested window (`sample_windows`'s
    `window_hist`) each accept length after a hit and after a miss, so the window's tokens went
    through both paths at every outcome; with `backup`, misses served by it; no draft fallback."""
    hist = np.sum([m.accept_hist for m in metrics], axis=0)
    assert len(hist) == k + 1 and np.all(hist > 0), f"every accept length 0..K must occur: {hist}"
    if mode == "ssd":
        hits, lookups = sum(m.hits for m in metrics), sum(m.lookups for m in metrics)
        assert 0 < hits < lookups, (hits, lookups)  # both a hit's and a miss's speculations
        window = np.sum([m.extra["window_hist"] for m in metrics], axis=0)
        for after, row in zip(("miss", "hit"), window):
            assert np.all(row > 0), f"every accept length in the window after a {after}: {row}"
        if backup is not None:
            assert sum(m.backups.get(backup, 0) for m in metrics) > 0, [m.backups for m in metrics]
    assert all(getattr(m, "fallback", None) is None for m in metrics), "the draft fell back"


# ---------------------------------------------------------------------------------------------
# The registry of statistical cases, and the coverage table's other rows
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StatCase:
    """One statistical case: `path` (the decoding path it covers: a row of the coverage table),
    run by `test` ("module::function"), n requests whose generated tokens skip + 1 .. skip +
    window of `prompt` under `sampling` are tested. With `eos`, each window is cut at that token
    (EOS_PAD after it). Power >= 0.95 against every alternative at total variation `power_tv` is
    enforced; `why` says why it is above 0.01, or why an SSD case's window is not past the first
    lookups (tokens 5-8)."""
    path: str
    test: str
    sampling: SamplingParams
    n: int
    window: int = WINDOW
    skip: int = 0
    prompt: tuple = tuple(PROMPT)
    eos: int | None = None
    power_tv: float = 0.01
    why: str = ""
    target: str = "f32"  # `target_model`'s kind: the model run, and enumerated
    rows: int = ROWS     # the pair's embedding rows (V = 4 of them ids): padded, as released models

    @property
    def tokens(self) -> str:
        return f"{self.skip + 1}-{self.skip + self.window}"


T08 = SamplingParams(temperature=0.8)
TOP_K2 = SamplingParams(temperature=1.0, top_k=2)  # support 2 per step: long windows keep few cells
EOS = 2
EOS_PAD = V  # the symbol of every position after the first EOS in an EOS case's windows
EOS_PROMPTS = ((2,), (1, 3, 0), (0, 2, 1, 3, 1))  # lengths 1, 3, 5 (EOS in a prompt stops nothing)
# Per-request sampling in one batch: rows alternate between these target settings
MIXED_SAMPLING = (SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.8))
_E, _P = "test_engine_exactness.py", "test_engine_paths.py"
_E_DIST = f"{_E}::test_engine_output_has_the_target_distribution"
_E_HEAD = f"{_E}::test_a_draft_head_cut_to_half_the_vocabulary_keeps_the_target_distribution"

STAT_CASES: dict[str, StatCase] = {
    # tests/statistical/test_engine_exactness.py: n is the smallest of 100k..175k with power >= 0.95 at TV 0.01
    "sd-t1.0": StatCase("SD, T 1", _E_DIST, T10, 175_000),
    "sd-t0.7-topk3": StatCase("SD, T 0.7 top-k 3", _E_DIST, SamplingParams(temperature=0.7, top_k=3),
                              125_000),
    "sd-t1.0-topp0.8": StatCase("SD, T 1 top-p 0.8", _E_DIST,
                                SamplingParams(temperature=1.0, top_p=0.8), 100_000),
    "sd-draft-t0.5-topk2": StatCase("SD, draft sampling T 0.5 top-k 2 (q' != q)", _E_DIST, T10,
                                    175_000),
    "ssd-t0.7-saguaro0.5": StatCase("SSD, Saguaro C 0.5, neural backup", _E_DIST, T07, 150_000,
                                    skip=4),
    "ssd-t1.0-saguaro0.5-random-backup": StatCase("SSD, Saguaro C 0.5, random backup", _E_DIST,
                                                  T10, 175_000, skip=4),
    "ssd-t1.0-saguaro0.5-ngram-backup": StatCase("SSD, Saguaro C 0.5, n-gram backup", _E_DIST,
                                                 T10, 175_000, skip=4),
    **{f"ssd-mixed-sampling-{i}": StatCase(
        f"SSD, per-request mixed sampling (the rows at {label})",
        f"{_E}::test_per_request_mixed_sampling_gives_each_row_its_settings_distribution", sp,
        150_000, skip=4)
       for i, (label, sp) in enumerate(zip(("T 0.7 top-k 3", "T 1 top-p 0.8"), MIXED_SAMPLING))},
    "draft-head-sd-t1.0": StatCase("SD, draft head cut to half the vocabulary", _E_HEAD, T10,
                                   175_000),
    "draft-head-ssd-t0.7-saguaro0.5": StatCase("SSD, draft head cut, Saguaro C 0.5", _E_HEAD, T07,
                                               150_000, skip=4),
    "quick-ssd-t1.0-saguaro0.5": StatCase(
        "SSD, Saguaro C 0.5 (the quick loop)",
        f"{_E}::test_quick_ssd_output_has_the_target_distribution", T10, 20_000, skip=4,
        power_tv=0.03, why="the quick loop's case (`-m 'not slow'`): it catches a broken path, "
                           "not a subtle bias"),
    # tests/statistical/test_engine_paths.py
    "ar-t0.8": StatCase("AR, T 0.8", f"{_P}::test_ar_sampling_at_temperature", T08, 175_000),
    "ssd-draft-sampling": StatCase("SSD, draft sampling T 0.5 top-k 2",
                                   f"{_P}::test_ssd_draft_sampling_differs_from_the_target", T10,
                                   175_000, skip=4),
    "ssd-fanout-backup": StatCase("SSD, fanout_backup unlike fanout, Saguaro C 0.5",
                                  f"{_P}::test_ssd_fanout_backup_differs_from_fanout", T10,
                                  175_000, skip=4),
    "ssd-auto-backup": StatCase("SSD, backup auto switching both ways (policy forced), K 1",
                                f"{_P}::test_ssd_auto_backup_switching_both_ways", TOP_K2,
                                150_000, skip=4),
    "ssd-int8-draft-bf16-rows": StatCase("SSD, int8 draft, bf16 proposal rows",
                                         f"{_P}::test_ssd_int8_draft_with_bfloat16_proposal_rows",
                                         T10, 175_000, skip=4),
    **{f"ssd-eos-prompt{len(p)}": StatCase(
        f"SSD, mixed prompt lengths stopping at EOS (prompt length {len(p)})",
        f"{_P}::test_ssd_mixed_prompt_lengths_stopping_at_eos", T10, 40_000, prompt=p, eos=EOS,
        power_tv=0.02, why="tokens 1-4: rows stop at EOS from the prefill on; three prompt lengths "
                           "share one run of 120k requests, and TV 0.01 needs 150k a length")
       for p in EOS_PROMPTS},
    "ssd-pallas-interpret": StatCase("SSD, Pallas kernels (interpreter)",
                                     f"{_P}::test_ssd_pallas_kernels_interpret_mode", TOP_K2,
                                     32_000, window=5, power_tv=0.02,
                                     why="the Pallas interpreter costs ~1.5 ms a request: "
                                         "tokens 1-5 (token 5 after a lookup) at 32k; TV 0.01 "
                                         "needs > 100k"),
    "ssd-int8-target": StatCase("SSD, int8 target (enumerated from its own forward)",
                                f"{_P}::test_ssd_int8_target", T10, 175_000, skip=4,
                                target="int8"),
    "ssd-tp-target-dp-draft": StatCase("SSD, 2-way TP target, 2-way DP draft (the device loop)",
                                       f"{_P}::test_ssd_tensor_parallel_target_data_parallel_draft",
                                       T10, 175_000, skip=4),
    "ssd-long-horizon": StatCase("SSD, K 1, every window over >= 3 rounds",
                                 f"{_P}::test_ssd_long_horizon_crosses_three_round_boundaries",
                                 TOP_K2, 175_000, window=6,
                                 why="tokens 1-6 by design: every window spans the prefill and "
                                     ">= 3 rounds"),
}

# path -> the test that checks it exactly, token for token or draw for draw
DETERMINISTIC_CHECKS: dict[str, str] = {
    "SSD, neural backup, C 1: SSD emits SD's tokens": f"{_E}::test_ssd_emits_sds_tokens",
    "SSD: a request's tokens do not depend on its batch row":
        f"{_E}::test_a_requests_tokens_do_not_depend_on_its_batch_row",
    ("every proposal source (Saguaro with f32 / bf16 rows, draft sampling, a greedy draft, the "
     "random and n-gram backups, int8 / int4 drafts, a cut draft head, SD's draft sampling, "
     "prompt lookup): each speculated token drawn from the rows the verifier gets"):
        f"{_E}::test_every_speculated_token_is_drawn_from_the_rows_the_verifier_gets",
    ("the draft in its own process at T 1 (SSD and SD): every token, hit and accept count equal "
     "to the in-process engine's on the same keys, whose paths the cases above test"):
        "test_transport.py::test_two_process_equals_in_process_and_overlaps",
}

# path -> why no statistical case covers it yet
UNCOVERED_PATHS: dict[str, str] = {
    "bf16 target": ("no exact reference: bf16 activations round differently in every forward "
                    "shape (AR's decode, a verify, a full-sequence enumeration), so the "
                    "distribution is defined only to that rounding; measured at 50k against the "
                    "enumeration from the bf16 target's own forward, AR itself fails (chi2 "
                    "89-122 against 87, empirical TV 0.016-0.019), as do SD and SSD (which emits "
                    "SD's tokens)"),
}


def truncated_at_eos(probs: np.ndarray, window: int, eos: int = EOS) -> np.ndarray:
    """The exact [V ** window] window distribution pushed through "everything after the first
    EOS becomes EOS_PAD": [(V + 1) ** window] over base-(V + 1) cells (first token most
    significant). Sums exactly: the tokens after EOS are summed out of the plain-sampling
    distribution."""
    cells = np.arange(V ** window)
    digits = np.stack([(cells // V ** (window - 1 - j)) % V for j in range(window)], 1)
    done = np.zeros(len(cells), bool)
    idx = np.zeros(len(cells), np.int64)
    for j in range(window):
        idx = idx * (V + 1) + np.where(done, EOS_PAD, digits[:, j])
        done |= digits[:, j] == eos
    return np.bincount(idx, weights=probs, minlength=(V + 1) ** window)


def case_exact(name: str) -> np.ndarray:
    """The exact distribution registered case `name`'s windows are tested against."""
    c = STAT_CASES[name]
    ex = exact(c.sampling, c.window, c.prompt, c.skip, c.target)
    return ex if c.eos is None else truncated_at_eos(ex, c.window, c.eos)


def check_windows(toks, case: str, *, false_alarm: float = 1e-3):
    """The DistributionTestResult of windows `toks` [n, window] of registered case `case` against
    its exact distribution, pooled at POOL; n and window must be the case's own. Prints the
    verdict: chi-square, its threshold, and the case's power."""
    c = STAT_CASES[case]
    toks = np.asarray(toks)
    assert toks.shape == (c.n, c.window), f"case {case}: ran {toks.shape}, registered {(c.n, c.window)}"
    res = distribution_test(window_counts(toks, V if c.eos is None else V + 1), case_exact(case),
                            false_alarm=false_alarm, min_expected=min_expected(c.n))
    # the margin, printed whether it passes or not (pytest shows it beside a failure, -rA always)
    print(f"{case}: {res}; power at TV 0.01 {documented_table()[1].get(case, '?')} (the least "
          f"over the alternatives, docs/ALGORITHM.md §3), >= 0.95 enforced at TV {c.power_tv:g}")
    return res


def verdict(pair, mode, case: str, *, false_alarm: float = 1e-3, **kw):
    """(DistributionTestResult, metrics) of registered case `case`: its n requests through
    `sample_windows` with its sampling, window, prompt and skip (`kw`: the Engine's and
    generate's other keywords) against its exact distribution."""
    c = STAT_CASES[case]
    assert c.eos is None, f"{case}: an EOS case pads its windows itself, then calls check_windows"
    if pair is not None:
        assert pair[0].cfg.vocab_size == c.rows, f"{case}: registered on a pair of {c.rows} rows"
    toks, metrics = sample_windows(pair, mode, c.sampling, n=c.n, window=c.window,
                                   prompt=list(c.prompt), skip=c.skip, **kw)
    return check_windows(toks, case, false_alarm=false_alarm), metrics


def planted_verdict(pair, mode, sampling, *, n: int, skip: int = 0, **kw):
    """A planted bug's run, which must fail (a bug is not a path: not registered): n requests,
    tokens skip + 1 .. skip + WINDOW against the exact distribution."""
    toks, metrics = sample_windows(pair, mode, sampling, n=n, skip=skip, **kw)
    res = distribution_test(window_counts(toks, V), exact(sampling, WINDOW, tuple(PROMPT), skip),
                            min_expected=min_expected(n))
    print(f"planted bug, {mode} at n={n}: {res}")
    return res, metrics


# ---------------------------------------------------------------------------------------------
# The coverage table (docs/ALGORITHM.md §3)
# ---------------------------------------------------------------------------------------------
TABLE_HEADER = ("| path | test | kind | tokens | n | power at TV 0.01 | power >= 0.95 enforced "
                "at TV | embedding rows / ids |\n|---|---|---|---|---|---|---|---|")
ALGORITHM_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ALGORITHM.md"


def power_at(name: str, tv: float) -> float:
    """The minimum rejection rate over every alternative of `detection_power_by_alternative` at
    `tv` and over alternative seeds 0-2 (400 trials each) of case `name`'s test at its n."""
    c = STAT_CASES[name]
    ex = case_exact(name)
    return min(min(detection_power_by_alternative(ex, c.n, tv=tv, trials=400, seed=s,
                                                  min_expected=min_expected(c.n)).values())
               for s in range(3))


def coverage_rows(powers: dict[str, str]) -> list[str]:
    """The table's rows: every registered statistical case (its power column from `powers`, by
    case name), then the deterministic checks, then the paths with neither."""
    rows = []
    for name, c in STAT_CASES.items():
        why = f" ({c.why})" if c.why else ""
        rows.append(f"| {c.path} | {c.test} | statistical `{name}` | {c.tokens} | {c.n:,} | "
                    f"{powers.get(name, '?')} | {c.power_tv:g}{why} | {c.rows} / {V} |")
    rows += [f"| {path} | {test} | deterministic | | | | | {ROWS} / {V} |"
             for path, test in DETERMINISTIC_CHECKS.items()]
    rows += [f"| {path} | {why} | none | | | | | |" for path, why in UNCOVERED_PATHS.items()]
    return rows


_START, _END = "<!-- coverage table: start -->", "<!-- coverage table: end -->"


def documented_table() -> tuple[list[str], dict[str, str]]:
    """(the rows of the coverage table in docs/ALGORITHM.md, {case name: its power column})."""
    body = ALGORITHM_MD.read_text().split(_START)[1].split(_END)[0]
    lines = [ln for ln in body.strip().splitlines() if ln.startswith("|")][2:]
    powers = {}
    for ln in lines:
        m = re.search(r"statistical `([^`]+)` \| [^|]* \| [^|]* \| ([^|]*) \|", ln)
        if m:
            powers[m.group(1)] = m.group(2).strip()
    return lines, powers


def write_table(powers: dict[str, str]) -> None:
    """Replace docs/ALGORITHM.md's coverage table with the registry's rendering."""
    text = ALGORITHM_MD.read_text()
    head, rest = text.split(_START)
    table = "\n".join([TABLE_HEADER, *coverage_rows(powers)])
    ALGORITHM_MD.write_text(f"{head}{_START}\n{table}\n{_END}{rest.split(_END)[1]}")


if __name__ == "__main__":
    # python tests/_engine_stats.py [--write]: print the table (powers computed afresh), or
    # rewrite docs/ALGORITHM.md's copy with it
    import sys
    powers = {name: f"{power_at(name, 0.01):.2f}" for name in STAT_CASES}
    if sys.argv[1:] == ["--write"]:
        write_table(powers)
    else:
        print("\n".join([TABLE_HEADER, *coverage_rows(powers)]))
