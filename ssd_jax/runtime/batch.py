"""Host-side state of a batch of requests: committed tokens, stop conditions, streaming.

Sequences finish at different times; their rows keep their static slot on the device (inactive
rows compute but commit nothing), and the host stops emitting for them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass
class GenerationResult:
    """What `Engine.generate` returns, one entry per prompt in prompt order.

    texts: the decoded generated text (cut before the earliest stop string; "" without a tokenizer);
    token_ids / logprobs: the generated ids and the target model's log-probability of each (raw
    logits, temperature 1); finish_reasons: "length" | "eos" | "stop" (or "cancelled": a stream
    closed before its end, `ssd_jax.runtime.stream`); metrics: the call's
    `ssd_jax.runtime.metrics.Metrics`.
    """

    texts: list[str]
    token_ids: list[list[int]]  # generated ids per prompt (prompt excluded)
    logprobs: list[list[float]]  # the target model's log-probability of each generated id
    finish_reasons: list[str]  # "length" | "eos" | "stop"
    metrics: "object"


class TokenSink:
    """A streaming callback that also takes the log-probs and the finish reason, and may end its
    row: `Batch` calls `commit(row, ids, logprobs, finish)` instead of `sink(row, ids)`; commit
    returns False to end the row (finish reason "cancelled", as if it had met a stop)."""

    def commit(self, row: int, ids: list[int], logprobs: list[float], finish: str) -> bool:
        """Take a row's newly kept ids [n], their log-probs [n] and its finish reason ("" while
        it goes on); return whether the row should go on."""
        raise NotImplementedError

    def __call__(self, row: int, ids: list[int]) -> None:
        # callable, as generate's check of on_tokens wants; Batch itself always calls commit
        self.commit(row, ids, [float("nan")] * len(ids), "")


class _RowLists:
    """A `Batch` attribute of one list per row, made by `make(batch)` (empty lists by default) on
    first read, and again on the read after None is assigned (`Batch`'s docstring)."""

    def __init__(self, make: Callable[["Batch"], list] | None = None):
        self.make = make or (lambda batch: [[] for _ in batch.prompts])

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, batch, owner=None):
        if batch is None:
            return self
        rows = batch.__dict__.get(self.slot)
        if rows is None:
            rows = batch.__dict__[self.slot] = self.make(batch)
        return rows

    def __set__(self, batch, rows) -> None:
        batch.__dict__[self.slot] = rows


class Batch:
    """prompt ids per row -> committed history; `emit` applies EOS / stop strings / exact budgets.

    prompts: B lists of token ids; max_new_tokens: the exact budget per row; eos_ids: ids that end
    a row; stop: strings that end a row once they appear in its decoded text (needs `decode`, ids ->
    text); on_tokens(row, ids): called with each row's newly kept ids (streaming); a `TokenSink`
    gets their log-probs and the finish reason too. rows: how many of the prompts are requests
    (default all); the rest are padding to a batch bucket (`request.padded_rows`): finished
    ("cancelled") before anything runs, left out of the result.

    Invariants while a row is active: history = prompt + generated, the last entry is the bonus
    token at position n = len(history) - 1 (in neither KV cache yet), prev = history[-2].

    `prompts` are kept as given (never changed); the per-row lists `history`, `generated` and
    `logprobs` are made on first use: the device loop needs none of them until the call's end, and
    a list per row of a batch of thousands is what Python's garbage collector then walks again and
    again (benchmarks/README.md at 8faea7c, "A call's per-row host work in whole-batch passes").
    """

    generated = _RowLists()  # [B][g_b] each row's generated ids
    logprobs = _RowLists()  # [B][g_b] the target's log-probability of each generated id
    # [B][n_b + 1] each row's prompt + generated ids (the prompts are never changed: copies)
    history = _RowLists(lambda b: [list(map(int, p)) + g for p, g in zip(b.prompts, b.generated)])

    def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int],
                 stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 rows: int | None = None):
        self.prompts = prompts
        self.prompt_lens = np.fromiter(map(len, prompts), np.int32, len(prompts))
        self.rows = len(prompts) if rows is None else int(rows)
        self.finish = [""] * self.rows + ["cancelled"] * (len(prompts) - self.rows)
        self.max_new = int(max_new_tokens)
        self.eos = set(int(e) for e in eos_ids)
        self.stop = [s for s in stop if s]
        if self.stop and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        self.decode = decode
        self.on_tokens = on_tokens

    @property
    def size(self) -> int:
        """B, the number of rows (padding included: the devices' batch)."""
        return len(self.prompts)

    @property
    def active(self) -> np.ndarray:
        """`[B]` bool: rows not finished yet."""
        return np.array([f == "" for f in self.finish])

    def emit(self, row: int, tokens: Sequence[int], logprobs: Sequence[float]) -> int:
        """Commit `tokens` (with their `logprobs`) for an active row, in order, until a stop
        condition (EOS, the budget or a stop string; the token that meets it is kept); returns how
        many were kept (0 for a finished row)."""
        if self.finish[row]:
            return 0
        kept = []
        for t, lp in zip(tokens, logprobs):
            t = int(t)
            self.history[row].append(t)
            self.generated[row].append(t)
            self.logprobs[row].append(float(lp))
            kept.append(t)
            if t in self.eos:
                self.finish[row] = "eos"
            elif len(self.generated[row]) >= self.max_new:
                self.finish[row] = "length"
            elif self.stop and any(s in self.decode(self.generated[row]) for s in self.stop):
                self.finish[row] = "stop"
            if self.finish[row]:
                break
        if kept and isinstance(self.on_tokens, TokenSink):
            lps = self.logprobs[row][-len(kept):]  # the ones just appended
            if not self.on_tokens.commit(row, kept, lps, self.finish[row]) and not self.finish[row]:
                self.finish[row] = "cancelled"
        elif kept and self.on_tokens is not None:
            self.on_tokens(row, kept)
        return len(kept)

    def texts(self) -> list[str]:
        """The decoded generated text of each row; a row that finished by "stop" is cut at the
        earliest occurrence of a stop string. "" for every row without `decode`."""
        if self.decode is None:
            return ["" for _ in range(self.rows)]
        out = []
        for gen, fin in zip(self.generated[:self.rows], self.finish[:self.rows]):
            text = self.decode(gen)
            if fin == "stop":
                cut = min((text.find(s) for s in self.stop if s in text), default=len(text))
                text = text[:cut]
            out.append(text)
        return out

    def result(self, metrics) -> GenerationResult:
        """The `GenerationResult` of the rows so far, carrying `metrics`. The call is over: its
        rows' lists are handed over, not copied (a copy of each row doubled the lists a call of
        thousands of rows leaves to Python's garbage collector). Padding rows are left out."""
        r = self.rows
        cut = (lambda x: x) if r == self.size else (lambda x: x[:r])
        return GenerationResult(texts=self.texts(), token_ids=cut(self.generated),
                                logprobs=cut(self.logprobs), finish_reasons=cut(self.finish),
                                metrics=metrics)
