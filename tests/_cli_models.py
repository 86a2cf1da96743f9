"""Tiny random models saved as HF folders (config.json, model.safetensors, a byte-level BPE
tokenizer.json) for the tests that run the `ssd-jax` command (tests/real_weights/test_cli.py and
the modules beside it, tests/unit/test_warmup.py): the `pair` fixture, the console script and the
`generate` arguments they share."""
import json
import os
import sys

import pytest
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ssd_jax.models.config import tiny_config
from ssd_jax.models.params import perturb_hf_tensors, random_hf_tensors
from ssd_jax.models.tokenizer import _byte_alphabet

SCRIPT = os.path.join(os.path.dirname(sys.executable), "ssd-jax")
PROMPT = "def add(a, b):"


def tiny_tokenizer(swap: bool = False) -> Tokenizer:
    """Byte-level BPE over printable ASCII + newline (every id decodes to valid text) and an EOS.
    swap=True exchanges two ids: same size, another vocabulary (a mismatched draft)."""
    alpha = _byte_alphabet()
    chars = [alpha[b] for b in range(32, 127)] + [alpha[10]]
    if swap:
        chars[1], chars[2] = chars[2], chars[1]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return tok


VOCAB = tiny_tokenizer().get_vocab_size(with_added_tokens=True)  # 97: no padded embedding rows
CFG = tiny_config("qwen2", vocab_size=VOCAB)


def write_folder(folder, tensors, swap=False):
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CFG.to_hf(), f)
    tiny_tokenizer(swap).save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": None}, f)
    return str(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_models")
    t = random_hf_tensors(CFG, 0, scale=1.0)
    d = perturb_hf_tensors(t, 0.05, seed=1)
    return dict(target=write_folder(root / "target", t), draft=write_folder(root / "draft", d),
                other=write_folder(root / "other_tok", d, swap=True), root=root)


def gen_args(pair, *extra):
    return ["generate", "--target", pair["target"], "--draft", pair["draft"], "--prompt", PROMPT,
            "--max-new-tokens", "12", "--k", "3", "--fanout", "2,2,1,1", "--max-len", "256", *extra]
