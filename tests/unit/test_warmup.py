"""A call's first round readied before the call (#58 item 2; ssd_jax.runtime.warmup).

With every cache warm, the two-process SSD command's first round waited ~8.5 s while the draft
process traced and loaded its chain and tree (and ~0.8 s for the target's verify), uncounted.
Now `call_plan` computes the call's shapes and statics from the request alone, the draft process
runs a throwaway round of them while the target loads, and the target one after: the plan is
what the call really asks (recorded from the engine's own calls), after the warm-up a call
compiles nothing, a wait for a warm-up still running counts as the call's compile time, and a
warm second CLI run's first round is within 3x of its median round."""
import dataclasses
import json
import os
import statistics
import subprocess

import jax
import numpy as np
import pytest
from _cli_models import SCRIPT, gen_args

from _byte_tokenizer import CHAT_TEMPLATE, byte_tokenizer
from _tiny import padded_draft, padded_model
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.runtime.config import SSDConfig
from ssd_jax.runtime.draft_worker import DraftWorker
from ssd_jax.runtime.engine import Engine
from ssd_jax.runtime.warmup import call_plan

# a vocabulary of its own (259 ids + padded rows), so that no other test module's programs are
# in this process's jit caches: what a call compiles here, it compiles because of this module
CFG = tiny_config("llama", vocab_size=259)
IDS = [[5, 6, 7, 8, 9], [11, 12, 13]]

REQUESTS = {
    "ssd, token ids": dict(prompts=[[1, 2, 3]], mode="ssd", k=3, ssd=SSDConfig(fanout=(2, 2, 1, 1))),
    "ssd, a batch, per-request sampling, backup auto": dict(
        prompts=IDS, mode="ssd", k=2, seed=7, request_ids=[5, 9],
        sampling=[SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5)],
        draft_sampling=SamplingParams(temperature=0.7), ssd=SSDConfig(backup="auto")),
    "ssd, ngram backup, bf16 rows, default fan-out": dict(
        prompts=IDS, mode="ssd", k=3, ssd=SSDConfig(backup="ngram", row_dtype="bfloat16")),
    "ssd, text through the chat template": dict(prompts="ab cd", chat=True, mode="ssd", k=2),
    "ssd, messages": dict(messages=[{"role": "system", "content": "terse"},
                                    {"role": "user", "content": "hi"}], mode="ssd", k=2),
    "sd, sampled": dict(prompts=IDS, mode="sd", k=2, sampling=SamplingParams(temperature=1.0)),
}


@pytest.fixture(scope="module")
def models():
    tok = byte_tokenizer(CHAT_TEMPLATE)
    target = padded_model(CFG, seed=0)
    target = Model(target.cfg, target.params, tok)
    return target, padded_draft(target, seed=1, rel=0.05)


def fresh(models) -> Engine:
    """An engine over copies of the models (an engine takes its models' params over)."""
    target, draft = models
    copy = lambda m: Model(m.cfg, jax.tree.map(lambda x: x, m.params), m.tokenizer)  # noqa: E731
    return Engine(copy(target), copy(draft), compilation_cache=False, step_store=False)


