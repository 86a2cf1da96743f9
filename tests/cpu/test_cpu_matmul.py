"""The small-M CPU matmul kernel (models/cpu/matmul.py) against the exact product and XLA's dense,
its row-count invariance, where the cpu backend's dense dispatches to it, the model's logits with
the cpu backend against XLA's, the build (features, the package's sources, the off switch) and its
clear errors."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import cpu
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import build, layouts, matmul
from ssd_jax.models.cpu.layouts import untie_lm_head
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_dense
from ssd_jax.models.params import decode_bytes, param_bytes, random_params
from ssd_jax.models.transformer import forward


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_kernel_builds_on_this_machine():
    # CI and the dev machine have g++; a machine without a compiler gets XLA and a warning, but
    # here a failed build must be seen, not silently replaced by the slow path.
    assert build.available(), f"the CPU kernel did not build: {build.reason()}"
    assert build.reason() == ""


def test_the_backend_hints_name_what_the_built_kernels_serve():
    ops = cpu.backend()
    assert ops.name == "cpu" and ops is cpu.backend()  # one table: a stable static argument
    # bf16 is fast only where the strips kernel serves it: XLA's own CPU bf16 dots are ~10x slower
    strips = build.has_feature("bf16_strips")
    assert ops.fast_dtypes == (("bfloat16", "float32") if strips else ("float32",))
    assert ops.fast_quant[0] == "none"
    assert ("int8" in ops.fast_quant) == build.has_feature("int8_tiles")
    assert ("int4" in ops.fast_quant) == build.has_feature("int4")
    assert ops.tree_attention is XLA.tree_attention and ops.cache_gather is XLA.cache_gather


def test_the_entry_point_names_the_backend():
    from importlib.metadata import entry_points
    eps = {ep.name: ep for ep in entry_points(group="ssd_jax.backends")}
    assert eps["cpu"].value == "ssd_jax.models.cpu:backend" and eps["cpu"].load() is cpu.backend


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), (16,), (13,)])
@pytest.mark.parametrize("K,N", [(1, 1), (7, 15), (16, 64), (64, 65), (100, 130), (257, 200)])
def test_kernel_matches_reference(transpose_w, lead, K, N):
    x = _rand((*lead, K), 0)
    w = _rand((N, K) if transpose_w else (K, N), 1)
    got = jax.jit(lambda x, w: matmul.kernel(x, w, transpose_w))(x, w)
    assert got.shape == (*lead, N) and got.dtype == jnp.float32
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64).T if transpose_w else np.asarray(w, np.float64)
    # fp32's worst-case dot-product error: K roundings of at most eps/2 of the running |sum|.
    bound = K * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
    assert np.all(np.abs(np.asarray(got, np.float64) - x64 @ w64) <= bound + 1e-30)


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                               (jnp.float32, jnp.float32)])
@pytest.mark.parametrize("lead,K,N", [((1,), 64, 200), ((5,), 300, 1000), ((3, 4), 17, 33), ((16,), 1536, 96),
                                      ((2, 100), 80, 3000)])
def test_bf16_weights_match_the_exact_product(transpose_w, x_dtype, out_dtype, lead, K, N):
    # bf16 weights are widened to fp32 (or paired by vdpbf16ps where the CPU has AVX512_BF16);
    # the sum is fp32 either way, then rounded once if the result is bf16.
    x = _rand((*lead, K), 6).astype(x_dtype)
    w = _rand((N, K) if transpose_w else (K, N), 7).astype(jnp.bfloat16)
    got = jax.jit(lambda x, w: matmul.kernel(x, w, transpose_w, out_dtype))(x, w)
    assert got.shape == (*lead, N) and got.dtype == out_dtype
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    w64 = w64.T if transpose_w else w64
    exact = x64 @ w64
    bound = K * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
    if out_dtype == jnp.bfloat16:
        bound = bound + 2.0 ** -8 * np.abs(exact) + 1e-30  # one rounding to 8 significant bits
    assert np.all(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - exact) <= bound + 1e-30)


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_is_the_same_whatever_the_row_count(transpose_w, dtype):
    # The property that lets a verify reproduce a decode's logits bit for bit.
    K, N = 300, 1000
    w = _rand((N, K) if transpose_w else (K, N), 2).astype(dtype)
    x = _rand((16, K), 3).astype(dtype)
    f = jax.jit(lambda x, w: matmul.kernel(x, w, transpose_w))
    one = np.stack([np.asarray(f(x[m:m + 1], w))[0] for m in range(16)])
    for M in (2, 5, 7, 16):
        np.testing.assert_array_equal(np.asarray(f(x[:M], w)), one[:M])


def test_concurrent_callers_get_their_serial_results():
    # Two host threads calling the kernel at once (as two devices' steps would) share its helper
    # thread's one-slot mailbox (cpu_kernels/parallel.h): a caller that finds it taken or the
    # helper busy falls back to XLA's pool. Every result must still be the serial one.
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable CPUs for the kernel to split its work")
    from concurrent.futures import ThreadPoolExecutor
    K, N = 512, 8192
    calls = [jax.jit(lambda x, w: matmul.kernel(x, w))]
    ws = [_rand((K, N), 10), _rand((K, N), 11).astype(jnp.bfloat16)]
    if build.has_feature("bf16_strips"):
        calls.append(jax.jit(lambda x, w: matmul.kernel(x, w, packed=True)))
        ws[1] = layouts.pack_bf16(ws[1])
    else:
        calls.append(calls[0])
    xs = [_rand((4, K), 12), _rand((4, K), 13).astype(jnp.bfloat16)]
    serial = [np.asarray(f(x, w)) for f, x, w in zip(calls, xs, ws)]

    def hammer(i):
        return [np.asarray(calls[i](xs[i], ws[i])) for _ in range(40)]

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(hammer, [0, 1]))
    for i in (0, 1):
        for r in results[i]:
            np.testing.assert_array_equal(r, serial[i])


def test_results_do_not_depend_on_the_helper_thread():
    # With the helper off every call splits its work on XLA's pool alone (cpu_kernels/parallel.h);
    # whoever runs a chunk, its sums are the same.
    K, N = 512, 8192
    w, x = _rand((K, N), 14), _rand((5, K), 15)
    f = jax.jit(lambda x, w: matmul.kernel(x, w))
    with_helper = np.asarray(f(x, w))
    try:
        build.use_helper_thread(False)
        without = [np.asarray(f(x, w)) for _ in range(3)]
    finally:
        build.use_helper_thread(True)
    for r in without:
        np.testing.assert_array_equal(r, with_helper)
    np.testing.assert_array_equal(np.asarray(f(x, w)), with_helper)


def _dispatches(fn, *args) -> bool:
    return "ssd_jax_small_m_matmul" in jax.jit(fn).lower(*args).as_text()


def test_dense_uses_the_kernel_only_where_it_serves(monkeypatch):
    w = _rand((64, 32), 4)
    mm = cpu.dense
    assert _dispatches(lambda x, w: mm(x, w), _rand((5, 64), 5), w)
    assert _dispatches(lambda x, w: mm(x, w), _rand((2, 8, 64), 5), w)  # 16 rows
    assert _dispatches(lambda x, w: mm(x, w, transpose_w=True), _rand((5, 32), 5), w)  # tied head
    assert not _dispatches(lambda x, w: mm(x, w), _rand((17, 64), 5), w)  # past MAX_ROWS: XLA's GEMM
    np.testing.assert_array_equal(np.asarray(mm(_rand((17, 64), 5), w)),
                                  np.asarray(xla_dense(_rand((17, 64), 5), w)))
    xb, wb = _rand((5, 64), 5).astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert _dispatches(lambda x, w: mm(x, w), xb, wb)
    assert mm(xb, wb).dtype == jnp.bfloat16
    assert mm(xb, wb, preferred_element_type=jnp.float32).dtype == jnp.float32
    assert _dispatches(lambda x, w: mm(x, w), _rand((40, 64), 5).astype(jnp.bfloat16), wb)  # bf16: any rows
    assert not _dispatches(lambda x, w: mm(x, w), _rand((5, 64), 5), wb)  # mixed dtypes: XLA
    xh, wh = _rand((5, 64), 5).astype(jnp.float16), w.astype(jnp.float16)
    assert not _dispatches(lambda x, w: mm(x, w), xh, wh)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # another platform: XLA's dense
    assert not _dispatches(lambda x, w: mm(x, w), _rand((5, 64), 5), w)


def test_kernel_rejects_bad_operands_with_a_clear_error():
    x, w = _rand((2, 8), 0), _rand((8, 4), 1)
    with pytest.raises(ValueError, match="fp32/bf16"):
        matmul.kernel(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="fp32/bf16"):
        matmul.kernel(x, w, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="contraction sizes differ"):
        matmul.kernel(x, _rand((9, 4), 1))
    with pytest.raises(ValueError, match="contraction sizes differ"):
        matmul.kernel(x, w, transpose_w=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_forward_with_the_kernel_matches_xla(arch):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=(arch == "llama"))
    params = random_params(cfg, seed=1)
    ops = cpu.backend()
    prepared = ops.prepare(params)
    assert prepared.lm_head is not None  # the tied head untied for the kernel
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "ops"))
    outs = {}
    for name, o, p in (("cpu", ops, prepared), ("xla", XLA, params)):
        hlo = fwd.lower(p, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=o).as_text()
        assert ("ssd_jax_small_m_matmul" in hlo) == (name == "cpu")
        outs[name], _ = fwd(p, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=o)
    np.testing.assert_allclose(np.asarray(outs["cpu"]), np.asarray(outs["xla"]), rtol=1e-5, atol=1e-5)
    # the unprepared (tied) params through the cpu ops give the same logits too
    tied, _ = fwd(params, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=ops)
    np.testing.assert_allclose(np.asarray(tied), np.asarray(outs["xla"]), rtol=1e-5, atol=1e-5)


def test_untied_head_copy_gives_the_same_logits_and_reads_the_same_bytes():
    cfg = tiny_config("llama", vocab_size=96, tie_embeddings=True)
    params = random_params(cfg, seed=2)
    assert params.lm_head is None
    untied = untie_lm_head(params)
    np.testing.assert_array_equal(np.asarray(untied.lm_head), np.asarray(params.embed).T)
    assert decode_bytes(untied) == decode_bytes(params) == param_bytes(params)
    toks = jnp.asarray([[3, 7, 11]], jnp.int32)
    a, _ = forward(params, cfg, toks, init_cache(cfg, 1, 8))
    b, _ = forward(untied, cfg, toks, init_cache(cfg, 1, 8))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"),
                    reason="the -march names below are x86's")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "skylake-avx512"])
def test_kernel_source_compiles_where_the_cpu_lacks_avx512_bf16_or_vnni(march):
    # The machine builds with -march=native, so code behind its feature checks (vdpbf16ps, packed
    # strips, vpdpwssd, tiles) always compiles here; a fallback that does not would only break on a
    # user's older CPU, where the kernel would then silently turn into XLA.
    cxx = build.compiler()
    assert cxx is not None, "no C++ compiler: CI installs one"
    flags = [f for f in build.flags() if not f.startswith("-march=") and f != "-shared"]
    done = subprocess.run([cxx, *flags, f"-march={march}", "-fsyntax-only",
                           f"-I{jax.ffi.include_dir()}", str(build.SOURCE)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_package_ships_every_kernel_source():
    # The kernel is compiled on the user's machine from these files; one left out of the wheel
    # (the headers once were) makes an installed ssd_jax fall back to XLA.
    import fnmatch
    import tomllib
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "ssd_jax.models.cpu" in setup["packages"]
    assert setup["package-dir"]["ssd_jax.models"] == "models"  # so the package's folder is models/cpu
    globs = setup["package-data"]["ssd_jax.models.cpu"]
    pkg = root / "models" / "cpu"
    assert build.SOURCE.parent == pkg / "kernels"
    sources = sorted(p.relative_to(pkg).as_posix()
                     for p in (pkg / "kernels").iterdir() if p.is_file())
    assert sources and all(any(fnmatch.fnmatch(s, g) for g in globs) for s in sources), (sources, globs)
    assert {"kernels/small_m_matmul.cc", "kernels/bf16_strips.h"} <= set(sources)


def test_turned_off_by_the_environment_variable():
    code = ("from ssd_jax.models import cpu; import jax.numpy as jnp; import pytest\n"
            "assert not cpu.available() and 'SSD_JAX_CPU_KERNELS=0' in cpu.build.reason()\n"
            "with pytest.raises(RuntimeError, match='cpu backend is not available.*SSD_JAX_CPU'):\n"
            "    cpu.backend()\n"
            "print(float(cpu.dense(jnp.ones((2, 3)), jnp.ones((3, 4))).sum()))")
    env = dict(os.environ, SSD_JAX_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "24.0"


def test_features_name_what_the_built_kernel_serves():
    f = build.features()
    assert f["isa"] == build.isa() and f["available"] is True
    assert set(f) == {"isa", "available", "bf16_strips", "int8_tiles", "int4"}
    for name in ("bf16_strips", "int8_tiles", "int4"):
        assert f[name] == build.has_feature(name)
    if build.isa() == "native":  # what this CPU has is what the native build serves
        flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
        if "avx512_bf16" in flags:
            assert f["bf16_strips"]
        if "avx512_vnni" in flags and "avx512bw" in flags:
            assert f["int8_tiles"] and f["int4"]
    with pytest.raises(ValueError, match="unknown kernel feature 'int3'.*int4"):
        build.has_feature("int3")
