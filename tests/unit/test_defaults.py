"""ssd_jax.runtime.defaults: the CPU's features, the backend / dtype / draft format chosen from
them (on this machine, and with the AVX-512 features masked by SSD_JAX_CPU_ISA=avx2 in a fresh
process), and the SSD layout the CLI runs, decided without starting JAX."""
import json
import os
import subprocess
import sys
import warnings

import pytest

from ssd_jax.models import backends
from ssd_jax.models.ops import XLA, Ops
from ssd_jax.runtime import defaults
from ssd_jax.runtime.defaults import choose, cpu_features, fast_paths, ssd_layout

CPUINFO = """processor\t: 0
model name\t: Test CPU 9000
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16

processor\t: 1
model name\t: Test CPU 9000
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16
"""
CPU_KERNELS = Ops(name="cpu", fast_dtypes=("bfloat16", "float32"), fast_quant=("none", "int8", "int4"))


def _run(code: str, **env) -> dict:
    """`code` in a fresh Python (its last stdout line is JSON) with `env` added."""
    e = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ features
def test_cpu_features_from_cpuinfo(monkeypatch):
    monkeypatch.delenv("SSD_JAX_CPU_ISA", raising=False)
    f = cpu_features(CPUINFO)
    assert f["model"] == "Test CPU 9000" and f["known"]
    assert f["avx2"] and f["avx512f"] and f["avx512_bf16"] and f["avx512_vnni"] and f["amx_bf16"]
    assert not f["amx_int8"] and not f["avx_vnni"]
    assert "SSD_JAX_CPU_ISA" not in f and "masked" not in f
    monkeypatch.setenv("SSD_JAX_CPU_ISA", "avx2")
    f = cpu_features(CPUINFO)
    assert f["SSD_JAX_CPU_ISA"] == "avx2" and f["avx512_bf16"]  # the hardware still has it ...
    assert not defaults.effective(f, "avx512_bf16") and defaults.effective(f, "avx2")  # ... masked
    assert set(f["masked"]) == {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
                                "amx_tile", "amx_bf16"}
    assert "SSD_JAX_CPU_ISA=avx2 masks" in defaults.describe(f)


def test_cpu_features_off_linux_is_safe(monkeypatch):
    monkeypatch.delenv("SSD_JAX_CPU_ISA", raising=False)
    f = cpu_features("")  # no /proc/cpuinfo
    assert not f["known"] and not any(f[x] for x in defaults.FLAGS)
    assert "flags unknown" in defaults.describe(f)
    json.dumps(f)  # recorded in benchmark JSON as is


def test_cpu_features_of_this_machine_are_json():
    f = cpu_features()
    assert set(defaults.FLAGS) <= set(f) and json.loads(json.dumps(f)) == f


# ------------------------------------------------------------------------------------------ fast paths
def test_fast_paths_keep_to_the_cpu_features(monkeypatch):
    monkeypatch.delenv("SSD_JAX_CPU_ISA", raising=False)
    full = cpu_features(CPUINFO)
    assert fast_paths(CPU_KERNELS, "cpu", full) == (("bfloat16", "float32"), ("none", "int8", "int4"))
    no512 = {**full, "avx512_bf16": False, "avx512_vnni": False}
    assert fast_paths(CPU_KERNELS, "cpu", no512) == (("float32",), ("none",))
    monkeypatch.setenv("SSD_JAX_CPU_ISA", "avx2")
    assert fast_paths(CPU_KERNELS, "cpu", cpu_features(CPUINFO)) == (("float32",), ("none",))
    # XLA's CPU ops: fp32, unquantized, whatever the CPU has
    assert fast_paths(XLA, "cpu", full) == (("float32",), ("none",))
    # off the CPU the table's own hints stand
    assert fast_paths(XLA, "gpu", full)[0] == XLA.fast_dtypes
    # flags unknown (off Linux): the table's hints stand
    assert fast_paths(CPU_KERNELS, "cpu", cpu_features(""))[0] == ("bfloat16", "float32")


