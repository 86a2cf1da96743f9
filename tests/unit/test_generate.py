"""Plain and speculative generate: batches of mixed prompt lengths, EOS, stop strings, exact budgets,
streaming, log-probs, one compile per prefill bucket, and a clear error for every bad input."""
import functools
import hashlib

import jax
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.models.transformer import forward
from ssd_jax.algorithm import steps
from ssd_jax.runtime.device_loop import DeviceLoop
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.algorithm.sampling import SamplingParams

CFG = tiny_config("llama", vocab_size=40)


class CharTokenizer:
    """Token i <-> one character: enough to exercise text prompts and stop strings."""
    alphabet = "abcdefghijklmnopqrstuvwxyz .,:;!?()[]012"

    def __init__(self, eos=(39,)):
        self.vocab_size = len(self.alphabet)
        self.eos_ids = tuple(eos)

    def encode(self, text):
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)

    def apply_chat_template(self, messages):
        return "user: " + messages[-1]["content"] + " ai:"

    def fingerprint(self):
        return hashlib.sha256(self.alphabet.encode()).hexdigest()


@pytest.fixture(scope="module")
def models():
    t = Model(CFG, random_params(CFG, 0, scale=1.0), CharTokenizer())
    d = Model(CFG, perturb(t.params, jax.random.key(2), 0.05), CharTokenizer())
    return t, d


@pytest.fixture(scope="module")
def engine(models):
    return Engine(*models, compilation_cache=False)


@functools.partial(jax.jit, static_argnums=1)
def _full_forward(params, cfg, tokens, num_new):
    """Logits [1, V] of a cache-free forward over tokens [1, T], of which num_new are real."""
    return forward(params, cfg, tokens, init_cache(cfg, 1, tokens.shape[1]), num_new, last_only=True)[0]


def full_greedy(model, prompt, n):
    ids = list(prompt)
    T = len(prompt) + n  # one shape (one compile) for every step: right-padded past the real tokens
    for _ in range(n):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(ids)] = ids
        logits = _full_forward(model.params, model.cfg, tokens, np.asarray([len(ids)], np.int32))
        ids.append(int(np.argmax(np.asarray(logits[0]))))
    return ids[len(prompt):]


def test_mixed_lengths_match_one_by_one_and_full_forward(engine, models):
    prompts = ["hello world", "ab", "the quick brown fox jumps"]
    batched = engine.generate(prompts, mode="ar", max_new_tokens=12)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], mode="ar", max_new_tokens=12)
        assert alone.token_ids[0] == batched.token_ids[i]
        # the incremental-cache path equals a cache-free full forward
        assert batched.token_ids[i] == full_greedy(models[0], CharTokenizer().encode(p), 12)
    assert batched.finish_reasons == ["length"] * 3
    assert all(len(t) == 12 for t in batched.token_ids)
    assert batched.texts[0] == CharTokenizer().decode(batched.token_ids[0])


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_exact_budget_eos_and_stop_strings(engine, mode):
    kw = dict(mode=mode, k=3, ssd=SSDConfig(fanout=(2, 1, 1, 1)))
    base = engine.generate(["hello world", "ab"], max_new_tokens=20, **kw)
    for n in (1, 2, 5, 7):  # budgets that end inside a round
        out = engine.generate(["hello world", "ab"], max_new_tokens=n, **kw)
        assert [len(t) for t in out.token_ids] == [n, n]
        assert [t for t in out.token_ids] == [b[:n] for b in base.token_ids]
    # EOS: pick a token the model emits at step 4 of the first row
    eos = base.token_ids[0][4]
    out = engine.generate(["hello world", "ab"], max_new_tokens=20, eos_ids=[eos], **kw)
    first = base.token_ids[0].index(eos)
    assert out.token_ids[0] == base.token_ids[0][: first + 1]
    assert out.finish_reasons[0] == "eos"
    # stop string: two characters of the second row's text
    text = base.texts[1]
    stop = text[6:8]
    out = engine.generate(["hello world", "ab"], max_new_tokens=20, stop=[stop], **kw)
    assert out.finish_reasons[1] == "stop"
    assert out.texts[1] == text[: text.find(stop)]


