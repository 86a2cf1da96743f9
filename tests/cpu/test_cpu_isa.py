"""SSD_JAX_CPU_ISA=avx2 (models/cpu/build.py): the kernel library built for an AVX2-only CPU
(-march=x86-64-v3) on this one, in a subprocess: its AVX-512 features report False, prepare lays
out nothing for them, and every kernel's results still equal the XLA reference ops'."""
import os
import platform
import subprocess
import sys

import pytest

from ssd_jax.models.cpu import build

CODE = r'''
import jax, jax.numpy as jnp, numpy as np
from ssd_jax.models import cpu
from ssd_jax.models.cpu import attention, matmul, swiglu, layouts
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_attend, xla_dense, xla_swiglu
from ssd_jax.models.params import random_params
from ssd_jax.models.quant import quantize_params
from ssd_jax.models.transformer import forward

f = cpu.features()
assert f == {"isa": "avx2", "available": True, "bf16_strips": False, "int8_tiles": False,
             "int4": False}, f
assert cpu.isa() == "avx2" and "-march=x86-64-v3" in cpu.build.flags()
ops = cpu.backend()
assert ops.fast_dtypes == ("float32",) and ops.fast_quant == ("none",)
rng = np.random.default_rng(0)
r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
x, w = r(5, 300), r(300, 200)
got, want = np.asarray(matmul.kernel(x, w), np.float64), np.asarray(x, np.float64) @ np.asarray(w, np.float64)
assert np.all(np.abs(got - want) <= 300 * 2.0 ** -24 * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w))) + 1e-30)
xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
np.testing.assert_allclose(np.asarray(cpu.dense(xb, wb), np.float32),
                           np.asarray(xla_dense(xb, wb), np.float32), rtol=1e-2, atol=1e-2)
qw = quantize_params(random_params(tiny_config("qwen2", vocab_size=96), 0)).layers[0].w_gate_up
xq = r(3, qw.shape[0])
np.testing.assert_allclose(np.asarray(matmul.kernel_int8(xq, qw.q, qw.scale)),
                           np.asarray(matmul.reference_int8(xq, qw.q, qw.scale)), rtol=1e-5, atol=1e-5)
gu = r(4, 2 * 40) * 5
np.testing.assert_array_equal(np.asarray(swiglu.kernel(gu)), np.asarray(xla_swiglu(gu)))
B, T, H, KVH, D, S = 2, 3, 4, 2, 32, 20
args = (r(B, T, H, D), r(B, T, KVH, D), r(B, T, KVH, D), jnp.asarray([[3, 4, 5], [10, 11, 12]], jnp.int32),
        r(B, S, KVH, D), r(B, S, KVH, D))
a, b = attention.kernel(*args), xla_attend(*args)
np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), rtol=2e-6, atol=2e-6)
for dt in ("float32", "bfloat16"):
    cfg = tiny_config("qwen2", vocab_size=96, dtype=dt)
    params = random_params(cfg, 1)
    for p in (params, quantize_params(params), quantize_params(params, mode="int4")):
        prepared = ops.prepare(p)
        assert not layouts.is_prepared(prepared)  # nothing laid out for AVX-512 paths
        toks = jnp.asarray(rng.integers(0, 96, (2, 5)), jnp.int32)
        fwd = jax.jit(forward, static_argnames=("cfg", "ops"))
        hlo = fwd.lower(prepared, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=ops).as_text()
        assert "ssd_jax_small_m_matmul" in hlo and "ssd_jax_small_m_matmul_int4" not in hlo
        got = fwd(prepared, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=ops)[0]
        want = fwd(p, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=XLA)[0]
        tol = 1e-5 if dt == "float32" and p is params else 2e-2
        rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        assert rel < tol, (dt, rel)
print("ok")
'''


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is x86's")
def test_the_avx2_build_reports_no_avx512_features_and_equals_the_reference():
    assert build.compiler() is not None, "no C++ compiler: CI installs one"
    env = dict(os.environ, SSD_JAX_CPU_ISA="avx2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_the_isa_switch_has_its_own_cache_key_and_names_unknown_values(monkeypatch):
    native = build.flags()
    monkeypatch.setenv("SSD_JAX_CPU_ISA", "avx2")
    assert build.isa() == "avx2" and "-march=x86-64-v3" in build.flags() and build.flags() != native
    monkeypatch.setenv("SSD_JAX_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="unknown SSD_JAX_CPU_ISA='sse2'.*avx2"):
        build.flags()
