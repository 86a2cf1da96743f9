"""`ssd_jax.tools.inspect` and its `hlo_text`: reading an optimized program (kernels, whole-cache
copies, large temporaries) from HLO text written here by hand, from programs compiled on this CPU
whose answer is known by construction, and for an H100 without one (tests marked `gpu_aot`, which
need JAX's CUDA plugin: the `inspect` extra)."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.params import init_params
from ssd_jax.tools import cli
from ssd_jax.tools import hlo_text as hlo
from ssd_jax.tools import inspect as ins

# Two computations run as kernels (the entry and the loop body); the fusions' own computations
# do not. Written by hand: the entry launches a transpose fusion of a cache-sized array (4x8x2x4
# = 256 elements), an in-place update, a cuBLAS call and the loop; the body launches one fusion
# and one copy of the cache-sized array; parameters, tuples, bitcasts and constants launch nothing.
HLO = """HloModule jit_f, entry_computation_layout={()}

%fused_transpose (p: bf16[4,8,2,4]) -> bf16[4,2,8,4] {
  %p = bf16[4,8,2,4]{3,2,1,0} parameter(0)
  ROOT %t = bf16[4,2,8,4]{3,2,1,0} transpose(%p), dimensions={0,2,1,3}
}

%fused_dus (a: bf16[4,8,2,4], b: bf16[4,1,2,4], i: s32[]) -> bf16[4,8,2,4] {
  %a = bf16[4,8,2,4]{3,2,1,0} parameter(0)
  %b = bf16[4,1,2,4]{3,2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[4,8,2,4]{3,2,1,0} dynamic-update-slice(%a, %b, %z, %i, %z, %z)
}

%fused_mul (x: bf16[64,32], y: bf16[32]) -> bf16[64,32] {
  %x = bf16[64,32]{1,0} parameter(0)
  %y = bf16[32]{0} parameter(1)
  %yb = bf16[64,32]{1,0} broadcast(%y), dimensions={1}
  ROOT %m = bf16[64,32]{1,0} multiply(%x, %yb)
}

%body (s: (s32[], bf16[4,8,2,4])) -> (s32[], bf16[4,8,2,4]) {
  %s = (s32[], bf16[4,8,2,4]{3,2,1,0}) parameter(0)
  %n = s32[] get-tuple-element(%s), index=0
  %c = bf16[4,8,2,4]{3,2,1,0} get-tuple-element(%s), index=1
  %n1 = s32[] fusion(%n), kind=kLoop, calls=%fused_transpose
  %c1 = bf16[4,8,2,4]{3,2,1,0} copy(%c)
  ROOT %r = (s32[], bf16[4,8,2,4]{3,2,1,0}) tuple(%n1, %c1)
}

%cond (s: (s32[], bf16[4,8,2,4])) -> pred[] {
  %s = (s32[], bf16[4,8,2,4]{3,2,1,0}) parameter(0)
  %n = s32[] get-tuple-element(%s), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%n, %k), direction=LT
}