def test_streaming_and_logprobs(engine, models):
    got = {}
    out = engine.generate(["hello", "abc"], mode="sd", k=2, max_new_tokens=9,
                          on_tokens=lambda row, ids: got.setdefault(row, []).extend(ids))
    assert got == {0: out.token_ids[0], 1: out.token_ids[1]}
    # log-probs are the target's log-softmax at each emitted token
    t = models[0]
    ids = CharTokenizer().encode("hello") + out.token_ids[0]
    logits, _ = forward(t.params, t.cfg, np.asarray([ids], np.int32), init_cache(t.cfg, 1, len(ids)))
    lp = np.asarray(jax.nn.log_softmax(logits[0], -1))
    want = [lp[5 - 1 + i, tok] for i, tok in enumerate(out.token_ids[0])]
    np.testing.assert_allclose(out.logprobs[0], want, atol=1e-4)


def test_prompts_in_one_bucket_compile_prefill_once(engine):
    jax.clear_caches()
    for p in (["abc"], ["abcde"], ["abcdefghij"]):
        engine.generate(p, mode="ar", max_new_tokens=2)
    assert steps.prefill._cache_size() == 1  # lengths 3, 5, 10 share the 16-token bucket
    engine.generate(["a", "abcdefghijklm"], mode="ar", max_new_tokens=2)
    assert steps.prefill._cache_size() == 2  # a new batch size is a new shape


def test_chat_template_is_applied(engine):
    out = engine.generate(["hi"], mode="ar", max_new_tokens=3, chat=True)
    plain = engine.generate(["user: hi ai:"], mode="ar", max_new_tokens=3)
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("call, match", [
    (dict(prompts=[""]), "empty prompt"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=["ab"], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=["ab"], max_new_tokens=5000), "exceeds the cache length"),
    (dict(prompts=["ab"], mode="beam"), "unknown mode"),
    (dict(prompts=["ab"], mode="sd", k=0), "lookahead"),
    (dict(prompts=[[1, 2, 99]]), "out of range"),
    (dict(prompts=["ab"], mode="ssd", ssd=SSDConfig(fanout=(1, 1))), "K\\+1"),
    (dict(prompts=["ab"], mode="ssd", ssd=SSDConfig(fanout=(1, 1, 1, 1, 1),
                                                   fanout_backup=(2, 1, 1, 1, 1))), "equal"),
    (dict(prompts=["ab"], mode="ssd", ssd=SSDConfig(saguaro_c=0.0)), "saguaro_c"),
    (dict(prompts=["ab"], mode="ssd", ssd=SSDConfig(backup="magic")), "unknown backup"),
    (dict(prompts=["ab"], stop=["x"], request_ids=[1, 2]), "request_ids"),
])
def test_bad_input_gets_a_clear_error(engine, call, match):
    prompts = call.pop("prompts")
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, **call)


@pytest.mark.parametrize("call, match", [
    (dict(prompts=[[1, "x", 2]]), r"prompts\[0\]\[1\] is 'x' \(str\)"),
    (dict(prompts=[[1, 2], [3.0, 2.5]]), r"prompts\[1\]\[0\] is 3.0 \(float\)"),
    (dict(prompts=[3.0, 2.0]), r"prompts\[0\]\[0\] is 3.0"),  # one prompt, no list around it
    (dict(prompts=[[1, True]]), r"prompts\[0\]\[1\] is True \(bool\)"),
    (dict(prompts=[np.array([1.0, 2.0])]), r"prompts\[0\] must be integer ids.*float64"),
    (dict(prompts=["ab", 7]), r"prompts\[1\] must be a list of int ids, got int"),
    (dict(prompts=[[1, 2]], request_ids=[2.0]), r"request_ids\[0\] is 2.0 \(float\)"),
    (dict(prompts=[[1, 2]], request_ids=["a"]), r"request_ids\[0\] is 'a'"),
    (dict(prompts=[[1, 2]], request_ids=np.array([0.5])), r"request_ids must be integer ids"),
])
def test_non_integer_ids_are_one_type_error_before_any_work(engine, monkeypatch, call, match):
    """Issue 35: float ids were taken silently (int(3.0)), strings named no argument."""
    def never(*a, **k):
        raise AssertionError("work started before the ids were checked")
    monkeypatch.setattr(DeviceLoop, "_prefill_target", never)  # the prefill every call runs first
    prompts = call.pop("prompts")
    with pytest.raises(TypeError, match=match):
        engine.generate(prompts, mode="ar", max_new_tokens=2, **call)


