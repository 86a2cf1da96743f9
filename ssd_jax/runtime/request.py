"""A generate call's request before any device work: prompts to token ids, the KV cache length the
call needs (refused at once if it cannot fit), the prompts as the prefill's padded block, and
whether that block is one prompt repeated (its prefill then runs once).

Everything here runs on the host and raises before a compile or a dispatch, so a bad request is
one clear error, never a slow failure or a silently cut prompt."""
from __future__ import annotations

import itertools

import numpy as np

from ssd_jax.models.protocol import is_builtin
from ssd_jax.runtime.config import int_ids, plain_ints

# Cache lengths come in multiples of this: calls whose needs round to one length share its compiles.
CACHE_QUANTUM = 256


def encode(prompts, tokenizer, vocab_size: int, chat: bool) -> list[list[int]]:
    """A call's prompts as token ids: one prompt (a string, or ids) or a list of them; strings go
    through `tokenizer` (its chat template first if `chat`). ValueError for no prompt, an empty
    one, text without a tokenizer or an id outside [0, vocab_size); TypeError for a non-integer
    id (naming its prompt and position)."""
    if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1 or (
            isinstance(prompts, (list, tuple)) and prompts and _scalar(prompts[0])):
        prompts = [prompts]  # one prompt: a string, or ids (any scalars: checked below)
    if prompts is None or len(prompts) == 0:
        raise ValueError("no prompts given")
    plain = _plain_id_lists(prompts, vocab_size)
    if plain is not None:
        return plain
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass token ids or load one")
            if chat:
                p = tokenizer.apply_chat_template([{"role": "user", "content": p}])
            ids = tokenizer.encode(p)
        else:  # a TypeError naming the prompt and position of a float, bool or string
            ids = int_ids(p, f"prompts[{len(out)}]")
        if not ids:
            raise ValueError("empty prompt: every prompt needs at least one token")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise ValueError(f"prompt token id out of range [0, {vocab_size})")
        out.append(ids)
    return out


def _plain_id_lists(prompts, vocab_size: int) -> list[list[int]] | None:
    """`prompts` as a list, when every one is a non-empty list of plain ints in [0, vocab_size):
    one check over all of them at C speed, where a batch of thousands of short prompts spent longer
    in the one-by-one checks than in its prefill. The rows are the caller's own lists (`Batch`
    never changes them: its history rows are copies). None otherwise: `encode`'s one-by-one path then names the problem."""
    if not isinstance(prompts, (list, tuple)) or set(map(type, prompts)) != {list} \
            or not all(prompts):
        return None
    flat = list(itertools.chain.from_iterable(prompts))
    if not plain_ints(flat) or min(flat) < 0 or max(flat) >= vocab_size:
        return None
    return list(prompts)


def cache_length(prompt_lens, max_new_tokens: int, k: int, max_len: int,
                 max_positions: int) -> int:
    """The KV cache length a call with these prompt lengths `[B]`, budget and lookahead runs in:
    its need (the longest prompt + max_new_tokens + K + 2) rounded up to CACHE_QUANTUM, at most
    the engine's `max_len`. ValueError if the need exceeds `max_len` or the target's
    `max_positions`; CacheOverflowError if a round could write past the cache (`check_room`)."""
    longest = int(np.max(prompt_lens))
    need = longest + int(max_new_tokens) + int(k) + 2
    if need > max_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + K + 2 "
                         f"= {need} exceeds the cache length max_len={max_len}: shorten the "
                         f"prompt or budget, or raise max_len")
    if need > max_positions:
        raise ValueError(f"{need} positions exceed the target's max_position_embeddings "
                         f"({max_positions})")
    cache_len = min(max_len, _bucket(need, CACHE_QUANTUM))
    check_room(prompt_lens, max_new_tokens, k, cache_len)
    return cache_len


def check_room(prompt_lens, max_new_tokens: int, k: int, cache_len: int) -> None:
    """Prove, before any work, that no round of this call writes past a KV cache of `cache_len`
    slots; a CacheOverflowError otherwise (never a write dropped in silence on the jit path).

    A row with P prompt tokens and g < max_new_tokens generated ones is active with n = P + g - 1
    tokens in the cache; its round writes slots n..n+K (verify: bonus + K drafts; SSD's glue pass
    the same on the draft; the chain n-1..n+K-1; plain decoding slot n). So the last slot any
    round writes is max(P) + max_new_tokens - 2 + K, for every mode and every outcome."""
    last = int(np.max(prompt_lens)) + int(max_new_tokens) - 2 + max(int(k), 0)
    if last >= cache_len:
        from ssd_jax.models.kv_cache import CacheOverflowError
        raise CacheOverflowError(f"a round could write slot {last} of a KV cache of {cache_len} "
                                 f"slots (prompt {int(np.max(prompt_lens))} + max_new_tokens "
                                 f"{max_new_tokens} + K {k}): refused before any work")