def same_run(a, b) -> bool:
    """Two CallConfigs equal field by field (their sampling values compared as arrays)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("draft_sampling", "target_sampling"):
            if not all(np.array_equal(getattr(x, g), getattr(y, g))
                       for g in ("temperature", "top_k", "top_p")):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_the_plan_is_what_the_call_asks_of_its_draft(models, case, monkeypatch):
    """The engine's own calls to its draft are the plan's: the prefill block, lengths and cache
    length, and the CallConfig of the first round."""
    request = dict(REQUESTS[case], max_new_tokens=6)
    seen = {}
    start, calls = DraftWorker.start, {m: getattr(DraftWorker, m) for m in ("propose", "backup")}

    def record_start(self, tokens, lens, cache_len):
        seen.setdefault("start", (np.array(tokens), np.array(lens), cache_len))
        return start(self, tokens, lens, cache_len)

    def recorder(method):  # the first round's: SD's proposal, SSD's backup
        def record(self, s, run, *a, **kw):
            seen.setdefault("run", run)
            return calls[method](self, s, run, *a, **kw)
        return record

    monkeypatch.setattr(DraftWorker, "start", record_start)
    for method in calls:
        monkeypatch.setattr(DraftWorker, method, recorder(method))
    target, _ = models
    plan = call_plan(target.tokenizer, target.cfg, max_len=512, **request)
    eng = fresh(models)
    eng.max_len = 512
    eng.generate(**request)
    tokens, lens, cache_len = seen["start"]
    np.testing.assert_array_equal(plan.tokens, tokens)
    np.testing.assert_array_equal(plan.lens, lens)
    assert plan.cache_len == cache_len and plan.row_vocab == target.cfg.vocab_size
    assert same_run(plan.call, seen["run"]), (plan.call, seen["run"])


def test_no_plan_without_a_draft_call_and_a_bad_request_is_the_calls_error(models):
    """Plain decoding and a planned fan-out have no plan; a request the call refuses raises the
    same error from the plan, before anything starts."""
    target, _ = models
    tok, cfg = target.tokenizer, target.cfg
    assert call_plan(tok, cfg, prompts=IDS, mode="ar") is None
    assert call_plan(tok, cfg, prompts=IDS, mode="ssd", ssd=SSDConfig(fanout="plan")) is None
    eng = fresh(models)
    for bad in (dict(prompts=IDS, k=3, ssd=SSDConfig(fanout=(1, 1))),
                dict(prompts=[list(range(1, 250))], max_new_tokens=300),
                dict(prompts=IDS, stop="end"),
                dict(prompts=[[300]])):
        with pytest.raises((ValueError, TypeError)) as from_plan:
            call_plan(tok, cfg, max_len=512, **bad)
        with pytest.raises(type(from_plan.value)) as from_call:
            eng.max_len = 512
            eng.generate(**bad)
        assert str(from_plan.value) == str(from_call.value)


@pytest.mark.parametrize("mode,backup", [("ssd", "neural"), ("ssd", "auto"), ("sd", "neural")])
def test_after_the_warm_up_a_call_compiles_nothing(models, mode, backup):
    """A first call at new shapes compiles (the module's own vocabulary: nothing of it is cached
    yet); after `Engine.warm_up` and `DraftWorker.warm_up` of another call's plan, that call
    compiles nothing, and its tokens are the tokens of the call without a warm-up. backup="auto"
    resolves each round under a traced choice (`round_steps.resolve`): its own program, which
    the warm-up compiles."""
    target, _ = models
    eng = fresh(models)
    # shapes no other test here runs: K (4, 5 for SSD; 1, 8 for auto; 6, 7 for SD), prefill
    # buckets 64 and 32, caches 256 and 512
    k_cold, k = {("ssd", "neural"): (4, 5), ("ssd", "auto"): (1, 8), ("sd", "neural"): (6, 7)}[
        mode, backup]
    cold = dict(prompts=[list(range(1, 40))], mode=mode, k=k_cold, max_new_tokens=8)
    assert eng.generate(**cold).metrics.compile_s > 0
    request = dict(prompts=[list(range(40, 60))], mode=mode, k=k, max_new_tokens=300,
                   ssd=SSDConfig(fanout=(2,) + (1,) * k, backup=backup))
    plan = call_plan(target.tokenizer, target.cfg, max_len=eng.max_len, **request)
    target_side = eng.warm_up(plan)
    eng.worker.warm_up(plan)
    assert target_side["compile_s"] > 0 and any(p["count"] for p in target_side["programs"].values())
    out = eng.generate(**request)
    assert out.metrics.compile_s == 0 and out.metrics.compiles == {}, out.metrics.compiles
    assert not any(r.compiled for r in out.metrics.timeline)
    assert out.token_ids == fresh(models).generate(**request).token_ids


def _two_process(pair, tmp_path, *extra):
    env = dict(os.environ, SSD_JAX_COMPILE_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
               SSD_JAX_HOME=str(tmp_path / "home"))
    proc = subprocess.run([SCRIPT, *gen_args(pair, "--mode", "ssd", "--placement", "two-process",
                                             "--json", "--max-new-tokens", "40", *extra)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["metrics"], proc.stderr


def test_a_warm_second_cli_run_waits_on_no_compile(pair, tmp_path):
    """The two-process SSD command twice with one compilation cache: both runs' calls compile
    nothing (the warm-ups did, and say what); the second's draft programs come from the cache, and
    its first round is within 3x of its median round (it was ~200x: 0.5 s against 2.5 ms)."""
    runs = [_two_process(pair, tmp_path, "--progress") for _ in range(2)]
    for m, err in runs:
        lines = err.splitlines()
        ready = [ln for ln in lines if ln.startswith("ssd-jax:   the draft process readied ")]
        assert len(ready) == 1 and "beside the target's load (" in ready[0], err
        assert "ssd-jax: generating" in lines and "a first run compiles" not in err, err
        assert m["compile_s"] == 0 and m["compiles"] == {}, m["compiles"]
        draft = m["warmup"]["draft"]
        assert draft["error"] is None and {"jit(stored_draft_tree)", "jit(stored_draft_chain)"} \
            <= set(draft["programs"]), draft
        assert m["warmup"]["target"]["programs"], m["warmup"]
    second = runs[1][0]
    assert all("persistent cache" in p["source"] for p in second["warmup"]["draft"]["programs"]
               .values() if p["count"]), second["warmup"]["draft"]
    assert len(second["timeline"]) >= 8 and not any(r["compiled"] for r in second["timeline"])
    # one round is a single sample of a ~2 ms step on a shared machine: a warm run whose first
    # round met a scheduler hiccup is run once more (the bug this holds off was 200x, every run)
    def first_round_ratio(m):
        rounds = [r["round_s"] for r in m["timeline"]]
        return rounds[0] / statistics.median(rounds)

    ratios = [first_round_ratio(second)]
    if ratios[0] > 3:
        ratios.append(first_round_ratio(_two_process(pair, tmp_path)[0]))
    assert ratios[-1] <= 3, ratios


def test_a_call_that_starts_before_the_warm_up_ends_counts_the_wait(pair, tmp_path):
    """A library caller who does not wait for the warm-up (`warmed()`): the call's first request
    waits for its end, and that wait is the call's compile time, as one program; the tokens are
    those of a call without a warm-up."""
    from ssd_jax.models.load import load_model, load_tokenizer, read_config
    from ssd_jax.runtime.transport import start_two_process

    request = dict(prompts=["def add(a, b):"], mode="ssd", k=3, max_new_tokens=12,
                   ssd=SSDConfig(fanout=(2, 2, 1, 1)))
    tok = load_tokenizer(pair["target"])
    plan = call_plan(tok, read_config(pair["target"]), max_len=256, **request)
    remote = start_two_process(pair["draft"], cores=None, compilation_cache=False,
                               step_store=False)
    try:
        remote.warm(plan)
        eng = Engine(load_model(pair["target"], "float32"), remote_draft=remote, max_len=256,
                     compilation_cache=False, step_store=False)
        out = eng.generate(**request)
        waited = out.metrics.compiles["draft process: the warm-up, still running"]
        assert waited["seconds"] > 0 and waited["count"] == 1
        assert remote.warmup["error"] is None and remote.warmup["waited_s"] == waited["seconds"]
        assert remote.warmed() is remote.warmup  # read already: nothing more to wait for
        again = eng.generate(**request)
    finally:
        remote.close()
    assert out.token_ids == again.token_ids


def test_a_prompt_whose_prefill_block_is_wider_than_the_cache_runs_two_process(pair, tmp_path):
    """600 prompt tokens and 10 new ones: a prefill block of 1024 columns, a cache of 768 slots.
    The draft process refused such a "start" (and so the warm-up) as not fitting together, and
    the call fell back to plain decoding; it fits (the prefill writes the prompt, not the block's
    padding), so two-process SSD now gives split's tokens, with no fallback."""
    def run(placement):
        env = dict(os.environ, SSD_JAX_COMPILE_CACHE="0", JAX_PLATFORMS="cpu",
                   SSD_JAX_HOME=str(tmp_path / "home"))
        args = gen_args(pair, "--mode", "ssd", "--placement", placement, "--json", "--max-len",
                        "2048", "--max-new-tokens", "10")
        args[args.index("--prompt") + 1] = "ab" * 300  # one token a character
        proc = subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)
    two, split = run("two-process"), run("split")
    assert two["metrics"]["fallback"] is None and two["metrics"]["warmup"]["draft"]["error"] is None
    assert two["token_ids"] == split["token_ids"] and len(two["token_ids"]) == 10
