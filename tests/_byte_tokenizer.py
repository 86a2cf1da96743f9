"""A hand-made byte-level BPE tokenizer for the streaming and chat tests: one token per byte, so
every multi-byte UTF-8 character is split across tokens."""
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ssd_jax.models.tokenizer import Tokenizer, _byte_alphabet

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer(chat_template: str | None = None) -> Tokenizer:
    """Byte-level BPE with one token per byte (ids 0..255 = bytes), a merged "ab" (256) and two
    added tokens: special EOS (257) and a plain "<tool>" (258)."""
    alpha = _byte_alphabet()
    vocab = {alpha[b]: b for b in range(256)}
    vocab[alpha[ord("a")] + alpha[ord("b")]] = 256
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(alpha[ord("a")], alpha[ord("b")])],
                                fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    hf.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return Tokenizer(hf, eos_ids=[257], chat_template=chat_template)
