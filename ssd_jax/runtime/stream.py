"""Streaming: `Engine.stream(...)`, a generator of text deltas, for a notebook or a terminal.

    for d in engine.stream("def fib(n):", mode="ssd", max_new_tokens=64):
        print(d.text, end="", flush=True)          # d.token_ids, d.logprobs, d.row, d.finish_reason

Each `StreamDelta` holds one row's newly committed tokens (the target's raw log-probability of
each) and the text they complete. A byte-level BPE token can end inside a multi-byte UTF-8
character; `TextDecoder` holds those bytes back until the character completes, so a delta never
splits one (its text may be "" while ids arrive). With stop strings it also holds back the last
len(stop) - 1 characters, so the deltas' texts join to exactly `GenerationResult.texts[row]`.

The call runs `Engine.generate` on a worker thread (the engine's round loop is not a generator);
deltas pass through a queue. Closing the stream (a `with` block, `close()`, or the generator
being dropped) ends every row at its next commit (finish reason "cancelled") and waits for the
call to end, at most one round; a new generate or stream on the same engine, from the thread
that iterates the stream, does that first. The worker's call holds the engine's lock (one call at a
time, `Engine`) from start to end; a call from another thread waits for it.
"""
from __future__ import annotations

import codecs
import dataclasses
import inspect
import queue
import threading
import weakref
from typing import Iterator, Sequence

from ssd_jax.runtime.batch import GenerationResult, TokenSink

# engine -> its streams whose calls are still running (each removed when its call ends, so an
# abandoned stream keeps neither its engine nor its deltas alive)
_RUNNING: "weakref.WeakKeyDictionary[object, list[TextStream]]" = weakref.WeakKeyDictionary()
_RUNNING_LOCK = threading.Lock()


def _forget(stream: "TextStream") -> None:
    with _RUNNING_LOCK:
        running = _RUNNING.get(stream.engine, [])
        if stream in running:
            running.remove(stream)


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """One row's newly committed tokens. row: the prompt's index; text: the characters they
    complete ("" while a character's bytes are incomplete); token_ids / logprobs [n]: the ids and
    the target's raw log-probability of each (temperature 1); finish_reason: None while the row
    goes on, then "length" | "eos" | "stop" (or "cancelled") on its last delta."""
    row: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None


class TextDecoder:
    """Token ids -> text, incrementally, never ending inside a UTF-8 character.

    tokenizer: `ssd_jax.models.tokenizer.Tokenizer` (or anything with `decode(ids) -> str`; None:
    no text). A byte-level BPE tokenizer is decoded byte-exactly (each id's bytes through an
    incremental UTF-8 decoder, special tokens skipped as `decode` skips them); any other is
    decoded whole each time, holding back a trailing U+FFFD. stop: strings whose possible start
    is held back until the row ends (its text is then cut before the earliest one)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        self.text = ""  # every complete character decoded so far
        self._sent = 0  # characters of `text` handed out
        self._bytes = _byte_level_table(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _decode(self, ids: list[int], final: bool) -> str:
        if self.tokenizer is None:
            return ""
        if self._bytes is not None:
            return self._utf8.decode(b"".join(self._bytes(i) for i in ids), final=final)
        self._ids += ids
        whole = self.tokenizer.decode(self._ids)
        if not final:
            whole = whole.rstrip("\ufffd")  # the start of a character whose bytes are not all in
        return whole[len(self.text):] if len(whole) > len(self.text) else ""

    def push(self, ids: Sequence[int]) -> str:
        """The text that `ids` (the row's next tokens) complete and that no stop string could
        still claim."""
        self.text += self._decode([int(i) for i in ids], final=False)
        safe = len(self.text) - self._hold
        out = self.text[self._sent:safe] if safe > self._sent else ""
        self._sent += len(out)
        return out

    def finish(self, reason: str, ids: Sequence[int] = ()) -> str:
        """The rest of the text at the row's end, `ids` its last tokens: held bytes (an
        unfinished character becomes U+FFFD, as `decode` writes it) and held characters, cut
        before the earliest stop string when `reason` is "stop"."""
        self.text += self._decode([int(i) for i in ids], final=True)
        final = self.text
        if reason == "stop":
            cut = min((final.find(s) for s in self.stop if s in final), default=len(final))
            final = final[:cut]
        out = final[self._sent:]
        self._sent += len(out)
        return out


def _byte_level_table(tokenizer):
    """id -> bytes for a byte-level BPE tokenizer (a `tokenizers` backend whose decoder is
    ByteLevel), exactly as its decoder maps them; None for any other tokenizer."""
    import tokenizers

    backend = getattr(tokenizer, "backend", None)
    if not isinstance(backend, tokenizers.Tokenizer) or \
            not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
        return None
    from ssd_jax.models.tokenizer import _byte_alphabet

    to_byte = {c: b for b, c in _byte_alphabet().items()}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    cache: dict[int, bytes] = {}

    def token_bytes(i: int) -> bytes:
        got = cache.get(i)
        if got is None:
            tok = None if i in special else backend.id_to_token(i)
            if tok is None:
                got = b""
            elif all(c in to_byte for c in tok):
                got = bytes(to_byte[c] for c in tok)
            else:  # as the ByteLevel decoder does: a token with a char outside the map is raw UTF-8
                got = tok.encode("utf-8")
            cache[i] = got
        return got

    return token_bytes


class _Sink(TokenSink):
    """Runs on the worker thread: decodes each commit and queues its `StreamDelta`."""

    def __init__(self, out: queue.SimpleQueue, cancel: threading.Event, tokenizer, stop):
        self.out, self.cancel, self.tokenizer, self.stop = out, cancel, tokenizer, stop
        self.decoders: dict[int, TextDecoder] = {}
        self.finished: set[int] = set()

    def decoder(self, row: int) -> TextDecoder:
        """The row's `TextDecoder`, made on its first commit."""
        if row not in self.decoders:
            self.decoders[row] = TextDecoder(self.tokenizer, self.stop)
        return self.decoders[row]

    def commit(self, row, ids, logprobs, finish) -> bool:
        """Queue the row's delta; False (end the row) once the stream is closed."""
        dec = self.decoder(row)
        if finish:  # the ids that met a stop string are cut with it, never pushed past it
            text = dec.finish(finish, ids)
            self.finished.add(row)
        else:
            text = dec.push(ids)
        self.out.put(("delta", StreamDelta(row, text, tuple(int(i) for i in ids),
                                           tuple(float(x) for x in logprobs), finish or None)))
        return not self.cancel.is_set()


