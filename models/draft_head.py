"""A draft head cut to the first n token ids (in the spirit of FR-Spec, Zhao et al. 2025).

Why: the head is the largest weight of a small draft. The 0.5B Qwen draft's tied head
[896, 151,936] is 27% of an int8 draft step's bytes, and a CPU decode step's time is its bytes.
Byte-level BPE vocabularies number their tokens in merge order, so low ids are the frequent ones:
cut to 65,536 ids, the head reads 57% fewer bytes and the draft proposes the same token nearly
always (tokens per round fell 1.7% on the benchmark prompts).

Exactness: the cut head scores ids >= n as -inf, so the draft's proposal rows give them
probability 0 and its tokens are drawn from those rows. Rejection sampling is exact for any
proposal (ALGORITHM.md §3), so the output stays the target's distribution; a token the draft cannot
propose still comes out of the residual `(p - q)+` when the target wants it. Only acceptance can
change. Cutting a *target's* head would change the distribution itself: `Engine` refuses one.

`ssd_jax.models.transformer` pads the narrow head's logits back to `cfg.vocab_size` with -inf, so every
caller still sees `[..., V]` rows.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import jax

from ssd_jax.models.params import Params
from ssd_jax.models.quant import quantize_model
from ssd_jax.models.weights import Int8Weight


def head_width(params: Params) -> int:
    """How many token ids the head scores: its columns (the embedding's rows when tied)."""
    head = params.lm_head
    if head is None:
        return int(params.embed.shape[0])
    if isinstance(head, Int8Weight):
        return int(head.scale.shape[0])
    return int(head.shape[-1])


def truncate_head(params: Params, n: int) -> Params:
    """Params whose head scores only token ids [0, n): lm_head [hidden, n] in the head's own
    logical form (a bf16/fp32 array, or Int8Weight). A tied model gets its own head; the embedding
    stays whole for the token lookup, so any id can still be fed back (a target's bonus token,
    say). Cut the logical head, before any backend's `prepare` lays it out."""
    if not isinstance(params, Params):
        raise TypeError(f"truncate_head takes ssd_jax.models.params.Params, got {type(params).__name__}")
    rows = int(params.embed.shape[0])
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= rows:
        raise ValueError(f"the draft head's vocabulary must be an int in [1, {rows}] (the "
                         f"embedding rows), got {n!r}")
    if n > head_width(params):
        raise ValueError(f"the head already scores only {head_width(params)} ids; it cannot be "
                         f"widened to {n}")
    head = params.lm_head
    if head is None:
        head = jnp.asarray(params.embed)[:n].T.copy()
    elif isinstance(head, Int8Weight):
        head = Int8Weight(q=head.q[:, :n], scale=head.scale[:n])
    elif isinstance(head, jax.Array) or hasattr(head, "__array__"):
        head = head[:, :n]
    else:
        raise TypeError(f"the head is a backend's layout ({type(head).__name__}), not a logical "
                        f"weight: cut the head before the backend's `prepare`")
    return params.replace(lm_head=head)


def truncate_model_head(model, n: int):
    """A ssd_jax.models.model.Model whose head is cut to ids [0, n) (`truncate_head`); the name gains
    "+head<n>". A model whose head already scores exactly n ids comes back as it is."""
    if head_width(model.params) == n:
        return model
    return dataclasses.replace(model, params=truncate_head(model.params, n),
                               name=f"{model.name}+head{n}" if model.name else f"head{n}")


def prepare_draft(model, quant: str = "none", head_vocab: int | None = None):
    """The draft as a run asks for it: head cut to `head_vocab` ids (None: whole), then weights
    quantized (`ssd_jax.models.quant.quantize_model`; cutting first quantizes only the kept columns)."""
    if head_vocab is not None:
        model = truncate_model_head(model, head_vocab)
    return quantize_model(model, quant)


__all__ = ["head_width", "prepare_draft", "truncate_head", "truncate_model_head"]