def test_choose_with_a_table_and_features(monkeypatch):
    monkeypatch.delenv("SSD_JAX_CPU_ISA", raising=False)
    full = cpu_features(CPUINFO)
    c = choose(CPU_KERNELS, platform="cpu", features=full)
    assert (c["backend"], c["dtype"], c["draft_quant"], c["notes"]) == \
        (CPU_KERNELS, "bfloat16", "int4", [])
    c = choose(CPU_KERNELS, "fp32", "int8", platform="cpu", features=full)
    assert (c["dtype"], c["draft_quant"], c["notes"]) == ("float32", "int8", [])
    c = choose(XLA, platform="cpu", features=full)
    assert (c["dtype"], c["draft_quant"]) == ("float32", "none")
    with pytest.raises(ValueError, match="unknown backend"):
        choose("nope", platform="cpu")
    with pytest.raises(ValueError, match="dtype"):
        choose(XLA, "fp8", platform="cpu")
    with pytest.raises(ValueError, match="draft format"):
        choose(XLA, draft_quant="int3", platform="cpu")


def test_a_format_without_a_fast_path_is_converted_with_one_warning(monkeypatch):
    monkeypatch.setattr(defaults, "_WARNED", set())
    no512 = {**cpu_features(CPUINFO), "avx512_bf16": False, "avx512_vnni": False}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            c = choose(CPU_KERNELS, "bf16", "int8", platform="cpu", features=no512)
            assert c["draft_quant"] == "none" and c["dtype"] == "bfloat16"  # bf16: asked for
            assert len(c["notes"]) == 2
    msgs = [str(w.message) for w in got]
    assert len(msgs) == 2, msgs  # once each, however often chosen
    assert any("int8 draft has no fast path" in m and "AVX-512 VNNI" in m for m in msgs)
    assert any("bfloat16 has no fast path" in m and "float32 is faster" in m for m in msgs)


# ------------------------------------------------------------------------------------------ this machine
def test_choose_on_this_machine():
    c = choose()
    ops = c["backend"]
    f = cpu_features()
    assert ops == backends.select("auto")
    assert c["dtype"] in ops.fast_dtypes and c["draft_quant"] in ("none", *ops.fast_quant)
    if ops.name == "cpu":
        assert (c["dtype"] == "bfloat16") == defaults.effective(f, "avx512_bf16") == \
            ("bfloat16" in ops.fast_dtypes)
        assert (c["draft_quant"] == "int4") == ("int4" in ops.fast_quant)
    elif ops.name == "xla":
        assert (c["dtype"], c["draft_quant"]) == ("float32", "none")
    assert not c["notes"]


CHOOSE = """
import json, warnings
from ssd_jax.runtime.defaults import choose
out = {}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    c = choose()
    out["auto"] = [c["backend"].name, list(c["backend"].fast_dtypes), c["dtype"], c["draft_quant"]]
    for q in ("int8", "int4"):
        c = choose(draft_quant=q)
        c = choose(draft_quant=q)  # a second time: no second warning
        out[q] = c["draft_quant"]
    out["warnings"] = [str(x.message) for x in w]
print(json.dumps(out))
"""


def test_choose_with_avx512_masked():
    """SSD_JAX_CPU_ISA=avx2 (a fresh process): the portable path. The backend is xla or a cpu
    backend with fp32 its only fast dtype; auto picks fp32 and an unquantized draft; an int8 or
    int4 request runs unquantized, with one warning each."""
    got = _run(CHOOSE, SSD_JAX_CPU_ISA="avx2")
    name, fast, dtype, quant = got["auto"]
    assert name == "xla" or (name.startswith("cpu") and fast == ["float32"]), got
    assert (dtype, quant) == ("float32", "none")
    assert got["int8"] == got["int4"] == "none"
    fast = [w for w in got["warnings"] if "no fast path" in w]  # (not a missing compiler's)
    assert len(fast) == 2, got["warnings"]
    assert "int8 draft" in fast[0] and "int4 draft" in fast[1]


