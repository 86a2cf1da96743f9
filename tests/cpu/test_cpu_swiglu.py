"""The CPU SwiGLU kernel (models/cpu/swiglu.py) against XLA's swiglu (models/ops.py): bit for bit
on every bf16 gate value and on random fp32 ones, row invariance, the prefill's threaded path,
where the model with the cpu backend dispatches to it, and its clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax._compat import XLA_CPU_FP32_LOGISTIC_IS_CEPHES
from ssd_jax.models import cpu
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import swiglu
from ssd_jax.models.cpu.build import TARGET_SWIGLU
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_swiglu
from ssd_jax.models.params import random_params
from ssd_jax.models.transformer import forward

kernel, reference = jax.jit(swiglu.kernel), jax.jit(xla_swiglu)


def _assert_same(got, want):
    """Bit for bit where XLA's fp32 logistic is the Cephes expf the kernel reproduces; where the
    installed XLA computes it otherwise (jaxlib 0.11 on, ssd_jax._compat), fp32 values within 2 ulp
    of XLA's, and bf16 ones still bit for bit."""
    max_ulp = 0 if XLA_CPU_FP32_LOGISTIC_IS_CEPHES or got.dtype != np.float32 else 2
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    both_nan = np.isnan(got) & np.isnan(want)
    ulp = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    differ = ~((got == want) | both_nan) & ((ulp > max_ulp) | (np.sign(got) != np.sign(want)))
    assert not differ.any(), (
        f"{differ.sum()} of {differ.size} values differ from XLA's by more than {max_ulp} ulp "
        f"(first: kernel {got[differ][:4]}, XLA {want[differ][:4]}): has XLA:CPU's exp changed? "
        "(models/cpu/kernels/exp16.h)")


@pytest.mark.parametrize("up", [1.0, -3.0, 0.7])
def test_every_bf16_gate_value_matches_xla(up):
    gate = jax.lax.bitcast_convert_type(jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16),
                                        jnp.bfloat16)  # NaNs, infs and denormals too
    x = jnp.concatenate([gate, jnp.full_like(gate, up)])[None]
    got = kernel(x)
    assert got.dtype == jnp.bfloat16
    _assert_same(got, reference(x))


@pytest.mark.parametrize("shape", [(1, 1, 2 * 8960), (3, 5, 2 * 37), (2, 2 * 16), (300, 2 * 700),
                                   (4, 2 * 5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_random_values_match_xla(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    scale = rng.choice([0.1, 3.0, 30.0, 100.0], (*shape[:-1], 1))  # rows that saturate the sigmoid
    x = jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    got = kernel(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    _assert_same(got, reference(x))  # (300, 1400) runs on several threads


def test_a_row_is_the_same_whatever_the_other_rows():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 2 * 40)), jnp.bfloat16)
    whole = np.asarray(kernel(x), np.float32)
    for m in range(5):
        np.testing.assert_array_equal(np.asarray(kernel(x[m:m + 1]), np.float32), whole[m:m + 1])


def test_swiglu_uses_the_kernel_only_where_it_serves():
    x = jnp.ones((2, 3, 2 * 24), jnp.bfloat16)
    target = f'custom_call_target="{TARGET_SWIGLU}"'

    def hlo(dtype, op=swiglu.swiglu):
        return jax.jit(op).lower(x.astype(dtype)).as_text(dialect="hlo")

    assert target in hlo(jnp.bfloat16) and target in hlo(jnp.float32)
    assert target not in hlo(jnp.bfloat16, XLA.swiglu)
    assert target not in hlo(jnp.float16)
    assert cpu.backend().swiglu is swiglu.swiglu


def test_the_model_runs_one_swiglu_kernel_a_layer_and_its_logits_match_xla():
    cfg = tiny_config("qwen2", vocab_size=64)
    params = random_params(cfg, 0, scale=1.0)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 6)), jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "ops"))
    ops = cpu.backend()
    hlo = fwd.lower(params, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16),
                    ops=ops).compile().as_text()
    assert hlo.count(f'custom_call_target="{TARGET_SWIGLU}"') == cfg.num_layers
    out = {on: fwd(o.prepare(params), cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=o)[0]
           for on, o in ((True, ops), (False, XLA))}
    np.testing.assert_allclose(np.asarray(out[True]), np.asarray(out[False]), atol=2e-5, rtol=2e-5)


def test_clear_errors():
    with pytest.raises(ValueError, match=r"\[\.\.\., 2I\]"):
        swiglu.swiglu(jnp.ones((2, 7), jnp.float32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        swiglu.kernel(jnp.ones((2, 8), jnp.float16))
