"""The proposer interface: anything that drafts K tokens *and says what it sampled them from*.

Speculative decoding is exact for any proposal distribution as long as each drafted token really
was drawn from the proposal rows handed to the verifier (ALGORITHM.md §3). The draft model
(`ssd_jax.runtime.draft_worker.DraftWorker`) is one proposer; `PromptLookupProposer` below is another, and
a user's own drafter plugs into `Engine(target, proposer=...)` the same way:

    class MyProposer:
        def start(self, prompt_tokens, prompt_lens, cache_len): ...      # once per generate call
        def ready(self): ...     # optional: block until start's work (e.g. a prefill) is done
        def propose(self, state: RoundState, run: CallConfig):
            return tokens [B, K] int32, rows [B, K, V] (the distributions tokens were drawn from)
        def finish(self): ...

`state` holds device arrays: each row's bonus token, its position n, the previous token and
whether it is active (`[B]` each), and its history `[B, H]` int32, the row's tokens by position
(prompt and generated ones at 0..n; past n, nothing to read). `run` is the call's
`ssd_jax.runtime.config.CallConfig`: its seed, request ids, K and `draft_sampling`. The call's
rounds run on the device loop (`ssd_jax.runtime.device_loop`): `propose` is dispatched with the
previous round still in flight, so it should return arrays without waiting for them (jitted code
does).
Only SD uses a proposer; SSD needs the draft model's tree (glue, fork, branch decode).

`start` may return with work still in flight (the draft prefill overlaps the target's on separate
meshes); the engine calls `ready()`, where a proposer has one, before it stops the prefill clock, so
that the draft's prefill is not billed to the first round's drafting.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax.numpy as jnp

from ssd_jax.algorithm import backups


@runtime_checkable
class Proposer(Protocol):
    """What `Engine(target, proposer=...)` needs of an SD drafter (see the module docstring).
    `ready()` is optional and so not part of the protocol's runtime check."""

    def start(self, prompt_tokens, prompt_lens, cache_len: int) -> None:
        """Once per generate call: prompt_tokens `[B, T]` int32 (right-padded), prompt_lens `[B]`,
        cache_len S (the KV slots per sequence). May return with work in flight."""
        ...

    def propose(self, state, run):
        """K tokens per row from `state` (a `ssd_jax.runtime.draft_worker.RoundState` of device
        arrays, history `[B, H]`) and `run` (the call's `CallConfig`: seed, request ids, K,
        draft_sampling) -> (tokens `[B, K]` int32, rows `[B, K, V]`: the distributions the tokens were drawn
        from, V = the target's vocabulary rows)."""
        ...

    def finish(self) -> None:
        """Once at the end of a generate call."""
        ...


def check_rows(rows, batch: int, k: int, vocab: int) -> None:
    """A ValueError unless a proposal's rows are `[B, K, V]` (V: the target's rows), what the
    verifier needs."""
    if tuple(rows.shape) != (batch, k, vocab):
        raise ValueError(f"proposer returned rows of shape {tuple(rows.shape)}; the verifier "
                         f"needs [B, K, V] = {(batch, k, vocab)}")


class PromptLookupProposer:
    """Model-free drafting by prompt lookup (n-gram match in the sequence's own history), with
    one-hot rows; uniform random tokens (with uniform rows) where nothing matches.

    vocab_size: the tokenizer's size (random tokens come from [0, vocab_size)); row_vocab: V, the
    rows' length (the target's embedding rows; default vocab_size); ngram: the longest suffix
    matched (`ssd_jax.algorithm.backups.ngram_guess`).
    """

    def __init__(self, vocab_size: int, row_vocab: int | None = None, ngram: int = 2):
        self.vocab_size = int(vocab_size)
        self.row_vocab = int(row_vocab or vocab_size)
        self.ngram = int(ngram)

    def start(self, prompt_tokens, prompt_lens, cache_len):
        """Nothing to prepare: the proposer keeps no state."""

    def ready(self):
        """Nothing in flight."""

    def propose(self, state, run):
        """tokens `[B, K]` int32, rows `[B, K, V]` float32 (V = row_vocab) by
        `ssd_jax.algorithm.backups.ngram_speculation_on_device` over `state.history` (`[B, H]`
        by position), keyed by `run`'s seed and request ids."""
        return backups.ngram_speculation_on_device(
            state.history, jnp.int32(run.seed), jnp.asarray(run.request_ids, jnp.int32),
            jnp.asarray(state.n), k=run.k, vocab_size=self.vocab_size, row_vocab=self.row_vocab,
            ngram=self.ngram)

    def finish(self):
        """Nothing to release."""
