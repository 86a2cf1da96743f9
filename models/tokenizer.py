"""Tokenizers for the models we run, without torch or transformers.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a HF folder (tokenizer.json and
tokenizer_config.json) or from a GGUF file's metadata. GGUF files keep a byte-level BPE as lists
(`tokenizer.ggml.tokens`, `.merges`, `.token_type`) plus the name of the pre-tokenizer (`.pre`); we
rebuild the same tokenizer the model was trained with:

* pre-tokenizer: the split regex named by `.pre` (Qwen2's, Llama-3's, ...), then byte-level mapping;
  Qwen2 also NFC-normalizes text first, as its tokenizer.json does;
* control tokens (`<|im_start|>`, ...) become special added tokens, user-defined ones (`<tool_call>`)
  plain added tokens, so both are matched whole in the text;
* "unused" placeholder tokens (`[PAD151665]` ...) pad the embedding matrix but are not part of the
  tokenizer: they are left out, so `vocab_size` is the tokenizer's size, not the embedding rows.
"""
from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["Tokenizer", "PRE_TOKENIZER_TYPES", "CHAT_ROLES", "check_messages"]

# ---------------------------------------------------------------------------------- pre-tokenizers
# Split patterns, by the `tokenizer.ggml.pre` names llama.cpp writes.

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# kind -> names. "gpt2": GPT-2's own regex; "digits+gpt2": every digit alone, then GPT-2's regex.
# Which `tokenizer.ggml.pre` names `Tokenizer.from_gguf_metadata` supports, grouped by split rule.
PRE_TOKENIZER_TYPES: dict[str, tuple[str, ...]] = {
    "qwen2": ("qwen2", "deepseek-r1-qwen", "megrez"),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"),
    "gpt4o": ("gpt-4o", "llama4"),
    "gpt2": ("default", "gpt2", "gpt-2", "olmo", "phi-2", "jina-es", "jina-de"),
    "digits+gpt2": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
}
_PRE_KIND = {name: kind for kind, names in PRE_TOKENIZER_TYPES.items() for name in names}

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn or a document in the families we know; every one present is an EOS.
_EOS_NAMES = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|end|>",
    "<end_of_turn>", "</s>",
)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _byte_level_spelling(text: str) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[b] for b in text.encode("utf-8"))


def _pre_tokenizer(pre: str | None):
    kind = _PRE_KIND.get(pre or "default")
    if kind is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(sorted(_PRE_KIND))}"
        )
    byte_level_only = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if kind == "gpt2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if kind == "digits+gpt2":
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True),
            ]
        )
    pattern = {"qwen2": _QWEN2, "llama3": _LLAMA3, "gpt4o": _GPT4O}[kind]
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    normalizer = normalizers.NFC() if kind == "qwen2" else None
    return normalizer, pre_tokenizers.Sequence([split, byte_level_only])


# ------------------------------------------------------------------------------------ chat template


def _generation_extension():
    """A jinja extension rendering `{% generation %}...{% endgeneration %}` (used by some templates to
    mark assistant text) as just its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationExtension(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationExtension


@lru_cache(maxsize=8)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_extension()]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles a message list may use


def check_messages(messages: Any) -> list[dict]:
    """A conversation as chat templates take it: a non-empty list of {"role", "content"} dicts,
    role one of `CHAT_ROLES`, content a string (other keys pass through). Returns it as a list;
    raises ValueError naming the first bad message and what is wrong with it."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                         f"{type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': 'user', 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role' (one of {', '.join(CHAT_ROLES)})")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has an unknown role {m['role']!r}: use one of "
                             f"{', '.join(CHAT_ROLES)}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] ({m['role']}) has no 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}] ({m['role']}): content must be a string, got "
                             f"{type(m['content']).__name__}")
    return list(messages)


