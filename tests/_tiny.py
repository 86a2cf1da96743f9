"""Tiny random models shaped like released ones: more embedding rows than the tokenizer's ids.

Released models pad their embedding (Qwen2.5: 151,936 rows for 151,665 ids), and every proposal
row the engine builds carries the difference, so the unit tests of rows, backups and
verification build their models here: `padded_model(cfg)` is a random model of cfg (its
vocab_size the ids) with PAD more rows whose logits would win if a path let them
(`ssd_jax.testing.pad_vocabulary`) and a tokenizer of the ids. A test that needs a model whose
rows are its ids says so by building it without this helper.
"""
import jax

from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.testing import pad_vocabulary

PAD = 4  # padded rows past the ids


def padded_model(cfg, seed: int = 0, scale: float = 0.5, name: str = "") -> Model:
    """A random model of `cfg` (cfg.vocab_size: the ids) with PAD padded rows."""
    return pad_vocabulary(Model(cfg, random_params(cfg, seed, scale=scale), name=name),
                          cfg.vocab_size + PAD)


def padded_draft(target: Model, seed: int, rel: float) -> Model:
    """`target` (padded) with every weight perturbed by rel (`perturb`): a draft sharing its rows
    and tokenizer."""
    return Model(target.cfg, perturb(target.params, jax.random.key(seed), rel), target.tokenizer)