ENTRY %main (cache: bf16[4,8,2,4], new: bf16[4,1,2,4], i: s32[], w: bf16[64,32], v: bf16[32]) -> (bf16[4,8,2,4], bf16[4,2,8,4], f32[4]) {
  %cache = bf16[4,8,2,4]{3,2,1,0} parameter(0)
  %new = bf16[4,1,2,4]{3,2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %w = bf16[64,32]{1,0} parameter(3)
  %v = bf16[32]{0} parameter(4)
  %tr = bf16[4,2,8,4]{3,2,1,0} fusion(%cache), kind=kLoop, calls=%fused_transpose
  %up = bf16[4,8,2,4]{3,2,1,0} fusion(%cache, %new, %i), kind=kLoop, calls=%fused_dus
  %big = bf16[64,32]{1,0} fusion(%w, %v), kind=kLoop, calls=%fused_mul
  %bc = bf16[2048]{0} bitcast(%big)
  %g = (f32[4]{0}, s8[256]{0}) custom-call(%bc), custom_call_target="__cublas$gemm"
  %gv = f32[4]{0} get-tuple-element(%g), index=0
  %z = s32[] constant(0)
  %t = (s32[], bf16[4,8,2,4]{3,2,1,0}) tuple(%z, %up)
  %loop = (s32[], bf16[4,8,2,4]{3,2,1,0}) while(%t), condition=%cond, body=%body
  %out = bf16[4,8,2,4]{3,2,1,0} get-tuple-element(%loop), index=1
  ROOT %res = (bf16[4,8,2,4]{3,2,1,0}, bf16[4,2,8,4]{3,2,1,0}, f32[4]{0}) tuple(%out, %tr, %gv)
}
"""


def test_the_parser_reads_computations_shapes_and_the_entry():
    comps, entry = hlo.parse_hlo(HLO)
    assert entry == "main"
    assert set(comps) == {"fused_transpose", "fused_dus", "fused_mul", "body", "cond", "main"}
    g = next(i for i in comps["main"] if i.name == "g")
    assert (g.op, g.shape) == ("custom-call", "(f32[4]{0}, s8[256]{0})")
    assert hlo.arrays(g.shape) == [("f32", 4), ("s8", 256)] and hlo.nbytes(g.shape) == 16 + 256
    assert set(hlo.executed(comps, entry)) == {"main", "cond", "body"}


def test_a_loop_of_known_trip_count_runs_its_body_that_often():
    """A `lax.scan`'s while (XLA's `known_trip_count`) launches its body and condition each
    iteration; a loop whose count XLA does not know (a chunk's rounds) counts one iteration."""
    scanned = HLO.replace("while(%t), condition=%cond, body=%body",
                          'while(%t), condition=%cond, body=%body, '
                          'backend_config={"known_trip_count":{"n":"3"}}')
    comps, entry = hlo.parse_hlo(scanned)
    assert hlo.runs(comps, entry) == {"main": 1, "cond": 3, "body": 3}
    got = hlo.analyse(scanned, layers=2, cache_elems=4 * 8 * 2 * 4, small_weight_bytes=64 * 32 * 2)
    # entry 4, then 3 x (cond 1 + body 2)
    assert got["kernels"] == 4 + 3 * 3 and got["kernel_ops"]["compare"] == 3
    assert got["cache_copies"] == 1 + 3
    # XLA's analysis counts the loop once; two more runs of the body (n1: s32 in and out, 8 bytes;
    # c1: the cache-sized copy, 512 in and 512 out) and of the condition (two s32 in, a pred out)
    assert got["loop_bytes"] == 2 * ((4 + 4) + (512 + 512) + (4 + 4 + 1))
    assert hlo.analyse(HLO, layers=2, cache_elems=4 * 8 * 2 * 4,
                       small_weight_bytes=64 * 32 * 2)["loop_bytes"] == 0


def test_the_analysis_counts_what_the_hand_written_program_launches():
    got = hlo.analyse(HLO, layers=2, cache_elems=4 * 8 * 2 * 4, small_weight_bytes=64 * 32 * 2)
    # entry: tr, up, big, g (4); cond: lt (1); body: n1, c1 (2)
    assert got["kernels"] == 7 and got["per_layer"] == 3.5
    assert got["kernel_ops"] == {"fusion:kLoop": 4, "custom-call": 1, "compare": 1, "copy": 1}
    # the transpose fusion in the entry and the copy in the body; the in-place update is neither
    assert got["cache_copies"] == 2
    # the weight-sized multiply feeds the library call: a temporary, not an output
    assert got["large_temporaries"] == ["fusion bf16[64,32]"]
    # XLA's cost analysis counts a custom call as -1 byte: the cuBLAS call's operand (bf16[2048])
    # and its result (f32[4]; not its s8 workspace) are added back
    assert got["custom_bytes"] == 2048 * 2 + 4 * 4 + 1


def test_a_custom_call_updating_a_cache_in_place_counts_its_read_not_a_write():
    """A kernel whose result 0 is aliased to its cache operand (as the Pallas attention writes the
    new rows): the cache is read (counted once, whole), the other result written."""
    call = ("(bf16[4,8,2,4]{3,2,1,0}, f32[4,16]{1,0}) custom-call(%q, %c), "
            'custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{0}: (1, {})}')
    text = ("ENTRY %m (q: bf16[4,16], c: bf16[4,8,2,4]) -> (bf16[4,8,2,4], f32[4,16]) {\n"
            "  %q = bf16[4,16]{1,0} parameter(0)\n"
            "  %c = bf16[4,8,2,4]{3,2,1,0} parameter(1)\n"
            f"  ROOT %a = {call}\n}}\n")
    got = hlo.analyse(text, layers=1, cache_elems=4 * 8 * 2 * 4, small_weight_bytes=1 << 20)
    assert got["custom_bytes"] == (4 * 16 * 2 + 256 * 2) + 4 * 16 * 4 + 1
    assert got["cache_copies"] == 0
    single = text.replace("(bf16[4,8,2,4]{3,2,1,0}, f32[4,16]{1,0}) custom",
                          "bf16[4,8,2,4]{3,2,1,0} custom").replace("{{0}: (1,", "{{}: (1,")
    got = hlo.analyse(single, layers=1, cache_elems=4 * 8 * 2 * 4, small_weight_bytes=1 << 20)
    assert got["custom_bytes"] == 4 * 16 * 2 + 256 * 2 + 1


def test_custom_calls_in_loops_and_branches_count_as_the_analysis_counts_the_rest():
    """XLA's cost analysis counts a loop body once (`loop_bytes` adds its other runs) and the
    largest branch of a conditional: the custom calls' bytes are summed the same way."""
    def comp(name, n):  # a computation holding one custom call reading and writing f32[n]
        return (f"%{name} (x: f32[{n}]) -> f32[{n}] {{\n  %x = f32[{n}]{{0}} parameter(0)\n"
                f'  ROOT %k = f32[{n}]{{0}} custom-call(%x), custom_call_target="k"\n}}\n')
    text = (comp("body", 8) + comp("small", 4) + comp("large", 16)
            + "%cond (x: f32[8]) -> pred[] {\n  %x = f32[8]{0} parameter(0)\n"
              "  ROOT %c = pred[] constant(false)\n}\n"
              "ENTRY %m (p: f32[8], i: s32[]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
              "  %i = s32[] parameter(1)\n"
              "  %w = f32[8]{0} while(%p), condition=%cond, body=%body, "
              'backend_config={"known_trip_count":{"n":"3"}}\n'
              "  %b = f32[8]{0} conditional(%i, %p, %p), branch_computations={%small, %large}\n"
              "  ROOT %r = f32[8]{0} add(%w, %b)\n}\n")
    got = hlo.analyse(text, layers=1, cache_elems=1 << 20, small_weight_bytes=1 << 20)
    assert got["custom_bytes"] == (8 * 4 * 2 + 1) + (16 * 4 * 2 + 1)
    # two more runs of the body's call (the condition, a constant, launches nothing)
    assert got["loop_bytes"] == 2 * (8 * 4 * 2)


def test_a_tuple_shape_with_parenthesised_tpu_layouts_is_read_whole():
    text = ("ENTRY %m (p: f32[8,128]) -> f32[8,128] {\n"
            "  %p = f32[8,128]{1,0:T(8,128)} parameter(0)\n"
            "  %f = (f32[8,128]{1,0:T(8,128)}, s32[]) fusion(%p), kind=kLoop, calls=%x\n"
            "  ROOT %g = f32[8,128]{1,0:T(8,128)} get-tuple-element(%f), index=0\n}\n")
    comps, _ = hlo.parse_hlo(text)
    f = comps["m"][1]
    assert f.op == "fusion" and hlo.arrays(f.shape) == [("f32", 1024), ("s32", 1)]


CFG = tiny_config("qwen2", vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def test_a_cache_moved_whole_is_counted_and_an_update_in_place_is_not():
    """Compiled here: the cache with two axes swapped is one cache-sized transpose; updating one
    row with dynamic_update_slice (the cache donated) moves nothing whole."""
    cache = jax.ShapeDtypeStruct((2, 64, 2, 8), jnp.float32)
    row = jax.ShapeDtypeStruct((2, 1, 2, 8), jnp.float32)
    moved = jax.jit(lambda c: jnp.swapaxes(c, 1, 2)).lower(cache).compile().as_text()
    kw = dict(layers=1, cache_elems=2 * 64 * 2 * 8, small_weight_bytes=1 << 30)
    assert hlo.analyse(moved, **kw)["cache_copies"] == 1
    in_place = jax.jit(lambda c, r: jax.lax.dynamic_update_slice(c, r, (0, 3, 0, 0)),
                       donate_argnums=0).lower(cache, row).compile().as_text()
    assert hlo.analyse(in_place, **kw)["cache_copies"] == 0


def test_each_cache_a_fusion_slices_out_whole_is_a_copy():
    """A fusion whose tuple result holds two slices of a stacked cache (a layer's K and V taken out
    of [L, ...] buffers, as XLA:GPU does for a layer scan that reads them with XLA's dots) moves
    two caches whole; one whose results update the buffers in place moves none."""
    cache, stacked, row = "bf16[4,8,2,4]{3,2,1,0}", "bf16[3,4,8,2,4]{4,3,2,1,0}", "bf16[1,4,1,2,4]"
    sliced = (cache, "dynamic-slice(%{}, %i, %z, %z, %z, %z), dynamic_slice_sizes={{1,4,8,2,4}}")
    updated = (stacked, "dynamic-update-slice(%{}, %u, %i, %z, %z, %z, %z)")

    def program(made):
        out, op = made
        params = f"(a: {stacked}, b: {stacked}, i: s32[], u: {row}) -> ({out}, {out})"
        head = (f"  %a = {stacked} parameter(0)\n  %b = {stacked} parameter(1)\n"
                f"  %i = s32[] parameter(2)\n  %u = {row}{{4,3,2,1,0}} parameter(3)\n")
        return (f"%f {params} {{\n{head}  %z = s32[] constant(0)\n"
                f"  %x = {out} {op.format('a')}\n  %y = {out} {op.format('b')}\n"
                f"  ROOT %t = ({out}, {out}) tuple(%x, %y)\n}}\n"
                f"ENTRY %m {params} {{\n{head}"
                f"  ROOT %r = ({out}, {out}) fusion(%a, %b, %i, %u), kind=kLoop, calls=%f\n}}\n")

    kw = dict(layers=1, cache_elems=4 * 8 * 2 * 4, small_weight_bytes=1 << 20)
    assert hlo.analyse(program(sliced), **kw)["cache_copies"] == 2
    assert hlo.analyse(program(updated), **kw)["cache_copies"] == 0


def test_an_embedding_lookup_counts_the_rows_it_reads_not_the_table():
    """Compiled here: nine rows of a 512 KiB table (the model's `embed`, then a use of them that
    fuses with the gather). XLA's cost analysis counts the whole table; `gather_excess` is the
    table less the rows, so the corrected bytes are those of the rows, the indices and the
    result. One row is a dynamic slice XLA counts right: nothing is taken out."""
    from ssd_jax.models.transformer import embed

    table = jax.ShapeDtypeStruct((4096, 64), jnp.bfloat16)
    step = jax.jit(lambda t, i: embed(t, i).astype(jnp.float32) * 2)
    for n in (9, 1):
        compiled = step.lower(table, jax.ShapeDtypeStruct((n,), jnp.int32)).compile()
        xla, excess = ins._bytes_accessed(compiled), hlo.gather_excess(compiled.as_text())
        rows, out = n * 64 * 2, n * 64 * 4
        if n == 1:
            assert excess == 0 and xla < 4096 * 64 * 2 / 100
        else:
            assert xla >= 4096 * 64 * 2  # the whole table, as XLA counts it
            assert excess == 4096 * 64 * 2 - rows
            assert rows + out <= xla - excess <= rows + out + 4 * n + 1024

# Forwards of the model one iteration of a step runs (CFG as target and draft, K = 3): a chunk
# verifies once and drafts K steps (SD) or a glue forward and K tree steps (SSD).
PASSES = {"sd_chunk": 1 + 3, "ssd_chunk": 1 + 1 + 3}


@pytest.mark.parametrize("step", ins.STEPS)
def test_every_step_compiles_and_reports_on_the_local_backend(step):
    rep = ins.inspect_step(step, CFG, ins.Shapes(batch=2, max_len=32, k=3, prompt=8,
                                                 fanout=(2, 1, 1, 1)), "local")
    passes = PASSES.get(step, 1)
    assert rep.step == step and rep.batch == 2 and rep.layers == 2 * passes
    assert rep.kernels > 0 and rep.per_layer == rep.kernels / rep.layers
    assert rep.bytes_accessed is not None and rep.bytes_ratio > 0
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda k: init_params(CFG, k), jax.random.key(0))))
    kv = 2 * 2 * 2 * 32 * 2 * 8 * 4  # K and V, layers, B, S, KVH, D, fp32
    assert rep.must_read == passes * (weights + kv)
    assert rep.memory["arguments"] >= weights and rep.compile_s > 0


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(ValueError, match="target must be one of"):
        ins.target_device("h300")
    with pytest.raises(ValueError, match="steps must be a non-empty subset"):
        ins.inspect_pair(ins.default_pair(), "local", steps=("decode", "sample"))
    with pytest.raises(ValueError, match="batches must be positive"):
        ins.inspect_pair(ins.default_pair(), "local", batches=(0,))
    assert cli.main(["inspect", "--target", "local", "--steps", "decode,nope"]) == cli.EXIT_USAGE
    assert "--steps takes a comma-separated subset" in capsys.readouterr().err
    assert cli.main(["inspect", "--target", "local", "--batch", "1,x"]) == cli.EXIT_USAGE
    assert "--batch takes comma-separated integers" in capsys.readouterr().err
    assert cli.main(["inspect", "--target", "local", "-k", "0"]) == cli.EXIT_USAGE
    assert "-k in [1, max-len - 1]" in capsys.readouterr().err


