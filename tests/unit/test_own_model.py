"""A model of one's own through the engine (ssd_jax.models.protocol, ssd_jax.models.adapters).

`TinyLM` below is a small Flax NNX decoder written here, importing nothing of our transformer:
learned embeddings plus sinusoidal positions, multi-head attention over a dict cache, a GELU MLP.
It follows the protocol (vocab_size, init_cache, __call__ writing the cache) and brings no
tree_step, so SSD's draft runs it through the generic branch step (a copy of the cache per
branch); `TreeLM` adds the protocol's own branch step (tree_step / init_branch). Checked: AR, SD
and SSD greedy-equal to the model's own greedy decoding (each step a fresh full forward, no
incremental cache); SSD sampled through the real Engine against the exact
window distribution (`ssd_jax.testing`); the plain-function adapter over our transformer's own
functions, with and without its tree_step, token-equal to the built-in path; and one clear
TypeError for each wrong object.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models import transformer
from ssd_jax.models.adapters import as_model, from_functions, from_nnx
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.testing import (detection_power_by_alternative, distribution_test,
                             enumerate_window_distribution, window_counts)

from _step_calls import count_step_calls


# ------------------------------------------------------------------ the outside model
def sinusoid(positions, dim):
    """positions [B, T] -> [B, T, dim] sine/cosine position features."""
    freq = jnp.exp(-math.log(10_000.0) * jnp.arange(dim // 2) / (dim // 2))
    ang = positions[..., None].astype(jnp.float32) * freq
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], -1)


class Block(nnx.Module):
    def __init__(self, dim, heads, *, rngs):
        self.heads = heads
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, positions, kc, vc):
        B, T, E = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(B, T, 3, self.heads, -1), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        # write each row's new KV at its positions; past the end: dropped (the protocol's rule)
        write = jax.vmap(lambda c, p, new: c.at[p].set(new, mode="drop"))
        kc, vc = write(kc, positions, k), write(vc, positions, v)
        s = jnp.einsum("bthd,bshd->bhts", q, kc) / math.sqrt(q.shape[-1])
        visible = jnp.arange(kc.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        p = jax.nn.softmax(jnp.where(visible[:, None], s, -1e30), axis=-1)
        x = x + self.out(jnp.einsum("bhts,bshd->bthd", p, vc).reshape(B, T, E))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), kc, vc


class TinyLM(nnx.Module):
    """A small decoder following ssd_jax.models.protocol (no tree_step)."""

    def __init__(self, vocab_size, dim=32, heads=2, layers=2, *, rngs):
        self.vocab_size, self.dim, self.heads = vocab_size, dim, heads
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, use_bias=False, rngs=rngs)

    def init_cache(self, batch, max_len):
        z = jnp.zeros((batch, max_len, self.heads, self.dim // self.heads), jnp.float32)
        return {"k": [z] * len(self.blocks), "v": [z] * len(self.blocks),
                "lengths": jnp.zeros((batch,), jnp.int32)}

    def __call__(self, tokens, cache):
        positions = cache["lengths"][:, None] + jnp.arange(tokens.shape[1])[None, :]
        x = self.embed(tokens) + sinusoid(positions, self.dim)
        ks, vs = [], []
        for block, kc, vc in zip(self.blocks, cache["k"], cache["v"]):
            x, kc, vc = block(x, positions, kc, vc)
            ks.append(kc)
            vs.append(vc)
        logits = self.head(self.norm(x))
        return logits, {"k": ks, "v": vs, "lengths": cache["lengths"] + tokens.shape[1]}


class TreeLM(TinyLM):
    """TinyLM with its own SSD branch step (the protocol's optional tree_step / init_branch):
    each branch's KV in a buffer of its own, the shared cache only read."""

    def init_branch(self, batch, branches, depth):
        z = jnp.zeros((batch, branches, depth, self.heads, self.dim // self.heads), jnp.float32)
        return {"k": [z] * len(self.blocks), "v": [z] * len(self.blocks)}

    def tree_step(self, tokens, positions, cache, prefix_len, branch, step, valid):
        x = self.embed(tokens) + sinusoid(positions, self.dim)  # [B, MQ, E]
        ks, vs = [], []
        for block, kc, vc, bk, bv in zip(self.blocks, cache["k"], cache["v"], branch["k"],
                                         branch["v"]):
            B, MQ, E = x.shape
            q, k, v = jnp.split(block.qkv(block.norm1(x)).reshape(B, MQ, 3, block.heads, -1), 3, 2)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
            bk = jax.lax.dynamic_update_slice_in_dim(bk, k[:, :, None], step, axis=2)
            bv = jax.lax.dynamic_update_slice_in_dim(bv, v[:, :, None], step, axis=2)
            scale = 1 / math.sqrt(q.shape[-1])
            s_cache = jnp.einsum("bmhd,bshd->bhms", q, kc) * scale  # the row's prefix
            s_cache = jnp.where((jnp.arange(kc.shape[1]) < prefix_len[..., None])[:, None],
                                s_cache, -1e30)
            s_own = jnp.einsum("bmhd,bmjhd->bhmj", q, bk) * scale  # its own path, slots <= step
            s_own = jnp.where(jnp.arange(bk.shape[2]) <= step, s_own, -1e30)
            p = jax.nn.softmax(jnp.concatenate([s_cache, s_own], -1), axis=-1)
            S = kc.shape[1]
            o = (jnp.einsum("bhms,bshd->bmhd", p[..., :S], vc)
                 + jnp.einsum("bhmj,bmjhd->bmhd", p[..., S:], bv))
            x = x + block.out(o.reshape(B, MQ, E))
            x = x + block.down(jax.nn.gelu(block.up(block.norm2(x))))
            ks.append(bk)
            vs.append(bv)
        return self.head(self.norm(x)), {"k": ks, "v": vs}


def scaled(module, factor):
    """A copy of `module` with every parameter times `factor` (sharper logits)."""
    g, state = nnx.split(module)
    return nnx.merge(g, jax.tree.map(lambda x: x * factor, state))


def perturbed(module, seed, sigma):
    """A copy of `module` with Gaussian noise of scale sigma on every parameter: a draft."""
    g, state = nnx.split(module)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + sigma * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(g, jax.tree.unflatten(tree, noisy))


def full_logits(module, rows=4096, width=32):
    """tokens [N, T] -> logits [N, T, V] of one fresh forward over the whole sequence, no
    incremental cache. Inputs are padded to [rows, width] (one compile for every N <= rows and
    T <= width; causal, so right padding changes nothing)."""
    @jax.jit
    def run(tokens):
        return module(tokens, module.init_cache(rows, width))[0]

    def logits(tokens):
        n, t = tokens.shape
        return run(jnp.zeros((rows, width), jnp.int32).at[:n, :t].set(tokens))[:n, :t]
    return logits


def plain_greedy(module, prompt, n, width=32):
    """The module's own greedy decoding: every step a fresh forward over the whole sequence."""
    run, seq = full_logits(module, rows=1, width=width), list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(run(jnp.asarray([seq], jnp.int32))[0, -1])))
    return seq[len(prompt):]


# ------------------------------------------------------------------ greedy: AR, SD, SSD
GV = 48
PROMPTS = [[5, 7, 1, 30], [2, 9], [11, 3, 3, 8, 40, 1, 6]]


@pytest.fixture(scope="module")
def greedy_pair():
    """(target, draft, the target's own greedy tokens for PROMPTS)."""
    target = scaled(TinyLM(GV, rngs=nnx.Rngs(0)), 1.5)
    return target, perturbed(target, 1, 0.05), [plain_greedy(target, p, 20) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_nnx_model_greedy_equals_its_own_decoding(greedy_pair, mode):
    target, draft, want = greedy_pair
    eng = Engine(target, draft, max_len=64, compilation_cache=False)  # NNX modules, adapted as is
    out = eng.generate(PROMPTS, mode=mode, max_new_tokens=20, k=3,
                       ssd=SSDConfig(fanout=(3, 2, 2, 1)))
    assert out.token_ids == want
    if mode == "ssd":  # the generic branch step's tree was used and hit
        assert out.metrics.hits > 0
    if mode != "ar":
        assert out.metrics.acceptance_rate > 0.1  # drafted tokens accepted, not only bonuses


def test_nnx_draft_with_its_own_tree_step(greedy_pair):
    """SSD through the protocol's branch step of an NNX draft (TreeLM: the greedy pair's draft
    weights), greedy-equal to the target's own decoding. Exactness holds for any draft, so the
    branch step itself is checked by its speculations: the same hits and accepted lengths as
    the generic branch step over the same weights."""
    target, draft, want = greedy_pair
    tree_draft = TreeLM(GV, rngs=nnx.Rngs(0))
    nnx.update(tree_draft, nnx.state(draft))
    model = from_nnx(tree_draft)
    assert model.cfg.tree_step is not None
    kw = dict(mode="ssd", max_new_tokens=20, k=3, ssd=SSDConfig(fanout=(3, 2, 2, 1)))
    out = Engine(target, model, max_len=64, compilation_cache=False).generate(PROMPTS, **kw)
    generic = Engine(target, draft, max_len=64, compilation_cache=False).generate(PROMPTS, **kw)
    assert out.token_ids == want
    assert out.metrics.hits == generic.metrics.hits > 0
    assert out.metrics.accept_hist == generic.metrics.accept_hist


def test_nnx_target_with_builtin_draft():
    """Protocols mix: an NNX target speculated by the built-in transformer (same vocabulary)."""
    target = scaled(TinyLM(GV, rngs=nnx.Rngs(3)), 1.5)
    cfg = tiny_config("llama", vocab_size=GV)
    draft = Model(cfg, random_params(cfg, 0, scale=1.0))
    eng = Engine(from_nnx(target), draft, max_len=64, compilation_cache=False, backend="xla")
    out = eng.generate(PROMPTS[:2], mode="ssd", max_new_tokens=12, k=2)
    assert out.token_ids == [plain_greedy(target, p, 12) for p in PROMPTS[:2]]



def test_only_the_builtin_transformer_shares_a_repeated_prompts_prefill(monkeypatch):
    """A batch of one prompt repeated prefills it once for the built-in transformer
    (steps.prefill_shared / prefill_cache_shared); a model of one's own keeps its own cache
    layout, so its rows are prefilled one by one: here the NNX target's, while the built-in
    draft's prefill is shared. The tokens are the target's own greedy ones either way."""
    calls = count_step_calls(monkeypatch, ("prefill", "prefill_shared", "prefill_cache",
                                           "prefill_cache_shared"))
    target = scaled(TinyLM(GV, rngs=nnx.Rngs(3)), 1.5)
    cfg = tiny_config("llama", vocab_size=GV)
    draft = Model(cfg, random_params(cfg, 0, scale=1.0))
    eng = Engine(from_nnx(target), draft, max_len=64, compilation_cache=False, backend="xla")
    out = eng.generate([PROMPTS[0]] * 3, mode="sd", max_new_tokens=6, k=2)
    assert out.token_ids == [plain_greedy(target, PROMPTS[0], 6)] * 3
    assert calls == {"prefill": 1, "prefill_shared": 0, "prefill_cache": 0,
                     "prefill_cache_shared": 1}, calls

# ------------------------------------------------------------------ exactness, sampled SSD
SV, SK, SKIP, SWIN = 4, 2, 3, 4
SPROMPT = [1, 3, 0]
SN, SCHUNK = 20_000, 5_000
ST = SamplingParams(temperature=1.0)


def test_nnx_model_ssd_is_exact():
    """SSD tokens 4-7 of SN = 20,000 independent requests (K = 2: round 1, from the backup, decides
    tokens 2-4, so tokens 5-7 always and token 4 mostly come after a cache lookup: a hit's tree
    of generic branch steps or a miss's backup) against the exact distribution enumerated from
    the NNX model's own full forward. Cells under 1% pooled (33 of 256 stay alone). Power
    (`detection_power_by_alternative`, 400 trials, alternative seeds 0-2, the minimum over its
    four alternatives): 0.41-0.44 at TV 0.02 (the "spread" alternative; the other three 1.0;
    `detection_power`'s mean 0.85), 0.98 at TV 0.03, 1.0 at TV 0.04. So this catches a protocol
    path that is wrong by TV 0.03 (a lost cache write, a position off by one, a branch seeing
    the wrong prefix), not a subtle bias: that is tests/statistical/test_engine_exactness.py's job, on the
    same engine code. About 57 s of CPU (half of it compiling)."""
    target = scaled(TinyLM(SV, dim=16, rngs=nnx.Rngs(7)), 2.0)
    draft = perturbed(target, 8, 0.3)
    eng = Engine(target, draft, max_len=16, compilation_cache=False)
    toks, hits, lookups = [], 0, 0
    for lo in range(0, SN, SCHUNK):
        out = eng.generate([SPROMPT] * SCHUNK, mode="ssd", max_new_tokens=SKIP + SWIN, k=SK,
                           sampling=ST, request_ids=range(lo, lo + SCHUNK), seed=3,
                           ssd=SSDConfig(fanout=(2, 2, 1)))
        toks.append(np.asarray(out.token_ids)[:, SKIP:])
        hits, lookups = hits + out.metrics.hits, lookups + out.metrics.lookups
    full = enumerate_window_distribution(full_logits(target), SPROMPT, SKIP + SWIN, ST, SV)
    exact = full.reshape(SV ** SKIP, SV ** SWIN).sum(0)
    res = distribution_test(window_counts(np.concatenate(toks), SV), exact,
                            min_expected=0.01 * SN)
    assert res, res
    assert 0.2 < hits / lookups < 1.0  # both a hit's tree and a miss's backup decide tokens


@pytest.mark.slow
def test_exactness_case_power():
    """The power quoted in test_nnx_model_ssd_is_exact's docstring, recomputed (seed 0)."""
    target = scaled(TinyLM(SV, dim=16, rngs=nnx.Rngs(7)), 2.0)
    full = enumerate_window_distribution(full_logits(target), SPROMPT, SKIP + SWIN, ST, SV)
    exact = full.reshape(SV ** SKIP, SV ** SWIN).sum(0)
    kw = dict(min_expected=0.01 * SN, trials=400)
    assert 0.3 < min(detection_power_by_alternative(exact, SN, tv=0.02, **kw).values()) < 0.55
    assert min(detection_power_by_alternative(exact, SN, tv=0.03, **kw).values()) > 0.95


# ------------------------------------------------------------------ the plain-function adapter
CFG = tiny_config("llama", vocab_size=40)


def _fwd(params, tokens, cache):
    return transformer.forward(params, CFG, tokens, cache)


def _cache(batch, max_len):
    return init_cache(CFG, batch, max_len)


def _tree(params, *args):
    return transformer.tree_step(params, CFG, *args)


def _branch(batch, branches, depth):
    return transformer.init_branch_kv(CFG, batch, branches, depth)


@pytest.fixture(scope="module")
def builtin_pair():
    t = Model(CFG, random_params(CFG, 0, scale=1.0))
    return t, Model(CFG, perturb(t.params, jax.random.key(2), 0.05))


def _as_functions(m, tree: bool):
    kw = dict(tree_step=_tree, init_branch=_branch) if tree else {}
    return from_functions(m.params, forward=_fwd, init_cache=_cache, vocab_size=CFG.vocab_size,
                          **kw)


SSD_KW = dict(mode="ssd", max_new_tokens=16, k=3, seed=5, ssd=SSDConfig(fanout=(3, 3, 2, 2)),
              sampling=SamplingParams(temperature=0.7))
FPROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


@pytest.fixture(scope="module")
def builtin_out(builtin_pair):
    eng = Engine(*builtin_pair, max_len=64, compilation_cache=False, backend="xla")
    return eng.generate(FPROMPTS, **SSD_KW)


@pytest.mark.parametrize("tree", [True, False], ids=["own-tree-step", "generic-branch-step"])
def test_function_adapter_matches_builtin(builtin_pair, builtin_out, tree):
    """Our transformer handed in as plain functions over its params pytree emits the built-in
    path's tokens in sampled SSD (the same draws from the same rows, so any slip in positions,
    lengths or branch prefixes shows), with its own tree_step or with the generic branch step
    over cache copies."""
    t, d = builtin_pair
    got = Engine(_as_functions(t, tree), _as_functions(d, tree), max_len=64,
                 compilation_cache=False, backend="xla").generate(FPROMPTS, **SSD_KW)
    assert got.token_ids == builtin_out.token_ids
    assert got.metrics.hits == builtin_out.metrics.hits > 0


# ------------------------------------------------------------------ wrong objects
def test_a_function_is_not_a_model(builtin_pair):
    def my_forward(params, tokens, cache):
        return None

    with pytest.raises(TypeError, match="target is a function, not a model: missing cfg, params"):
        Engine(my_forward)
    with pytest.raises(TypeError, match="draft is a function.*from_nnx.*from_functions"):
        Engine(builtin_pair[0], my_forward)


def test_builtin_config_with_a_dict_of_params():
    with pytest.raises(TypeError, match="takes ssd_jax.models.params.Params.*got dict"):
        Model(CFG, {"embed": np.zeros((40, 8))})


def test_a_cfg_that_is_no_model_description():
    with pytest.raises(TypeError, match="missing vocab_size, init_cache, forward"):
        as_model(Model(object(), {}), "target")
    class Unhashable:
        __hash__ = None
        vocab_size, forward, init_cache = 40, staticmethod(_fwd), staticmethod(_cache)

    with pytest.raises(TypeError, match="missing __hash__"):
        Engine(Model(Unhashable(), {}))


def test_an_nnx_module_missing_members():
    class NoCache(nnx.Module):
        def __init__(self):
            self.vocab_size = 4

        def __call__(self, tokens, cache):
            return tokens, cache

    with pytest.raises(TypeError, match="NoCache does not follow the model protocol.*missing "
                                        "init_cache"):
        Engine(NoCache())