def test_choose_for_the_two_process_layout_starts_no_jax_backend():
    """choose(platform="cpu") runs before the two-process transport, which must come first."""
    got = _run("import json\nfrom ssd_jax.runtime.defaults import choose\n"
               "c = choose(platform='cpu')\nfrom jax._src import xla_bridge\n"
               "print(json.dumps([c['backend'].name, c['dtype'], len(xla_bridge._backends)]))")
    assert got[2] == 0, got
    assert got[:2] == [choose()["backend"].name, choose()["dtype"]]


# ------------------------------------------------------------------------------------------ layout
def test_ssd_layout_by_cores_and_platform(monkeypatch):
    monkeypatch.setattr(defaults, "_jax_started", lambda: None)  # as in a fresh process
    monkeypatch.setattr(defaults, "accelerator_plugin", lambda: None)
    cpu = {"JAX_PLATFORMS": "cpu"}
    one = ssd_layout(cores=[3], env=cpu)
    assert one.placement == "split" and one.cores is None
    assert one.reason == "only 1 usable core; running split in one process"
    two = ssd_layout(cores=[5, 2], env=cpu)
    assert two == defaults.Layout("two-process", (2, 5), "the draft in its own process on core 5, "
                                                         "the target on core 2")
    assert ssd_layout(cores=[0, 1, 2, 3], env={}).cores == (0, 1)  # no JAX_PLATFORMS: a CPU
    cuda = ssd_layout(cores=[0, 1], env={"JAX_PLATFORMS": "cuda"})
    assert cuda.placement == "split" and "JAX_PLATFORMS=cuda" in cuda.reason
    # the real affinity, faked
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7}, raising=False)
    assert ssd_layout(env=cpu).placement == "split"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 7}, raising=False)
    assert ssd_layout(env=cpu).cores == (6, 7)


def test_ssd_layout_with_an_accelerator_plugin_or_jax_started(monkeypatch):
    monkeypatch.setattr(defaults, "_jax_started", lambda: None)
    monkeypatch.setattr(defaults, "accelerator_plugin", lambda: "jax_cuda12_plugin")
    lay = ssd_layout(cores=[0, 1], env={})
    assert lay.placement == "split" and "jax_cuda12_plugin" in lay.reason
    assert ssd_layout(cores=[0, 1], env={"JAX_PLATFORMS": "cpu"}).placement == "two-process"
    monkeypatch.undo()
    import jax
    jax.devices()  # this process has started JAX: the transport can no longer come first
    lay = ssd_layout(cores=[0, 1], env={"JAX_PLATFORMS": "cpu"})
    assert lay.placement == "split" and "already" in lay.reason


def test_accelerator_plugin_lookup_imports_nothing(monkeypatch):
    seen = []
    real = defaults.importlib.util.find_spec

    def fake(name, *a):  # only the CUDA 13 plug-in "installed", whatever this machine has
        seen.append(name)
        if name in defaults.ACCELERATOR_PLUGINS:
            return object() if name == "jax_cuda13_plugin" else None
        return real(name, *a)
    monkeypatch.setattr(defaults.importlib.util, "find_spec", fake)
    assert defaults.accelerator_plugin() == "jax_cuda13_plugin"
    assert "jax_cuda12_plugin" in seen and "jax_cuda13_plugin" not in sys.modules


def test_a_fresh_process_decides_without_starting_jax():
    got = _run("import json, sys\nfrom ssd_jax.runtime.defaults import ssd_layout\n"
               "lay = ssd_layout()\nprint(json.dumps([lay.placement, 'jax' in sys.modules and "
               "bool(sys.modules['jax']._src.xla_bridge._backends)]))")
    assert got[1] is False
    cores = defaults.usable_cores()
    if defaults.accelerator_plugin() is None:
        assert got[0] == ("two-process" if len(cores) >= 2 else "split")

