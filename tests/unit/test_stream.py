"""`Engine.stream`: text deltas that never split a UTF-8 character, with ids and log-probs, on a
hand-made byte-level tokenizer (one token per byte, so every multi-byte character is split across
tokens) and on the Qwen tokenizer of the default pair (which splits e.g. 🫠 into three tokens);
the oracle is `tokenizers`' own decode. Then end to end through the engine in every mode: the
deltas join to `generate`'s texts, ids and log-probs, and closing a stream early ends its call."""
import threading

import jax
import numpy as np
import pytest

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models import registry
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.models.tokenizer import Tokenizer
from ssd_jax.runtime.config import SSDConfig
from ssd_jax.runtime.engine import Engine
from ssd_jax.runtime.stream import StreamDelta, TextDecoder

from _byte_tokenizer import byte_tokenizer

EMOJI = "a😀b中c"  # 1 + 4 + 1 + 3 + 1 bytes


def stream_ids(tok, ids, chunks=1, stop=(), reason="length"):
    """Push `ids` `chunks` at a time -> the deltas' texts (the finish text last)."""
    dec = TextDecoder(tok, stop)
    out = [dec.push(ids[i:i + chunks]) for i in range(0, len(ids), chunks)]
    return out + [dec.finish(reason)]


def test_the_last_ids_are_decoded_with_the_finish():
    tok = byte_tokenizer()
    dec = TextDecoder(tok)
    assert dec.push([ord("a"), 0xE4]) == "a"
    assert dec.finish("length", [0xB8, 0xAD]) == "中"


def assert_never_splits(tok, ids, texts, chunks=1):
    """After each delta (of `chunks` ids), the text so far is tok.decode(ids so far) but for at
    most one trailing U+FFFD (an incomplete character), and at the end all of tok.decode(ids)."""
    so_far = ""
    for n, t in enumerate(texts[:-1], start=1):
        so_far += t
        whole = tok.decode(ids[:n * chunks])
        assert whole.startswith(so_far), (n, so_far, whole)
        assert whole[len(so_far):] in ("", "\ufffd"), (n, so_far, whole)
    assert so_far + texts[-1] == tok.decode(ids)


def test_a_split_character_is_held_back_until_complete():
    tok = byte_tokenizer()
    ids = list(EMOJI.encode())
    texts = stream_ids(tok, ids)
    assert texts == ["a", "", "", "", "😀", "b", "", "", "中", "c", ""]
    assert_never_splits(tok, ids, texts)
    # the character completes in the middle of a chunk
    assert stream_ids(tok, ids, chunks=3) == ["a", "😀b", "中", "c", ""]


def test_invalid_and_unfinished_bytes_decode_as_tokenizers_does():
    tok = byte_tokenizer()
    for ids in ([0x80, ord("x")],  # a lone continuation byte: U+FFFD at once
                [ord("x"), 0xF0, 0x9F],  # a character cut off at the end
                [0xE4, ord("x"), 0xB8, 0xAD],  # an interrupted character
                [256, 257, 258, 0xE4, 0xB8, 0xAD, 257]):  # a merge, EOS (skipped), "<tool>"
        assert_never_splits(tok, ids, stream_ids(tok, ids))
    rng = np.random.default_rng(0)
    for _ in range(200):  # random bytes: mostly invalid UTF-8, some valid multi-byte
        ids = [int(i) for i in rng.integers(0, 259, size=int(rng.integers(1, 12)))]
        c = int(rng.integers(1, 4))
        assert_never_splits(tok, ids, stream_ids(tok, ids, chunks=c), chunks=c)


def test_stop_strings_are_held_back_and_cut():
    tok = byte_tokenizer()
    dec = TextDecoder(tok, ["STOP", "ST!"])
    texts = [dec.push([i]) for i in b"xyST"]
    texts.append(dec.finish("stop", b"OP"))  # the row's last commit met the stop string
    assert texts == ["", "", "", "x", "y"]  # the last len("STOP") - 1 characters wait
    dec = TextDecoder(tok, ["STOP"])
    assert [dec.push([i]) for i in b"abcSTO"] == ["", "", "", "a", "b", "c"]
    assert dec.finish("length", b"x") == "STOx"  # no stop met: the held text comes out


