"""Distribution exactness of the real engine on the decoding paths tests/statistical/test_engine_exactness.py
does not cover (issue #21). Each case runs independent requests (distinct request ids) through a
real `Engine` on the tiny V = 4 pair of tests/_engine_stats.py and tests generated tokens
skip + 1 .. skip + window against the exact window distribution enumerated from the target, with
the calibrated chi-square test of `ssd_jax.testing` (false alarm 1e-3), and asserts that the path
it is about really ran.

Pooling and power. Cells of exact probability below 1% are pooled into groups of >= 1%, as in
tests/statistical/test_engine_exactness.py (`_engine_stats.min_expected`). Every case is registered in
`_engine_stats.STAT_CASES` (its n, skip, window and prompt come from there), so
test_engine_exactness.py's power test enforces power >= 0.95 at each case's registered TV
(`ssd_jax.testing.detection_power_by_alternative` on the case's own exact distribution and n,
400 trials, the minimum over every alternative and over alternative seeds 0-2) and
docs/ALGORITHM.md's coverage table lists each with its power at TV 0.01. The SSD cases read
tokens 5-8 (skip 4), each decided after at least one lookup (61-84% of requests after two,
benchmarks/README.md at 8faea7c, "A one-layer draft"), with the n that takes every alternative to 0.95 at TV
0.01 there (175k; 150k for the auto case's top-k 2 windows). Three say in the table why they
differ: the EOS case reads tokens 1-4 (rows stop from the prefill on) and stops at TV 0.02 (three
prompt lengths share one run); the Pallas-interpreter case reads tokens 1-5 at TV 0.02 (the
interpreter is slow); the long horizon reads tokens 1-6 by design (at TV 0.01).

Each case: what it proves. Unless it says otherwise a case runs SSD at T = 1, K = 2, tokens 5-8
(256 possible windows), fan-out (2, 1, 1), neural backup.

- ar_sampling_at_temperature: AR at T = 0.8, the prefill's sampled token and 3 decode steps.
- ssd_draft_sampling_differs_from_the_target: draft_sampling T = 0.5, top-k 2; every verified
  proposal row has the draft's support of 2.
- ssd_fanout_backup_differs_from_fanout: fan-out (3, 0, 1) after a hit, fanout_backup (0, 3, 1),
  Saguaro C = 0.5 on each list's own top F_j + 1; round 1's lookup hits every row that accepted
  one token and none that accepted none, as the backup list (not the after-hit one) makes it.
- ssd_auto_backup_switching_both_ways: backup="auto" switching neural -> random -> neural within
  every call (its policy replaced by one that alternates: the measured-time policy cannot be
  steered), K = 1, T = 1 top-k 2 (56 possible windows: each token's top 2 depends on what
  came before).
- ssd_int8_draft_with_bfloat16_proposal_rows: an int8 draft (models.quant) and
  row_dtype="bfloat16"; every verified row is bf16.
- ssd_int8_target: an int8 target, its exact distribution enumerated from its own forward (TV
  0.012 from the float32 target's in this window). A bf16 target has no exact reference
  (`_engine_stats.UNCOVERED_PATHS`).
- ssd_mixed_prompt_lengths_stopping_at_eos: prompts of lengths 1, 3 and 5 in one batch, EOS ending
  rows at the prefill and in rounds 1, 2 and 3, tokens 1-4; each length against its own exact
  window distribution truncated at EOS (121 possible).
- ssd_pallas_kernels_interpret_mode: backend="pallas", tree_attention and cache_gather in the
  Pallas interpreter (none falling back), tokens 1-5, T = 1 top-k 2 (32 possible windows).
- ssd_tensor_parallel_target_data_parallel_draft: a 2-way tensor-parallel target and a 2-way
  data-parallel draft (colocated on the 2 devices), on the device loop.
- ssd_long_horizon_crosses_three_round_boundaries: K = 1, tokens 1-6, T = 1 top-k 2; every
  window spans the prefill and >= 3 rounds.

Backend. The cases run the XLA formulation (`backend="xla"`, what a GPU or TPU runs around its
Pallas kernels), the Pallas one in the interpreter case: the paths they cover are the engine's and
the algorithm's, the same whatever kernels compute a forward, and the CPU kernels (the default on
this CPU, which test_engine_exactness.py's cases run) took 1.6x their time over a case's 175k
requests. The kernels are held to their references in tests/cpu and tests/unit/test_backends.py.

Covered elsewhere (retired here): SSD with target and draft top-k, and with top-p, by
test_engine_exactness.py's per-request mixed sampling case (top-k 3 at T 0.7 and top-p 0.8 at T 1
in one SSD run, each row against its own exact distribution) and SD's top-k / top-p cases; an
int4 draft, whose rows the deterministic proposal-source check holds token by token as it does the
int8 draft's (this module's int8 case covers a quantized draft's forward end to end).

Time: benchmarks/README.md at 8faea7c ("Every SSD path case past the lookups") has each case's seconds.

test_truncated_at_eos_maps_windows checks the EOS truncation map on hand-made windows.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax.algorithm.steps as steps_module
import ssd_jax.runtime.engine as engine_module
from ssd_jax.algorithm.policy import BackupChooser
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.quant import Int8Weight, quantize_model
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.runtime.placement import make_placement

from _compile_level import optimized
from _engine_stats import (CHUNK, EOS, EOS_PAD, EOS_PROMPTS, K, STAT_CASES, V, WINDOW,
                           assert_every_path_ran, case_exact, check_windows, exact,
                           make_pair, target_model, truncated_at_eos, verdict)
from _round_record import generate_recorded

pytestmark = pytest.mark.slow

F211 = SSDConfig(fanout=(2, 1, 1))


@pytest.fixture(scope="module")
def pair():
    return make_pair()


# ---------------------------------------------------------------------------------- helpers
@dataclasses.dataclass
class Run:
    """What `_sample` collected: per request (in request-id order) its generated ids, finish
    reason, prompt index, and (with `log_calls`, else empty) the number of tokens each
    `on_tokens` call kept (call 0 is the prefill's token, call r the tokens committed in round
    r); and each chunk's Metrics."""
    tokens: list[list[int]]
    finish: list[str]
    prompt_index: np.ndarray
    calls: list[list[int]]
    metrics: list

    def windows(self, window: int, skip: int = 0) -> np.ndarray:
        """[n, window] ids: tokens skip + 1 .. skip + window of each request, every request
        having generated skip + window tokens."""
        assert all(len(t) == skip + window for t in self.tokens)
        return np.asarray(self.tokens, np.int64)[:, skip:]


