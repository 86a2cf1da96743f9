"""A model shaped like a released one: more embedding rows than its tokenizer has ids.

Qwen2.5's 151,936 rows hold 151,665 ids; the engine carries the difference (`vocab_size` ids,
`row_vocab` rows) through every proposal row it builds, and a rule that leaks mass into the rows
past the ids shows only on such a model. `pad_vocabulary` turns a built-in `Model` whose rows are
exactly its ids into one with `rows` rows: the ids' embeddings, head columns and so their logits
unchanged (so its distribution over the ids, with the padded rows masked as the engine masks
them, is the original model's), the padded rows' logits large, not -inf: each padded pair of
head columns is +s r and -s r for one random direction r, so in every context one of the two
scores s |h . r| and most contexts' largest logit is a padded row's (`padded_mass` measures it).
A decoder that forgets the mask is then far off, not slightly. `id_tokenizer` gives the ids a
tokenizer (the engine reads the id count from the target's tokenizer).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

__all__ = ["id_tokenizer", "pad_vocabulary", "padded_mass"]


def id_tokenizer(vocab_size: int):
    """A `Tokenizer` of `vocab_size` ids (word-level, token i is "t{i}"), no BOS or EOS."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from ssd_jax.models.tokenizer import Tokenizer
    if int(vocab_size) < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    hf = tokenizers.Tokenizer(models.WordLevel({f"t{i}": i for i in range(int(vocab_size))},
                                               unk_token="t0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(hf)


def pad_vocabulary(model, rows: int, *, scale: float = 4.0, seed: int = 0):
    """`model` (a built-in `Model` of V = cfg.vocab_size rows) with `rows` > V embedding rows, its
    V ids given `id_tokenizer(V)` unless it has a tokenizer of V ids already. The padded head
    columns come in pairs (+s r, -s r) with r ~ N(0, I) and s = `scale` times the largest norm of
    an id's column (an odd count's last column is +s r alone). Untied, the padded embedding rows
    (never fed: no id reaches them) are copies of row 0; tied, they are those columns."""
    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.model import Model
    cfg, params = model.cfg, model.params
    if not isinstance(cfg, ModelConfig):
        raise TypeError("pad_vocabulary takes a built-in Model (ModelConfig + Params)")
    V = cfg.vocab_size
    if int(rows) <= V:
        raise ValueError(f"rows must exceed the model's {V} rows, got {rows}")
    tok = model.tokenizer
    if tok is not None and tok.vocab_size != V:
        raise ValueError(f"the model's tokenizer has {tok.vocab_size} ids for {V} rows: pad a "
                         "model whose rows are its ids")
    extra = int(rows) - V
    head = params.embed.T if params.lm_head is None else params.lm_head  # [E, V]
    head32 = np.asarray(head, np.float32)
    s = float(scale) * float(np.linalg.norm(head32, axis=0).max())
    r = np.random.default_rng(seed).standard_normal((head32.shape[0], (extra + 1) // 2))
    r *= s / np.linalg.norm(r, axis=0)
    cols = np.stack([r, -r], axis=2).reshape(head32.shape[0], -1)[:, :extra]
    new_head = jnp.concatenate([head, jnp.asarray(cols, head.dtype)], axis=1)
    if params.lm_head is None:  # tied: the head's columns are the embedding's rows
        padded = dataclasses.replace(params, embed=new_head.T)
    else:
        embed = jnp.concatenate([params.embed, jnp.repeat(params.embed[:1], extra, axis=0)], 0)
        padded = dataclasses.replace(params, embed=embed, lm_head=new_head)
    return Model(dataclasses.replace(cfg, vocab_size=int(rows)), padded,
                 tok if tok is not None else id_tokenizer(V), model.name)


def padded_mass(logits, vocab_size: int) -> np.ndarray:
    """The softmax mass [...] the rows past `vocab_size` of logits [..., rows] would take unmasked
    (what a decoder that forgot the mask would put there)."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p[..., int(vocab_size):].sum(-1)
