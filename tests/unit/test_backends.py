"""The backend table (ssd_jax.models.ops / backends): what `select` picks, plug-ins, the Pallas
kernels' fallback to XLA (forced failures, at selection and at the engine's first call), the
choice reported in the metrics, and gradients through the public forward."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from ssd_jax.models import backends
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.ops import XLA, xla_tree_attention
from ssd_jax.models.params import perturb, random_params
from ssd_jax.models.transformer import forward
from ssd_jax.runtime.engine import Engine, SSDConfig

CFG = tiny_config("qwen2", vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def pair():
    target = Model(CFG, random_params(CFG, 0, scale=1.0), name="target")
    return target, Model(CFG, perturb(target.params, jax.random.key(1), 0.05), name="draft")


def _cpu_plugin_loads() -> bool:
    try:
        backends._plugin("cpu")
        return True
    except Exception:  # noqa: BLE001
        return False


def test_names_and_errors():
    names = backends.backend_names()
    assert names[:3] == ("auto", "xla", "pallas") and "cpu" in names  # cpu: an entry point
    with pytest.raises(ValueError, match="unknown backend 'tpu-magic'.*auto, xla, pallas"):
        backends.select("tpu-magic")
    with pytest.raises(ValueError, match="built-in"):
        backends.register_backend("xla", lambda: XLA)


def test_auto_on_one_cpu_device_is_the_cpu_plugin_where_it_loads():
    ops = backends.select("auto", jax.devices()[:1])
    assert ops.name == ("cpu" if _cpu_plugin_loads() else "xla")
    assert backends.select("xla") is XLA


def test_a_mesh_of_two_cpu_devices_gets_xla():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    assert backends.select("auto", mesh) is XLA
    with pytest.raises(ValueError, match="runs on one device.*backend 'xla'"):
        backends.select("cpu", mesh)


def test_pallas_on_the_cpu_runs_the_kernels_interpreted():
    ops = backends.select("pallas", jax.devices()[:1])
    assert ops.name == "pallas"
    assert ops.tree_attention is backends._tree_attention_interpret
    assert ops.cache_gather is backends._cache_gather_interpret


def test_a_kernel_that_fails_to_compile_falls_back_once(monkeypatch):
    def broken(*args):
        raise NotImplementedError("no lowering for this GPU")

    monkeypatch.setattr(backends, "_tree_attention_interpret", broken)
    monkeypatch.setattr(backends, "_WARNED", set())
    with pytest.warns(UserWarning, match="tree_attention failed to compile.*no lowering"):
        ops = backends.select("pallas", jax.devices()[:1])
    assert ops.name == "pallas[xla tree_attention]"
    assert ops.tree_attention is xla_tree_attention
    assert ops.cache_gather is backends._cache_gather_interpret  # the gather still compiles
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second selection is silent
        assert backends.select("pallas", jax.devices()[:1]).name == "pallas[xla tree_attention]"


def test_the_engine_falls_back_when_a_kernel_fails_at_its_shapes(pair, monkeypatch):
    """A tree-attention "kernel" that passes the probe (2 branches) but cannot lower the engine's
    wider tree: the draft worker warns, uses the XLA op, and the tokens equal the xla engine's."""
    def picky(q, *rest, **kw):
        if q.shape[1] > 2:
            raise NotImplementedError(f"{q.shape[1]} branches")
        return xla_tree_attention(q, *rest, **kw)

    monkeypatch.setattr(backends, "_WARNED", set())
    ops = dataclasses.replace(XLA, name="picky", tree_attention=picky)
    target, draft = pair
    kw = dict(mode="ssd", max_new_tokens=8, k=3, ssd=SSDConfig(fanout=(2, 1, 1, 1)))
    want = Engine(target, draft, compilation_cache=False, backend="xla").generate(PROMPTS, **kw)
    eng = Engine(target, draft, compilation_cache=False, backend=backends.probe(ops))
    assert eng.backend == {"target": "picky", "draft": "picky"}
    with pytest.warns(UserWarning, match="picky kernel.*tree_attention.*5 branches"):
        got = eng.generate(PROMPTS, **kw)
    assert got.token_ids == want.token_ids
    assert got.metrics.backend == {"target": "picky", "draft": "picky[xla tree_attention]"}


def test_a_registered_backend_is_used_and_reported(pair):
    calls = []

    def counting_swiglu(gu):
        calls.append(gu.shape)
        return XLA.swiglu(gu)

    backends.register_backend("counting", lambda: dataclasses.replace(
        XLA, name="counting", swiglu=counting_swiglu))
    target, draft = pair
    out = Engine(target, draft, compilation_cache=False, backend="counting").generate(
        PROMPTS, mode="sd", k=2, max_new_tokens=4)
    assert out.metrics.backend == {"target": "counting", "draft": "counting"}
    assert out.metrics.to_dict()["backend"] == {"target": "counting", "draft": "counting"}
    assert calls  # traced through the forward of both models