def test_autotune_results_are_a_gpus_and_must_exist(tmp_path):
    """`--autotune` / `autotune_options`: the options that load a GPU's autotune results and
    require one for every GEMM; refused by name, before anything compiles, for a device that is
    no GPU or a file that is not there."""
    from types import SimpleNamespace
    gpu, results = SimpleNamespace(platform="cuda"), tmp_path / "autotune.textproto"
    assert ins.autotune_options(None, jax.devices()[0]) == {}
    with pytest.raises(ValueError, match="takes a GPU target .* not cpu"):
        ins.autotune_options(str(results), jax.devices()[0])
    with pytest.raises(ValueError, match="no such file .*dump_autotune_results_to"):
        ins.autotune_options(str(results), gpu)
    results.write_text("version: 3\n")
    assert ins.autotune_options(str(results), gpu) == {
        "xla_gpu_load_autotune_results_from": str(results.resolve()),
        "xla_gpu_require_complete_aot_autotune_results": True}


@pytest.mark.gpu_aot
def test_autotune_results_without_the_steps_gemms_are_refused_by_name(tmp_path):
    """Deviceless for an H100 with autotune results that hold no configuration (a valid, empty
    file): XLA loads the file and, every GEMM's configuration being required, refuses the step;
    the error names the file and the step, so no report mixes heuristics into a device's picks."""
    results = tmp_path / "autotune.textproto"
    results.write_text("version: 3\n")
    with pytest.raises(ValueError, match=r"--autotune .*autotune.textproto has no GEMM "
                                         r"configuration for a fusion of decode at batch 1"):
        ins.inspect_step("decode", ins.default_pair()["target"], ins.Shapes(batch=1), "h100",
                         autotune=str(results))


