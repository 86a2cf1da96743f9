"""`ssd_jax.runtime.request`: what a generate call settles on the host before any device work
(through the Engine, tests/unit/test_generate.py checks the same errors reach a caller)."""
import numpy as np
import pytest

from ssd_jax.models.kv_cache import CacheOverflowError
from ssd_jax.models.config import tiny_config
from ssd_jax.runtime.batch import Batch
from ssd_jax.runtime.request import (cache_length, check_room, encode, one_prompt, prefill_bucket,
                                     prefill_once, right_padded)


def test_calls_whose_needs_round_alike_share_one_cache_length():
    # need = longest prompt + max_new_tokens + K + 2
    assert cache_length([3, 10], 100, 4, 4096, 32768) == 256          # need 116
    assert cache_length([150], 100, 4, 4096, 32768) == 256            # need 256, exactly one quantum
    assert cache_length([151], 100, 4, 4096, 32768) == 512            # need 257
    assert cache_length([151], 100, 4, 300, 32768) == 300             # capped at the engine's max_len
    with pytest.raises(ValueError, match="= 301 exceeds the cache length max_len=300"):
        cache_length([195], 100, 4, 300, 32768)
    with pytest.raises(ValueError, match="257 positions exceed the target's max_position_embeddings"):
        cache_length([151], 100, 4, 4096, 256)


def test_the_room_check_bounds_the_last_slot_a_round_writes():
    check_room([5, 2], 12, 3, 5 + 12 - 2 + 3 + 1)  # the last slot written is P + N - 2 + K
    with pytest.raises(CacheOverflowError, match="slot 18 of a KV cache of 18"):
        check_room([5, 2], 12, 3, 18)


def test_batches_pad_to_a_power_of_two_then_to_multiples_of_8():
    from ssd_jax.runtime.request import batch_bucket
    sizes = {n: batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 2500)}
    assert sizes == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 2500: 2504}


def test_prompts_pad_to_a_power_of_two_from_16():
    assert [prefill_bucket(n) for n in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]
    rows = [[4, 5, 6], list(range(1, 18))]
    toks = right_padded(rows)
    assert toks.shape == (2, 32) and toks.dtype == np.int32
    assert toks[0, :3].tolist() == [4, 5, 6] and not toks[0, 3:].any()
    assert toks[1, :17].tolist() == rows[1] and not toks[1, 17:].any()
    assert right_padded(rows, cap=20).shape == (2, 20)
    with pytest.raises(ValueError, match="a row of 17 tokens is past the block's 16 columns"):
        right_padded(rows, cap=16)


class _Tok:
    def encode(self, text):
        return [ord(c) % 30 for c in text]

    def apply_chat_template(self, messages):
        return "<" + messages[0]["content"] + ">"


def test_encode_takes_one_prompt_or_a_list_as_text_or_ids():
    tok = _Tok()
    a, b, c = (ord(x) % 30 for x in "abc")
    assert encode("ab", tok, 30, chat=False) == [[a, b]]
    assert encode(["ab", "c"], tok, 30, chat=False) == [[a, b], [c]]
    assert encode([3, 4], None, 30, chat=False) == [[3, 4]]
    assert encode(np.array([3, 4]), None, 30, chat=False) == [[3, 4]]
    assert encode([[3], [4, 5]], None, 30, chat=False) == [[3], [4, 5]]
    assert encode("b", tok, 30, chat=True) == [[ord("<") % 30, b, ord(">") % 30]]
    for bad, err in ((["ab"], "need a tokenizer"), ([], "no prompts"), ([[]], "empty prompt"),
                     ([[1, 30]], r"out of range \[0, 30\)"), ([[-1]], "out of range")):
        with pytest.raises(ValueError, match=err):
            encode(bad, None, 30, chat=False)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        encode([[1], [2.5]], None, 30, chat=False)


def test_a_large_batch_of_id_lists_is_checked_in_one_pass_with_the_same_errors():
    """Thousands of plain int lists take `encode`'s one-pass check; anything else in any row (a
    bool, a float, a numpy integer, an empty row, an id out of range) takes the one-by-one path,
    which names it; and the rows a caller passed are never changed by the call's batch."""
    rows = [[1, 2, 3]] * 2999 + [[4, 5]]
    out = encode(rows, None, 30, chat=False)
    assert out == rows and all(type(t) is int for r in out for t in r)
    for bad, exc, err in (([True], TypeError, r"prompts\[2999\]\[0\]"),
                          ([4, 2.0], TypeError, r"prompts\[2999\]\[1\]"),
                          ([], ValueError, "empty prompt"),
                          ([4, 30], ValueError, r"out of range \[0, 30\)")):
        with pytest.raises(exc, match=err):
            encode(rows[:-1] + [bad], None, 30, chat=False)
    mixed = encode(rows[:-1] + [[np.int64(4), 5]], None, 30, chat=False)
    assert mixed[-1] == [4, 5] and type(mixed[-1][0]) is int
    caller = [[1, 2, 3], [4, 5]]
    batch = Batch(encode(caller, None, 30, chat=False), 4, eos_ids=[])
    batch.emit(0, [7], [0.0])
    assert caller == [[1, 2, 3], [4, 5]] and batch.history[0] == [1, 2, 3, 7]
    # the device loop sets each row's tokens at the call's end and drops the history, which is
    # then made again from the prompts (a draft's failure reads it to re-prefill the target)
    batch.generated, batch.history = [[7, 8], [9]], None
    assert batch.history == [[1, 2, 3, 7, 8], [4, 5, 9]] and caller == [[1, 2, 3], [4, 5]]
    assert Batch(caller, 4, eos_ids=[]).logprobs == [[], []]


def test_one_prompt_is_a_batch_of_one_prompt_repeated():
    block = right_padded([[4, 5, 6]] * 3)
    assert one_prompt(block, [3, 3, 3])
    assert not one_prompt(block[:1], [3])                    # one row: nothing to share
    assert not one_prompt(right_padded([[4, 5, 6], [4, 5, 7]]), [3, 3])
    assert not one_prompt(right_padded([[4, 5, 6], [4, 5]]), [3, 2])
    assert not one_prompt(block, [3, 3, 2])                  # same ids, another length


def test_only_the_builtin_transformer_on_one_device_prefills_once():
    block, lens, cfg = right_padded([[4, 5, 6]] * 3), [3, 3, 3], tiny_config("qwen2")
    assert prefill_once(cfg, 1, block, lens)
    assert not prefill_once(cfg, 2, block, lens)           # a sharded cache: every row
    assert not prefill_once(object(), 1, block, lens)      # a model of one's own: every row
    assert not prefill_once(cfg, 1, block, [3, 3, 2])      # not one prompt
