"""Everything the draft does, on the draft mesh: prefill, SD drafting, the SSD tree, lookup, backups.

The engine talks to the draft only through these methods, with host values (token ids, outcome
integers) in and device arrays (speculation tokens and proposal rows) out — the same calls a
transport to another process or host carries.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.kv_cache import init_cache
from ssd_jax import backups, steps
from ssd_jax.batch import Batch
from ssd_jax.placement import to_mesh
from ssd_jax.speculation_cache import lookup
from ssd_jax.tree import draft_tree


class DraftWorker:
    def __init__(self, draft, sharding, row_vocab: int):
        self.model = draft
        self.cfg = draft.cfg
        self.sharding = sharding
        self.params = to_mesh(draft.params, sharding)
        self.row_vocab = int(row_vocab)  # the target's rows: proposals are padded/cut to match
        tok = draft.tokenizer
        self.vocab_size = tok.vocab_size if tok is not None else min(self.cfg.vocab_size, row_vocab)
        self.cache = None
        self._tree = None
        self._next = None
        self._gather_kernel = False

    def _put(self, x):
        return to_mesh(np.asarray(x), self.sharding)

    def _fit_rows(self, rows):
        V = rows.shape[-1]
        if V == self.row_vocab:
            return rows
        if V > self.row_vocab:
            return rows[..., : self.row_vocab]
        return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, self.row_vocab - V)])

    def start(self, prompt_tokens: np.ndarray, prompt_lens: np.ndarray, cache_len: int):
        B = prompt_tokens.shape[0]
        self.cache = init_cache(self.cfg, B, cache_len, sharding=self.sharding)
        self.cache = steps.prefill_cache(self.params, self.cfg, self.cache, self._put(prompt_tokens),
                                         self._put(prompt_lens))

    def propose(self, batch: Batch, rids, run, saguaro_top_n: tuple[int, ...] = (),
                saguaro_c: float = 1.0, row_dtype: str = "float32"):
        """K draft tokens from each row's bonus (SD drafting; also the neural backup)."""
        spec, rows, self.cache = steps.draft_chain(
            self.params, self.cfg, self.cache, self._put(batch.prev), self._put(batch.bonus),
            self._put(batch.n), run["seed"], self._put(rids), run["draft_sampling"],
            self.vocab_size, run["k"], saguaro_top_n, saguaro_c, row_dtype)
        return spec, self._fit_rows(rows)

    def backup(self, kind: str, batch: Batch, rids, run, fanout_backup):
        """A speculation from each row's real outcome (spec §5). Saguaro scales the top F^b_{i}+1
        tokens of draft token i+1: the candidates the fork after this backup round will cache."""
        ssd = run["ssd"]
        if kind == "neural":
            top_n = tuple(f + 1 for f in fanout_backup[:-1])
            return self.propose(batch, rids, run, top_n, ssd.saguaro_c, ssd.row_dtype)
        n = self._put(batch.n)
        if kind == "random":
            return backups.random_speculation(run["seed"], self._put(rids), n, k=run["k"],
                                              vocab_size=self.vocab_size, row_vocab=self.row_vocab,
                                              row_dtype=ssd.row_dtype)
        if kind == "ngram":
            spec, rows = backups.ngram_speculation(
                batch.history, run["seed"], self._put(rids), n, k=run["k"],
                vocab_size=self.vocab_size, row_vocab=self.row_vocab, row_dtype=ssd.row_dtype)
            return self._put(spec), rows
        raise ValueError(f"unknown backup {kind!r}")

    def dispatch_tree(self, batch: Batch, spec, from_backup: np.ndarray, rids, run):
        """Glue + fork + tree decode for the speculation in flight (async: returns at once)."""
        ssd = run["ssd"]
        self._gather_kernel = ssd.gather_kernel
        top_n = tuple(f + 1 for f in run["f_hit"][:-1])
        self._tree, self.cache = draft_tree(
            self.params, self.cfg, self.cache, self._put(batch.bonus), to_mesh(spec, self.sharding),
            self._put(batch.n), self._put(batch.active), self._put(from_backup), run["seed"],
            self._put(rids), run["draft_sampling"], self.vocab_size, run["f_hit"], run["f_backup"],
            top_n, ssd.saguaro_c, ssd.row_dtype, ssd.attention)

    def lookup(self, num_accepted: np.ndarray, bonus: np.ndarray) -> np.ndarray:
        """Outcome-conditioned gather from the tree just computed; returns hit [B] (host)."""
        hit, tokens, rows = lookup(self._tree, self._put(num_accepted), self._put(bonus),
                                   kernel=self._gather_kernel)
        self._next = (tokens, self._fit_rows(rows))
        self._tree = None
        return np.asarray(hit)

    def next_speculation(self):
        return self._next