# ----------------------------------------------------------------------------------------- Tokenizer


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: BOS/EOS ids and the chat template.

    backend: the `tokenizers.Tokenizer`; bos_id: the BOS id or None; eos_ids: every id that ends
    generation (duplicates dropped, order kept); chat_template: the jinja source or None;
    special_tokens: bos/eos/unk/pad token texts, passed to the chat template.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0

    # -------------------------------------------------------------------------------- constructors

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a HF model folder: tokenizer.json, tokenizer_config.json, and (if present)
        chat_template.jinja / generation_config.json / config.json for the template and EOS ids."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (only fast-tokenizer folders are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        tok_config = _read_json(folder / "tokenizer_config.json")

        def token_text(value):
            if isinstance(value, dict):
                return value.get("content")
            return value

        special = {k: token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

        def token_id(text):
            return backend.token_to_id(text) if text else None

        template = tok_config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        eos = [token_id(special["eos_token"])]
        for extra in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            value = extra.get("eos_token_id")
            eos += value if isinstance(value, list) else [value]
        bos = token_id(special["bos_token"])
        if bos is None:
            bos = _read_json(folder / "config.json").get("bos_token_id")
        return cls(
            backend,
            bos_id=bos,
            eos_ids=_with_known_eos(backend, eos),
            chat_template=template,
            special_tokens=special,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Rebuild the byte-level BPE tokenizer described by a GGUF file's metadata."""
        from ssd_jax.models.loading.gguf import read_gguf_metadata

        meta = read_gguf_metadata(path)
        return cls.from_gguf_metadata(meta, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "GGUF") -> "Tokenizer":
        """Rebuild the byte-level BPE tokenizer from GGUF metadata (`read_gguf_metadata`'s dict);
        `source` names the file in error messages. Raises ValueError for a tokenizer it cannot
        rebuild (not byte-level BPE, an unknown pre-tokenizer, inconsistent lists)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{source}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; only byte-level "
                "BPE ('gpt2') tokenizers can be rebuilt from GGUF"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{source}: GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        normalizer, pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))

        alphabet = set(_byte_alphabet().values())
        vocab: dict[str, int] = {}
        added: list[AddedToken] = []
        for index, (token, kind) in enumerate(zip(tokens, types)):
            if kind == _UNUSED:
                continue
            if kind in (_CONTROL, _USER_DEFINED):
                # Matched whole in the raw text; the vocab holds the same string so the id is kept.
                added.append(AddedToken(token, special=kind == _CONTROL, normalized=False))
            elif not set(token) <= alphabet:
                token = _byte_level_spelling(token)
            if token in vocab:
                raise ValueError(f"{source}: token {token!r} appears twice (ids {vocab[token]} and {index})")
            vocab[token] = index

        pairs = []
        for merge in merges:
            parts = merge.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{source}: malformed merge {merge!r}")
            pairs.append((parts[0], parts[1]))

        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        specials = [t for t in added if t.special]
        if specials:
            backend.add_special_tokens(specials)
        plain = [t for t in added if not t.special]
        if plain:
            backend.add_tokens(plain)
        for t in added:
            if backend.token_to_id(t.content) != vocab[t.content]:
                raise ValueError(f"{source}: added token {t.content!r} did not keep its id {vocab[t.content]}")

        def meta_id(key):
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = meta_id("bos_token_id"), meta_id("eos_token_id")
        template = []
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            template.append((tokens[bos], bos))
        single, pair = "$A", "$A $B"
        if template:
            single, pair = f"{tokens[bos]} $A", f"{tokens[bos]} $A {tokens[bos]} $B"
        if meta.get("tokenizer.ggml.add_eos_token") and eos is not None:
            single, pair = f"{single} {tokens[eos]}", f"{pair} {tokens[eos]}"
            template.append((tokens[eos], eos))
        if template:
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=list(dict.fromkeys(template))
            )

        def text(i):
            return tokens[i] if i is not None else None

        special = {
            "bos_token": text(bos),
            "eos_token": text(eos),
            "unk_token": text(meta_id("unknown_token_id")),
            "pad_token": text(meta_id("padding_token_id")),
        }
        eos_candidates = [eos, meta_id("eot_token_id"), meta_id("eom_token_id")]
        return cls(
            backend,
            bos_id=bos,
            eos_ids=_with_known_eos(backend, eos_candidates),
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
        )

    # ------------------------------------------------------------------------------------- methods

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; add_special_tokens also adds the BOS/EOS that the tokenizer's
        post-processor defines (off by default)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, without special tokens unless skip_special_tokens is False."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer knows (highest id + 1); may be less than the embedding rows."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's vocabulary string (byte-level spelling), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string (byte-level spelling) of an id, or None."""
        return self.backend.id_to_token(int(token_id))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` ({"role", "content"} dicts: system prompt, turns of a chat) with the
        model's jinja chat template, as transformers does; kwargs reach the template as
        variables. Raises ValueError for a bad message list (`check_messages`), a tokenizer
        without a template, or a template that refuses the messages (e.g. a system turn)."""
        import jinja2

        messages = check_messages(messages)
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template (no "
                             "tokenizer.chat_template in its GGUF, no chat_template in its "
                             "tokenizer_config.json): give the prompt as text, without chat")
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template refused these messages: {e}") from e

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the id -> token map, added tokens included: equal fingerprints mean two
        tokenizers give every id the same meaning (e.g. a draft and a target that can share tokens)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        h = hashlib.sha256()
        for token, index in sorted(vocab.items(), key=lambda kv: kv[1]):
            h.update(f"{index}\t".encode())
            h.update(token.encode("utf-8", errors="surrogatepass"))
            h.update(b"\n")
        return h.hexdigest()

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids})"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _with_known_eos(backend: tokenizers.Tokenizer, candidates: Iterable[int | None]) -> tuple[int, ...]:
    """The given EOS ids, then every known end-of-turn/-text token the tokenizer has as an added
    token (a plain BPE piece that happens to be spelled `</s>` is not an EOS)."""
    ids = [int(i) for i in candidates if i is not None]
    added = {tok.content: i for i, tok in backend.get_added_tokens_decoder().items()}
    ids += [added[name] for name in _EOS_NAMES if name in added]
    return tuple(dict.fromkeys(ids))