def _loss(params, cfg, ops):
    toks = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
    logits, _ = forward(params, cfg, toks[:, :-1], init_cache(cfg, 1, 8), ops=ops)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))


def test_grad_through_the_default_forward():
    params = random_params(CFG, 0)
    grads = jax.grad(_loss)(params, CFG, XLA)
    leaves = jax.tree_util.tree_leaves(grads)
    assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    # the directional derivative matches a central difference
    d = jax.tree_util.tree_map(lambda x: jax.random.normal(jax.random.key(3), x.shape, x.dtype), params)
    eps = 1e-3
    plus = jax.tree_util.tree_map(lambda p, v: p + eps * v, params, d)
    minus = jax.tree_util.tree_map(lambda p, v: p - eps * v, params, d)
    fd = (_loss(plus, CFG, XLA) - _loss(minus, CFG, XLA)) / (2 * eps)
    dot = sum(jnp.vdot(g, v) for g, v in zip(leaves, jax.tree_util.tree_leaves(d)))
    np.testing.assert_allclose(float(dot), float(fd), rtol=2e-2)


def test_grad_with_the_auto_backend_of_this_machine():
    """jax.grad through forward with whatever `select("auto")` gives here (the cpu kernels where
    they build) equals the XLA gradient: the kernels' backward is the reference's."""
    ops = backends.select("auto", jax.devices()[:1])
    params = ops.prepare(random_params(CFG, 0))
    got = jax.grad(_loss)(params, CFG, ops)
    want = jax.grad(_loss)(random_params(CFG, 0), CFG, XLA)
    flat = lambda t: jnp.concatenate([jnp.ravel(x).astype(jnp.float32)  # noqa: E731
                                      for x in jax.tree_util.tree_leaves(t)])
    if ops.prepare is XLA.prepare:
        np.testing.assert_allclose(flat(got), flat(want), rtol=1e-4, atol=1e-5)
    else:  # a backend that re-lays weights out gives gradients in its layout: compare the loss
        np.testing.assert_allclose(float(_loss(params, CFG, ops)), float(_loss(
            random_params(CFG, 0), CFG, XLA)), rtol=1e-5)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(got))


def test_the_cpu_backend_is_refused_off_a_cpu_device():
    # its kernels are CPU custom calls with no other lowering (models/cpu/build.py's dispatch)
    class Gpu:
        platform = "gpu"

    with pytest.raises(ValueError, match="backend 'cpu' runs on CPU devices.*'gpu'"):
        backends.select("cpu", [Gpu()])


def _layer_grads(params, cfg):
    grads = jax.grad(_loss)(params, cfg, XLA)
    return [np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(grads.layers)]


def test_grad_on_a_model_an_engine_laid_out():
    """A Model whose weights a backend laid out (the cpu backend's bf16 strips, made here with its
    own packing so that every machine has them) is refused by the default forward with a message
    naming `logical_params()`, and that gives back weights forward and jax.grad take: the loss
    and the layers' gradients of the weights before the layout."""
    from ssd_jax.models.cpu import layouts
    cfg = tiny_config("qwen2", vocab_size=64, dtype="bfloat16", tie_embeddings=True)
    orig = random_params(cfg, 0)
    model = Model(cfg, layouts._each_dense(layouts.untie_lm_head(orig), layouts.pack_weight))
    assert layouts.is_prepared(model.params)
    with pytest.raises(TypeError, match=r"logical_params\(\)"):
        _loss(model.params, cfg, XLA)
    back = model.logical_params()
    assert not layouts.is_prepared(back)
    assert float(_loss(back, cfg, XLA)) == float(_loss(orig, cfg, XLA))
    for got, want in zip(_layer_grads(back, cfg), _layer_grads(orig, cfg), strict=True):
        np.testing.assert_array_equal(got, want)


def test_grad_after_an_engine_took_the_model_over():
    """What a notebook does: `Engine(model)` with this machine's default backend, then jax.grad
    through forward on `model.logical_params()`: the original weights' gradients, whatever the
    layout the engine chose."""
    cfg = tiny_config("qwen2", vocab_size=64, dtype="bfloat16")
    model = Model(cfg, random_params(cfg, 0))
    want = _layer_grads(model.params, cfg)
    Engine(model, max_len=32)
    for got, w in zip(_layer_grads(model.logical_params(), cfg), want, strict=True):
        np.testing.assert_array_equal(got, w)