def _engine(pair, backend: str = "xla", **kw) -> Engine:
    """The case's Engine, on the XLA formulation unless `backend` says otherwise (module docstring,
    "Backend")."""
    return Engine(*pair, max_len=16, compilation_cache=False, backend=backend, **kw)


def _sample(eng: Engine, mode: str, case: str, *, chunk: int, k: int = K, n: int | None = None,
            prompts=None, log_calls: bool = False, **kw) -> Run:
    """Registered case `case`'s n requests (its sampling, skip and window) through `eng` in
    generate calls of `chunk` rows; row i of a call gets prompts[i % len(prompts)] (default: the
    case's prompt) and request id (call * chunk + i); max_new_tokens = skip + window. Run.calls
    is recorded (by an `on_tokens` callback, which makes the round loop hand every round's
    tokens to the host) with `log_calls` only."""
    spec = STAT_CASES[case]
    sampling, window, n = spec.sampling, spec.window, n or spec.n
    prompts = prompts or (spec.prompt,)
    tokens, finish, pidx, calls, metrics = [], [], [], [], []
    assert n % chunk == 0, f"{case}: {n} requests in calls of {chunk}"
    rows = [list(prompts[i % len(prompts)]) for i in range(chunk)]
    with optimized():  # as sample_windows: the runs, not the compile, are a case's time
        for c in range(n // chunk):
            log = [[] for _ in range(chunk)]
            ids = range(c * chunk, (c + 1) * chunk)
            out = generate_recorded(eng, rows, skip=spec.skip, window=window, mode=mode, k=k,
                                    sampling=sampling, request_ids=ids, seed=11, **kw,
                                    **({"on_tokens": lambda row, ids: log[row].append(len(ids))}
                                       if log_calls else {}))
            tokens += out.token_ids
            finish += out.finish_reasons
            pidx += [i % len(prompts) for i in range(chunk)]
            calls += log
            metrics.append(out.metrics)
    return Run(tokens, finish, np.asarray(pidx), calls, metrics)


def _check(run: Run, case: str):
    res = check_windows(run.windows(STAT_CASES[case].window, STAT_CASES[case].skip), case)
    assert res.passed, str(res)
    return res


@pytest.fixture
def verified_rows(monkeypatch):
    """Spy on every verify: the dtype and the largest support (non-zero entries) of the proposal
    rows the engine hands the target, per round."""
    seen = {"dtypes": set(), "support": 0}
    original = steps_module.verify  # both round loops call it through the module

    def spy(params, cfg, cache, bonus, spec, rows, active, *a, **kw):
        seen["dtypes"].add(jnp.dtype(rows.dtype).name)
        live = np.asarray(rows, np.float32)[np.asarray(active)]
        if live.size:
            seen["support"] = max(seen["support"], int((live > 0).sum(-1).max()))
        return original(params, cfg, cache, bonus, spec, rows, active, *a, **kw)

    monkeypatch.setattr(steps_module, "verify", spy)
    return seen


# ---------------------------------------------------------------------------------- AR
def test_ar_sampling_at_temperature(pair):
    # prefill's first token and every decode step are sampled at T = 0.8
    res, metrics = verdict(pair, "ar", "ar-t0.8", engine=_engine(pair))
    assert res.passed, str(res)
    for m in metrics:
        assert m.mode == "ar" and m.rounds == WINDOW - 1 and m.accept_hist == []


# ---------------------------------------------------------------------------------- SSD sampling
def test_ssd_draft_sampling_differs_from_the_target(pair, verified_rows):
    draft = SamplingParams(temperature=0.5, top_k=2)
    res, metrics = verdict(pair, "ssd", "ssd-draft-sampling", engine=_engine(pair), ssd=F211,
                           draft_sampling=draft)
    assert res.passed, str(res)
    assert_every_path_ran("ssd", metrics)
    # every proposal row verified (tree and neural backup) is the draft's top-2 row, not a T=1 row
    assert verified_rows["support"] == 2, verified_rows


def test_ssd_fanout_backup_differs_from_fanout(pair):
    # After a hit the fork caches 3 bonus candidates at j = 0 and none at j = 1; after a backup
    # none at j = 0 and 3 at j = 1, and Saguaro (C = 0.5) scales the top F_j + 1 of each list's
    # own. Round 1 runs on the backup's speculation, and with V = 4 three candidates at j are all
    # tokens but the rejected s_{j+1}, so round 1's lookup hits every row that accepted one token
    # and none that accepted none (under the after-hit list it would be the other way round).
    ssd = SSDConfig(fanout=(3, 0, 1), fanout_backup=(0, 3, 1), saguaro_c=0.5)
    eng = _engine(pair)
    run = _sample(eng, "ssd", "ssd-fanout-backup", chunk=CHUNK, ssd=ssd)
    _check(run, "ssd-fanout-backup")
    assert_every_path_ran("ssd", run.metrics)
    for m in run.metrics:
        (miss0, miss1, _), (hit0, hit1, hit2) = m.extra["first_lookup"]
        assert hit0 == 0 and miss1 == 0 and miss0 > 0 and hit1 > 0, m.extra["first_lookup"]
        assert m.timeline[0].hit == hit1 + hit2, (m.timeline[0].hit, m.extra["first_lookup"])


class _Alternating(BackupChooser):
    """backup="auto" forced to switch: every decision alternates random, neural, random, ...
    (the engine uses neural until the first lookup). `served` logs the kind of every backup that
    really ran after a miss, as the engine reports it to `record`."""
    served: list[str] = []

    def __init__(self, batch):
        super().__init__(batch)
        self.calls = 0

    def choose(self, p_hit, tv, tp, e_hit):
        self.calls += 1
        return "random" if self.calls % 2 else "neural"

    def record(self, kind, backup_s=None, tokens=()):
        if backup_s is not None:
            _Alternating.served.append(kind)
        super().record(kind, backup_s, tokens)


def test_ssd_auto_backup_switching_both_ways(pair, monkeypatch):
    # K = 1, tokens 5-8: a round emits <= 2 tokens, so token 5 comes from round 2 or later and
    # every window reaches round 4, so the speculation after the neural -> random switch (round
    # 3's, from round 2's backup) and after the random -> neural one (round 4's) is in it.
    # BackupChooser decides from measured times, which a test cannot steer: the engine's policy
    # object is replaced by one that alternates, everything else is the engine's.
    monkeypatch.setattr(engine_module, "BackupChooser", _Alternating)
    _Alternating.served = []
    eng = _engine(pair)
    run = _sample(eng, "ssd", "ssd-auto-backup", chunk=CHUNK, k=1,
                  ssd=SSDConfig(fanout=(1, 2), backup="auto"))
    _check(run, "ssd-auto-backup")
    assert_every_path_ran("ssd", run.metrics, 1)
    for m in run.metrics:
        assert m.backups.get("neural", 0) > 0 and m.backups.get("random", 0) > 0, m.backups
    served = _Alternating.served
    switches = [(a, b) for a, b in zip(served, served[1:]) if a != b]
    assert ("neural", "random") in switches and ("random", "neural") in switches, served
    assert served[:3] == ["neural", "random", "neural"], served


def test_ssd_int8_draft_with_bfloat16_proposal_rows(pair, verified_rows):
    # two proposal-side changes in one run: each is checked alone, token by token, by
    # test_engine_exactness.py::test_every_speculated_token_is_drawn_from_the_rows_the_verifier_gets
    # (int8 and int4 drafts, bf16 rows): this case holds the whole output to the target's
    # distribution with both
    target, draft = pair
    qdraft = quantize_model(draft, "int8")
    assert isinstance(qdraft.params.layers[0].wqkv, Int8Weight), type(qdraft.params.layers[0].wqkv)
    res, metrics = verdict((target, qdraft), "ssd", "ssd-int8-draft-bf16-rows",
                           engine=_engine((target, qdraft)),
                           ssd=SSDConfig(fanout=(2, 1, 1), row_dtype="bfloat16"))
    assert res.passed, str(res)
    assert_every_path_ran("ssd", metrics)
    assert verified_rows["dtypes"] == {"bfloat16"}, verified_rows


def test_ssd_int8_target(pair):
    # The output must be the distribution of the target that runs, int8 weights and all: the
    # case's exact distribution is enumerated from that model's own forward, and differs from
    # the float32 target's (so a path that silently ran the f32 weights could fail it). A bf16
    # target has no exact reference (_engine_stats.UNCOVERED_PATHS says why).
    case = "ssd-int8-target"
    target = target_model(STAT_CASES[case].target)
    assert isinstance(target.params.layers[0].wqkv, Int8Weight)
    c = STAT_CASES[case]
    f32 = exact(c.sampling, c.window, c.prompt, c.skip)  # the float32 target's, same window
    assert np.abs(case_exact(case) - f32).sum() / 2 > 0.005  # 0.012
    res, metrics = verdict((target, pair[1]), "ssd", case, engine=_engine((target, pair[1])),
                           ssd=F211)
    assert res.passed, str(res)
    assert_every_path_ran("ssd", metrics)


# ---------------------------------------------------------------------------------- EOS
def test_truncated_at_eos_maps_windows():
    probs = np.zeros(V ** 3)
    probs[[0 * 16 + 2 * 4 + 1, 2 * 16 + 1 * 4 + 3, 1 * 16 + 3 * 4 + 0]] = [0.5, 0.3, 0.2]
    t = truncated_at_eos(probs, 3)
    base = V + 1
    assert t[0 * base ** 2 + 2 * base + EOS_PAD] == 0.5  # 0 2 1 -> 0 2 EOS_PAD
    assert t[2 * base ** 2 + EOS_PAD * base + EOS_PAD] == 0.3  # 2 1 3 -> 2 EOS_PAD EOS_PAD
    assert t[1 * base ** 2 + 3 * base + 0] == 0.2  # no EOS: unchanged
    assert t.sum() == 1.0 and np.count_nonzero(t) == 3


def test_ssd_mixed_prompt_lengths_stopping_at_eos(pair):
    cases = [f"ssd-eos-prompt{len(p)}" for p in EOS_PROMPTS]
    window, chunk = STAT_CASES[cases[0]].window, 24_000
    eng = _engine(pair)
    run = _sample(eng, "ssd", cases[0], n=sum(STAT_CASES[c].n for c in cases), chunk=chunk,
                  prompts=EOS_PROMPTS, log_calls=True, ssd=F211, eos_ids=(EOS,))
    assert_every_path_ran("ssd", run.metrics)
    padded = np.full((len(run.tokens), window), EOS_PAD, np.int64)
    for i, t in enumerate(run.tokens):
        assert len(t) == window or (run.finish[i] == "eos" and t[-1] == EOS), (t, run.finish[i])
        assert EOS not in t[:-1]
        padded[i, :len(t)] = t
    for g, (prompt, case) in enumerate(zip(EOS_PROMPTS, cases)):
        assert STAT_CASES[case].prompt == prompt
        rows = run.prompt_index == g
        res = check_windows(padded[rows], case)
        assert res.passed, f"prompt {prompt}: {res}"
        # rows of this prompt length stopped at EOS at the prefill and in rounds 1, 2 and 3
        stop_rounds = {len(run.calls[i]) - 1 for i in np.flatnonzero(rows) if run.finish[i] == "eos"}
        assert stop_rounds == {0, 1, 2, 3}, (prompt, stop_rounds)


# ---------------------------------------------------------------------------------- kernels, layouts
def test_ssd_pallas_kernels_interpret_mode(pair):
    # K = 2, window 5: every window holds a round-2 token, whose speculation is the Pallas
    # cache_gather's lookup in the tree the Pallas tree_attention drafted (or a backup). The
    # interpreter is slow and superlinear in the batch (64 rows per call is the fastest per row).
    eng = _engine(pair, backend="pallas")
    run = _sample(eng, "ssd", "ssd-pallas-interpret", chunk=64, ssd=F211)
    _check(run, "ssd-pallas-interpret")
    assert_every_path_ran("ssd", run.metrics)
    assert all(m.backend == {"target": "pallas", "draft": "pallas"} for m in run.metrics), \
        run.metrics[0].backend  # no kernel fell back to its XLA reference


def test_ssd_tensor_parallel_target_data_parallel_draft(pair):
    # the 2 virtual devices carry a 2-way tensor-parallel target and a 2-way data-parallel draft
    # (colocated; a split 2+2 layout needs 4 devices)
    placement = make_placement("colocated", target_devices=2, draft_devices=2)
    eng = _engine(pair, placement=placement)
    assert eng.placement.tp == 2 and eng.placement.dp == 2
    res, metrics = verdict(pair, "ssd", "ssd-tp-target-dp-draft", engine=eng, ssd=F211)
    assert res.passed, str(res)
    assert_every_path_ran("ssd", metrics)
    assert str(eng.tcache.k[0].sharding.spec) == "P(None, None, 'model')"
    assert str(eng.tparams.layers[0].wqkv.sharding.spec) == "P(None, 'model')"
    assert str(eng.worker.cache.k[0].sharding.spec) == "P('data',)"
    assert metrics[0].backend == {"target": "xla", "draft": "xla"}


# ---------------------------------------------------------------------------------- horizon
def test_ssd_long_horizon_crosses_three_round_boundaries(pair):
    # K = 1: a round emits at most 2 tokens, so token 6 comes from round 3 or later: every window
    # spans the prefill and >= 3 rounds (>= 3 round boundaries)
    k = 1
    eng = _engine(pair)
    run = _sample(eng, "ssd", "ssd-long-horizon", chunk=25_000, k=k, log_calls=True,
                  ssd=SSDConfig(fanout=(1, 2)))
    _check(run, "ssd-long-horizon")
    assert_every_path_ran("ssd", run.metrics, k)
    assert min(len(log) for log in run.calls) >= 4  # prefill + >= 3 rounds per request