@pytest.mark.gpu_aot
def test_the_default_pairs_decode_compiles_for_an_h100_without_one(tmp_path, capsys):
    """The CLI on the default pair's shapes for sm_90a: one line per step, the JSON beside it, and
    figures a deviceless compile can give (a cost analysis included)."""
    out = tmp_path / "h100.json"
    assert cli.main(["inspect", "--target", "h100", "--steps", "decode,tree", "--batch", "1",
                     "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ssd-jax inspect: the default pair's shapes") and "h100" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == ["decode", "tree"]
    res = json.loads(out.read_text())
    dec = res["reports"][0]
    assert res["target"] == "h100" and dec["layers"] == 28 and dec["batch"] == 1
    assert dec["kernels"] > 28 and dec["bytes_ratio"] > 0.9  # every weight read at least once
    assert dec["memory"]["arguments"] >= 3e9  # the 1.5B target's bf16 weights
    assert any(k.startswith("fusion") for k in dec["kernel_ops"])


# The bounds of issue #54 on the default pair's steps as the engine compiles them for an H100
# (the pallas table): at most 12 launches a layer, no KV cache moved whole, the bytes XLA's cost
# analysis counts (corrected: `gather_excess`, `loop_bytes`, and `custom_bytes`, the Pallas
# kernels' operands and results, the KV caches among them) within 1.25x of the weights plus the
# KV window. Where the program is not there yet the bound is the figure reached, so that a
# regression anywhere fails and a gain shows. At b = 16 XLA's GEMM heuristics (no device to tune
# on) split the GEMMs' K and write fp32 partials that a reduction reads back: verify launches 12
# a layer plus those reductions, and verify, the tree (144 query rows, fp32 logits besides) and
# the chunks that run them move the partials the must-read does not count.
AOT_STEPS = ("decode", "verify", "draft", "tree", "ar_chunk", "sd_chunk", "ssd_chunk")
AOT_BOUNDS = {("verify", 16): dict(per_layer=12.3, bytes=1.41), ("tree", 16): dict(bytes=1.93),
              ("sd_chunk", 16): dict(bytes=1.34), ("ssd_chunk", 16): dict(bytes=1.79)}


@pytest.mark.gpu_aot
@pytest.mark.parametrize("batch", [1, 16])
def test_every_default_step_on_an_h100_launches_few_kernels_and_moves_no_cache(batch):
    reports = ins.inspect_pair(ins.default_pair(), "h100", steps=AOT_STEPS, batches=(batch,))
    shapes = ins.Shapes(batch=batch, max_len=1024)
    assert [r.step for r in reports] == list(AOT_STEPS)
    for r in reports:
        bound = {"per_layer": 12.0, "bytes": 1.25, **AOT_BOUNDS.get((r.step, r.batch), {})}
        assert r.per_layer <= bound["per_layer"], r.line()
        assert r.cache_copies == 0, r.line()
        assert r.bytes_ratio is not None and r.bytes_ratio <= bound["bytes"], r.line()
        # the Pallas kernels are what the engine runs there: the attention and its merge at least,
        # their bytes counted (each forward's attention reads its model's KV caches)
        assert r.kernel_ops.get("custom-call", 0) >= 2 * r.layers, r.line()
        assert r.custom_bytes >= ins._kv_bytes(ins.default_pair()["draft"], shapes), r.line()


@pytest.mark.gpu_aot
def test_every_step_compiles_for_a_tpu_v5e_without_one():
    """The TPU's default path (the XLA ops: no Triton kernel on it), every step and chunk at b = 1
    on the default pair's shapes cut to two layers each: a batch or a depth changes shapes, not
    the ops a step runs (the whole depth compiled for ~10 minutes of CI's CPU; the h100 bounds
    above compile it, where kernels a layer need it)."""
    assert ins.default_ops("tpu-v5e").name == "xla"
    pair = {name: dataclasses.replace(cfg, num_layers=2)
            for name, cfg in ins.default_pair().items()}
    reports = ins.inspect_pair(pair, "tpu-v5e", batches=(1,))
    assert [r.step for r in reports] == list(ins.STEPS)
    assert all(r.kernels > r.layers for r in reports)


def test_the_librarys_compile_options_leave_a_cpu_program_as_it_was():
    """`aot.COMPILER_OPTIONS` only turns off an XLA:GPU pass: the CPU compiles the decode step to
    the same program with them as without (metadata aside)."""
    import re

    from ssd_jax.algorithm.aot import step_jit
    fn, args, donate, _ = ins._step("decode", CFG, ins.Shapes(batch=2, max_len=32))
    texts = [re.sub(r", metadata=\{[^}]*\}", "", j(fn, donate_argnums=donate).trace(*args)
                    .lower().compile().as_text()) for j in (jax.jit, step_jit)]
    assert texts[0] == texts[1]


@pytest.mark.gpu_aot
def test_the_engines_decode_step_reads_each_weight_once_on_an_h100():
    """`steps.decode` as the engine jits it, the default pair's target at b = 1, for sm_90a: no
    weight-sized temporaries (the qkv and o projections stay GEMMs: aot.COMPILER_OPTIONS) and the
    bytes XLA moves within 5% of the weights plus the KV window; without the options, a
    plain jax.jit of the same step has the temporaries (what the option is for)."""
    from jax.sharding import SingleDeviceSharding

    from ssd_jax.algorithm import steps
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models.kv_cache import init_cache

    cfg = ins.default_pair()["target"]
    shapes = ins.Shapes(batch=1, max_len=1024)
    on = SingleDeviceSharding(ins.target_device("h100"))
    place = lambda t: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=on), t)
    params = place(jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0)))
    cache = place(jax.eval_shape(lambda: init_cache(cfg, 1, 1024)))
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=on)
    args = (params, cfg, cache, i32, jax.ShapeDtypeStruct((1,), jnp.bool_, sharding=on),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=on), i32,
            place(SamplingParams(temperature=0.0)), cfg.vocab_size)
    kv = 2 * 28 * 1024 * 2 * 128 * 2  # K and V, layers, S, KVH, D, bf16
    reports = {}
    for name, jitted in (("engine", steps.decode.jit),
                         ("plain", jax.jit(steps.decode.__wrapped__,
                                           static_argnames=("cfg", "vocab_size", "ops"),
                                           donate_argnames=("cache",)))):
        compiled = jitted.trace(*args).lower().compile()
        reports[name] = ins.report("decode", compiled, cfg, shapes, params, kv)
    engine = reports["engine"]
    assert engine.large_temporaries == [] and engine.bytes_ratio <= 1.05, engine.line()
    assert len(reports["plain"].large_temporaries) >= 2 * 28  # qkv and o, every layer


def test_a_step_takes_the_options_from_python_and_runs_inside_another_jit():
    """JAX refuses compiler options on a nested jit: a `step_jit` step called inside another trace
    (a chunk calling `verify`) runs as a plain jit there. This pins the private JAX function that
    tells the two apart (`jax._src.core.trace_state_clean`)."""
    from jax._src import core as jax_core

    from ssd_jax.algorithm.aot import step_jit
    seen = []
    step = step_jit(lambda x: x * 2)
    outer = jax.jit(lambda x: (seen.append(jax_core.trace_state_clean()), step(x) + 1)[1])
    assert jax_core.trace_state_clean()
    assert float(step(jnp.float32(3))) == 6.0 and float(outer(jnp.float32(3))) == 7.0
    assert seen == [False]
    assert float(jax.vmap(step)(jnp.ones(2))[0]) == 2.0
