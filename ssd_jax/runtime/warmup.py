"""What a generate call will run, from the request alone: its first round's programs readied
before the call.

In the two-process layout the draft process loads in half the target's time and then idles, and
a call's first round used to wait while the draft traced and loaded its chain and tree, and the
target its verify (seconds, with every cache warm). `call_plan` computes, from the target's
tokenizer and config (no weights), the shapes and statics of the call: the prompt block both
sides prefill, the cache length and the call's `CallConfig` (samplings, K, fan-out, backup).
`DraftWorker.warm_up` and `Engine.warm_up` run a throwaway first round of exactly those, the
draft's in its own process while the target loads (`RemoteDraft.warm`), so the call's rounds
find every program compiled or loaded.

    plan = call_plan(tokenizer, target_cfg, prompts=["def fib(n):"], mode="ssd", k=4)
    remote.warm(plan)            # returns at once; the draft process warms up meanwhile
    engine = Engine(load_model(...), remote_draft=remote)  # the slow part, in this process
    engine.warm_up(plan)         # the target's verify and prefill
    remote.warmed()              # {"seconds", "waited_s", "programs", "error"}
    engine.generate(prompts=["def fib(n):"], mode="ssd", k=4)

The request goes through the checks and steps `Engine.generate` runs (`check_request`,
`chat_prompts`, `encode`, `cache_length`, `call_config`: the fan-out and budget), so a bad request
raises here the ValueError the call would raise, before anything starts.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.runtime.chat import chat_prompts
from ssd_jax.runtime.config import CallConfig, SSDConfig, call_config, check_request
from ssd_jax.runtime.request import cache_length, encode, padded_rows, right_padded


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One SD or SSD generate call's shapes and statics, as its first round meets them."""
    mode: str  # "sd" | "ssd"
    tokens: np.ndarray  # [B, T] int32: the prompts right-padded to the prefill bucket
    lens: np.ndarray  # [B] int32: the prompts' lengths
    cache_len: int  # the KV cache's slots S
    row_vocab: int  # V: the target's embedding rows, the width of the draft's proposal rows
    call: CallConfig  # the call's settings (K, samplings, seed, fan-out, backup, row dtype)
    max_new_tokens: int = 64  # the budget and the ids that end a row: the shapes of the call's
    eos_ids: tuple[int, ...] = ()  # state (`decode_state.initial_state`), the target's side

    def prompts(self) -> list[list[int]]:
        """The prompts as B lists of token ids (`tokens` without their padding)."""
        return [[int(t) for t in row[:n]] for row, n in zip(self.tokens, self.lens)]


def call_plan(tokenizer, target_cfg, *, max_len: int = 4096, prompts=None, messages=None,
               mode: str = "ssd", max_new_tokens: int = 64,
               sampling: SamplingParams = SamplingParams(), draft_sampling=None, k: int = 4,
               ssd: SSDConfig = SSDConfig(), seed: int = 0, stop=(), chat: bool = False,
               eos_ids=None, request_ids=None,
               batch_buckets: bool | None = None) -> CallPlan | None:
    """The `CallPlan` of `Engine(target, max_len=max_len,
    batch_buckets=batch_buckets).generate(**request)` for a target with this tokenizer (None:
    prompts are token ids) and `ModelConfig`: its rows padded to the batch bucket as the call
    pads them (batch_buckets None: as an engine on JAX's default backend, not on a CPU); None
    where the call asks nothing of a draft model (mode "ar") or its fan-out is planned from the
    engine's own measurements (`fanout="plan"`). ValueError / TypeError for a request the call
    would refuse."""
    vocab = tokenizer.vocab_size if tokenizer is not None else target_cfg.vocab_size
    prompts, chat = chat_prompts(tokenizer, prompts, messages, chat)
    check_request(mode, max_new_tokens, k, sampling, draft_sampling, ssd, vocab, seed=seed,
                  stop=stop, eos_ids=eos_ids, chat=chat, request_ids=request_ids)
    if mode == "ar" or (mode == "ssd" and ssd.fanout == "plan"):
        return None
    ids = encode(prompts, tokenizer, vocab, chat)
    rids = np.asarray(request_ids if request_ids is not None else range(len(ids)), np.int32)
    if batch_buckets is None:
        import jax
        batch_buckets = jax.default_backend() != "cpu"
    ids, rids, sampling, draft_sampling, _ = padded_rows(ids, rids, sampling, draft_sampling,
                                                         batch_buckets)
    lens = np.fromiter(map(len, ids), np.int32, len(ids))
    cache_len = cache_length(lens, max_new_tokens, k, max_len, target_cfg.max_position_embeddings)
    call = call_config(mode, k, seed, rids, sampling, draft_sampling, ssd, vocab,
                       target_cfg.vocab_size)
    if eos_ids is None:  # the engine's own (`Engine.eos_ids`)
        eos_ids = tokenizer.eos_ids if tokenizer is not None else ()
    return CallPlan(mode, right_padded(ids), lens, int(cache_len), int(target_cfg.vocab_size),
                    call, int(max_new_tokens), tuple(int(e) for e in eos_ids))