def batch_bucket(n: int) -> int:
    """The rows a batch of n requests runs in: 1, 2, 4, 8, then the next multiple of 8 (as
    vLLM's CUDA-graph batch sizes), so batches of 5-8 requests share one set of compiled steps,
    9-16 the next, ...; the rows past n are padding, finished before the call starts."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def padded_rows(ids: list, rids: np.ndarray, sampling, draft_sampling, bucket: bool):
    """A call's rows padded to `batch_bucket` (when `bucket`): (prompt ids [B'], request ids
    [B'], the target's and the draft's sampling as `[B']` SamplingParams, B, the real rows). A
    padding row repeats row 0 (its prompt, id and sampling: a batch of one prompt stays one, all
    greedy stays all greedy) and never runs: it starts finished (`Batch(rows=B)`)."""
    from ssd_jax.algorithm.sampling import SamplingParams
    n = len(ids)
    pad = (batch_bucket(n) if bucket else n) - n
    draft_sampling = sampling if draft_sampling is None else draft_sampling
    if not pad:  # a batch already of its bucket's size (or no buckets): nothing to copy
        return (ids, rids, SamplingParams.per_request(sampling, n),
                SamplingParams.per_request(draft_sampling, n), n)

    def padded(sp):
        sp = SamplingParams.per_request(sp, n)
        cols = (sp.temperature, sp.top_k, sp.top_p)
        return SamplingParams(*(np.concatenate([c, np.repeat(c[:1], pad)]) for c in cols))

    return (list(ids) + [ids[0]] * pad, np.concatenate([rids, np.repeat(rids[:1], pad)]),
            padded(sampling), padded(draft_sampling), n)


def prefill_bucket(n: int) -> int:
    """The prefill's width for a longest prompt of n tokens: the next power of two, at least 16
    (prompts of 1-16 tokens share one compiled prefill, 17-32 the next, ...)."""
    return max(16, 1 << (n - 1).bit_length())


def right_padded(rows, cap: int | None = None) -> np.ndarray:
    """Token rows right-padded with 0 to the prefill bucket of the longest (at most `cap`
    columns): `[B, T]` int32."""
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    longest = int(lens.max())
    T = prefill_bucket(longest)
    toks = np.zeros((len(rows), T if cap is None else min(T, cap)), np.int32)
    if longest > toks.shape[1]:
        raise ValueError(f"a row of {longest} tokens is past the block's {toks.shape[1]} columns")
    # every row's ids in one pass (row-major, as the mask below lists its cells)
    toks[np.arange(toks.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), np.int32, int(lens.sum()))
    return toks


def one_prompt(tokens: np.ndarray, lens) -> bool:
    """Whether a batch of B > 1 rows (prompt block `[B, T]`, lengths `[B]`) holds one prompt in
    every row: n samples of a prompt (pass@k, a distribution estimate). Its prefill then forwards
    the prompt once and copies its KV to the rows (`steps.prefill_shared`,
    `steps.prefill_cache_shared`). Only a batch that is all one prompt is shared: a partly
    repeated batch would need a program per count of distinct prompts."""
    tokens, lens = np.asarray(tokens), np.asarray(lens)
    return (tokens.shape[0] > 1 and bool((tokens == tokens[:1]).all())
            and bool((lens == lens[0]).all()))


def prefill_once(cfg, devices: int, tokens: np.ndarray, lens) -> bool:
    """Whether a side (target or draft) prefills this block once and copies it to the rows: the
    built-in transformer (a model of one's own defines its own cache pytree, whose leaves need
    not all be `[B, ...]`) on a one-device mesh (a sharded cache's rows are not copied across its
    devices), and `one_prompt`."""
    return devices == 1 and is_builtin(cfg) and one_prompt(tokens, lens)


def _bucket(n: int, quantum: int) -> int:
    """n rounded up to a multiple of quantum (at least one quantum)."""
    return max(quantum, -(-n // quantum) * quantum)


def _scalar(x) -> bool:
    """One value (an id, or what a caller passed as one: a float, a bool), not a prompt."""
    return isinstance(x, (int, float, complex, np.generic)) or getattr(x, "ndim", None) == 0