class TextStream:
    """What `Engine.stream` returns: iterate it for `StreamDelta`s; `result` is the call's
    `GenerationResult` (metrics included) once the iteration has ended. Use it in a `with` block,
    or `close()` it, to end the call early."""

    def __init__(self, engine, args: dict):
        self.engine, self._args = engine, args
        self.result: GenerationResult | None = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: threading.Thread | None = None  # the thread iterating it
        self._gen = self._run()

    def __iter__(self) -> Iterator[StreamDelta]:
        return self._gen

    def __next__(self) -> StreamDelta:
        return next(self._gen)

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the call: every row stops at its next commit; returns once the call has ended."""
        self._cancel.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self._gen.close()
        except ValueError:  # the generator is running on another thread; it ends on its own
            pass

    def _run(self) -> Iterator[StreamDelta]:
        settle(self.engine)
        self._owner = threading.current_thread()
        out: queue.SimpleQueue = queue.SimpleQueue()
        tok = self.engine.target.tokenizer
        sink = _Sink(out, self._cancel, tok, self._args.get("stop", ()) or ())

        def work():
            try:
                out.put(("done", self.engine.generate(**self._args, on_tokens=sink)))
            except BaseException as e:  # noqa: BLE001 - re-raised on the consumer's thread
                out.put(("error", e))
            finally:
                _forget(self)

        self._thread = threading.Thread(target=work, name="ssd_jax-stream", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING.setdefault(self.engine, []).append(self)
        self._thread.start()
        try:
            while True:
                kind, item = out.get()
                if kind == "delta":
                    yield item
                elif kind == "error":
                    raise item
                else:
                    self.result = item
                    for row, reason in enumerate(item.finish_reasons):  # a row ended unseen
                        if row not in sink.finished:
                            yield StreamDelta(row, sink.decoder(row).finish(reason), (), (),
                                              reason or None)
                    return
        finally:
            self._cancel.set()
            if self._thread is not threading.current_thread():
                self._thread.join()
            _forget(self)


def start(engine, prompts, messages, kwargs: dict) -> TextStream:
    """`Engine.stream`'s body: check the arguments against `generate`'s signature (a TypeError
    now, not on the first `next`), and return the `TextStream` (the call starts when iterated)."""
    if "on_tokens" in kwargs:
        raise ValueError("stream() yields the tokens itself: give on_tokens to generate(), "
                         "not to stream()")
    args = dict(kwargs, prompts=prompts, messages=messages)
    inspect.signature(engine.generate).bind(**args)
    return TextStream(engine, args)


def settle(engine) -> None:
    """End the streams still running on `engine` that this thread iterates (ones it stopped
    iterating) before it makes another call on the engine; another thread's stream is left to
    run (the engine's lock makes the new call wait for it)."""
    me = threading.current_thread()
    with _RUNNING_LOCK:
        mine = [s for s in _RUNNING.get(engine, []) if s._owner is me and s._thread is not me]
    for s in mine:
        s.close()