def test_integer_arrays_are_ids(engine):
    want = engine.generate([[1, 2, 3]], mode="ar", max_new_tokens=3).token_ids
    for p in (np.array([1, 2, 3], np.int64), jax.numpy.array([1, 2, 3]), [np.int32(1), 2, 3],
              np.array([[1, 2, 3]])):
        assert engine.generate(p, mode="ar", max_new_tokens=3,
                               request_ids=np.array([0])).token_ids == want


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_invalid_sampling_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_no_round_can_write_past_the_cache(engine, monkeypatch):
    """Issue 35: a KV write past the cache is dropped in silence on the jit path, so the engine
    proves at call start that none can happen (`request.check_room`). Forced here by shrinking the
    cache the call gets: at the bound (every slot a round can write, no more) the call runs, every
    verify writes inside the cache and the tokens are the roomy call's; one slot less is a
    CacheOverflowError before any work."""
    import ssd_jax.runtime.request as request_module
    from ssd_jax.models.kv_cache import CacheOverflowError

    call = dict(mode="sd", max_new_tokens=12, k=3)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want = engine.generate(prompts, **call).token_ids
    room = 5 + 12 - 2 + 3 + 1  # slots 0 .. P + N - 2 + K
    real_verify, ends = steps.verify, []

    def recording(params, cfg, cache, bonus, spec, *a, **kw):
        ends.append((int(np.max(np.asarray(cache.lengths))) + spec.shape[1] + 1, cache.max_len))
        return real_verify(params, cfg, cache, bonus, spec, *a, **kw)

    monkeypatch.setattr(steps, "verify", recording)
    monkeypatch.setattr(request_module, "_bucket", lambda n, q: room)
    assert engine.generate(prompts, **call).token_ids == want
    assert ends and all(end <= size == room for end, size in ends), ends
    monkeypatch.setattr(request_module, "_bucket", lambda n, q: room - 1)
    monkeypatch.setattr(DeviceLoop, "_prefill_target", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(CacheOverflowError, match=f"slot {room - 1} of a KV cache of {room - 1}"):
        engine.generate(prompts, **call)


def test_max_len_has_a_bound(models):
    with pytest.raises(ValueError, match="MAX_LEN=131072"):
        Engine(models[0], None, max_len=2 ** 18, compilation_cache=False)


def test_ar_needs_no_draft_and_sd_needs_one(models):
    eng = Engine(models[0], None, compilation_cache=False)
    assert eng.generate(["ab"], mode="ar", max_new_tokens=2).token_ids[0]
    with pytest.raises(ValueError, match="needs a draft"):
        eng.generate(["ab"], mode="sd")


def test_draft_with_another_tokenizer_is_refused(models):
    other = CharTokenizer()
    other.alphabet = CharTokenizer.alphabet[::-1]
    with pytest.raises(ValueError, match="different tokenizers"):
        Engine(models[0], Model(CFG, models[1].params, other), compilation_cache=False)


def test_unknown_architecture_and_bad_config():
    with pytest.raises(ValueError, match="unknown architecture"):
        tiny_config("gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config("qwen2", num_heads=4, num_kv_heads=3)