def test_the_qwen_tokenizer_splits_emoji_and_streams_them_whole():
    tok = Tokenizer.from_gguf(registry.fetch(registry.DEFAULT_DRAFT, progress=False))
    text = "Hi 🫠 there 🫠🤖 and 𠀀 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some token ends mid-character
    texts = stream_ids(tok, ids)
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == text
    assert_never_splits(tok, ids, texts)
    rng = np.random.default_rng(1)
    specials = list(tok.eos_ids)
    for _ in range(50):  # random ids, specials among them: byte-exact with tokenizers' decode
        ids = [int(i) for i in rng.integers(0, tok.vocab_size, size=20)] + specials
        rng.shuffle(ids)
        c = int(rng.integers(1, 5))
        assert_never_splits(tok, ids, stream_ids(tok, ids, chunks=c), chunks=c)


# ------------------------------------------------------------------------------- through the engine
CFG = tiny_config("qwen2", vocab_size=259)


@pytest.fixture(scope="module")
def engine():
    tok = byte_tokenizer()
    target = Model(CFG, random_params(CFG, 0, scale=1.0), tok)
    draft = Model(CFG, perturb(target.params, jax.random.key(2), 0.05), tok)
    return Engine(target, draft, compilation_cache=False)


KW = dict(max_new_tokens=16, k=3, ssd=SSDConfig(fanout=(2, 2, 1, 1)),
          sampling=SamplingParams(temperature=1.0), seed=3)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_stream_joins_to_generate(engine, mode):
    prompts = ["ab 中", "x"]
    want = engine.generate(prompts, mode=mode, **KW)
    s = engine.stream(prompts, mode=mode, **KW)
    deltas = list(s)
    assert all(isinstance(d, StreamDelta) for d in deltas)
    tok = engine.target.tokenizer
    for row in range(2):
        mine = [d for d in deltas if d.row == row]
        ids = [i for d in mine for i in d.token_ids]
        assert ids == want.token_ids[row]
        np.testing.assert_allclose([x for d in mine for x in d.logprobs], want.logprobs[row],
                                   rtol=1e-6)
        assert "".join(d.text for d in mine) == want.texts[row]
        assert [d.finish_reason for d in mine][-1] == want.finish_reasons[row]
        assert all(d.finish_reason is None for d in mine[:-1])
        # per delta: the text so far never ends inside a character
        texts = [d.text for d in mine]
        counts = np.cumsum([len(d.token_ids) for d in mine])
        so_far = ""
        for n, t in zip(counts[:-1], texts[:-1]):
            so_far += t
            whole = tok.decode(ids[:n])
            assert whole.startswith(so_far) and whole[len(so_far):] in ("", "\ufffd")
    assert s.result.token_ids == want.token_ids and s.result.metrics.mode == mode


def test_stream_with_stop_and_eos(engine):
    kw = dict(KW, max_new_tokens=24)
    want = engine.generate(["ab", "c"], mode="sd", **kw)
    stop = [want.texts[0][2:4]] if len(want.texts[0]) >= 4 else ["\x00"]
    want = engine.generate(["ab", "c"], mode="sd", stop=stop, **kw)
    deltas = list(engine.stream(["ab", "c"], mode="sd", stop=stop, **kw))
    for row in range(2):
        assert "".join(d.text for d in deltas if d.row == row) == want.texts[row]
        assert [d.finish_reason for d in deltas if d.row == row][-1] == want.finish_reasons[row]
    assert want.finish_reasons[0] == "stop" or stop == ["\x00"]


def test_closing_a_stream_ends_its_call(engine):
    want = engine.generate(["ab"], mode="ssd", **KW)
    with engine.stream(["ab"], mode="ssd", **KW) as s:
        first = next(iter(s))
    assert first.row == 0 and len(first.token_ids) == 1  # the prefill's token
    assert not [t for t in threading.enumerate() if t.name == "ssd_jax-stream"]
    # a stream left unfinished is ended by the next call on the engine, which is unaffected
    s = engine.stream(["ab"], mode="ssd", **KW)
    next(s)
    again = engine.generate(["ab"], mode="ssd", **KW)
    assert again.token_ids == want.token_ids
    assert not [t for t in threading.enumerate() if t.name == "ssd_jax-stream"]


def test_stream_argument_errors(engine):
    with pytest.raises(TypeError, match="max_new_tokenz"):
        engine.stream(["ab"], max_new_tokenz=3)
    with pytest.raises(ValueError, match="on_tokens"):
        engine.stream(["ab"], on_tokens=print)
    s = engine.stream(["ab"], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(s)
    # token-id prompts of a model without a tokenizer: ids and log-probs, no text
    bare = Engine(Model(CFG, engine.target.params, None), compilation_cache=False)
    deltas = list(bare.stream([[1, 2, 3]], mode="ar", max_new_tokens=4))
    assert sum(len(d.token_ids) for d in deltas) == 4 and all(d.text == "" for d in deltas)
