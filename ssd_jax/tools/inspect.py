"""What a step compiles to, for a GPU or TPU this machine does not have: `ssd-jax inspect`.

XLA compiles for a device it is not running on (deviceless AOT): an H100 or H200 (sm_90a) from a
target config shipped here (`targets/`), a TPU v5e from libtpu's topology, or the local backend.
Nothing runs. For each step of a pair at a batch size it reports, from the optimized program:

- `kernels`: the operations a call launches (fusions, library calls, copies, sorts, ...; not
  parameters, tuples, bitcasts or constants), in the entry computation and in every loop body or
  branch it runs (a loop body as often as its known trip count, once where XLA does not know
  it), and `per_layer`, that over the decoder layers it runs (a chunk: those of one iteration);
- `cache_copies`: results the size of one layer's KV cache made by a copy, a transpose or a slice
  (a cache moved whole instead of updated in place or read where it is; each such result of a
  multi-output fusion counts);
- `large_temporaries`: other results the size of a layer's smallest weight or more that are not
  outputs (a weight-sized intermediate, e.g. a vector-matrix product done as multiply + reduce);
- `bytes_accessed` (XLA's cost analysis of the optimized module, corrected as below) against
  `must_read`, the weights plus the KV cache window the step reads (a chunk: once a forward of one
  iteration): `bytes_ratio` 1.0 is every byte read once. `gather_excess`: XLA's analysis counts
  the whole table a fused gather reads rows of (an embedding lookup of 9 tokens as the whole
  272 MB embedding), where the kernel reads only the rows: that difference is taken out.
  `loop_bytes`: the analysis counts a loop body once; a loop of known trip count n runs it n
  times, and the n - 1 more are added, estimated from the body's kernels (each one's result and
  operands counted whole). `custom_bytes`: the analysis counts nothing for a custom call (the
  Pallas kernels, a cuBLAS GEMM); its operands and the results not updated in place are added,
  counted whole (the attention's cache operand too, which it reads up to the live prefix);
- `memory` (`memory_analysis()`: arguments, outputs, temporaries) and `compile_s`.

Each step is compiled as the engine compiles its steps (`ssd_jax.algorithm.aot.step_jit`: with the
library's XLA options). Steps, each a pure function over abstract arrays (`jax.eval_shape` of `init_params` / `init_cache`,
so a 1.5B model takes no memory): `decode` (one token, greedy), `verify` (K+1 tokens at once),
`prefill` (a prompt block, last logits), `draft` (the draft's one-token step), `tree` (SSD's
branch step, `tree_step`, over sum(fan-out) branches), and the engine's loops as it dispatches
them (`CHUNKS`: AR's decode chunk, SD's and SSD's round chunks with their sampling, commit and
resolve work; greedy). The model ops are the table the engine picks on the target
(`default_ops`).

A GPU target needs the CUDA plugin (`pip install "ssd_jax[inspect]"`: the plugin and its PJRT
runtime, no CUDA libraries) and, on a machine without a GPU, JAX's platforms left to "cpu" (set
here when JAX has not started a backend yet; else start Python with JAX_PLATFORMS=cpu); a TPU
target needs `libtpu`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Callable

from ssd_jax.tools.hlo_text import analyse

TARGETS = ("h100", "h200", "tpu-v5e", "local")
STEPS = ("decode", "verify", "prefill", "draft", "tree", "ar_chunk", "sd_chunk", "ssd_chunk")
_TARGET_CONFIGS = Path(__file__).parent / "targets"


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ProgramReport:
    """What one compiled step launches and moves (module docstring)."""
    step: str
    batch: int
    layers: int
    kernels: int
    per_layer: float
    kernel_ops: dict
    cache_copies: int
    large_temporaries: list
    bytes_accessed: float | None
    must_read: int
    bytes_ratio: float | None
    memory: dict
    compile_s: float
    gather_excess: int = 0
    loop_bytes: int = 0
    custom_bytes: int = 0

    def line(self) -> str:
        """One line: the step, its batch and each figure."""
        ratio = "n/a" if self.bytes_ratio is None else f"{self.bytes_ratio:.2f}"
        return (f"{self.step:8s} b={self.batch:<3d} kernels {self.kernels:5d} "
                f"({self.per_layer:5.1f} a layer)  cache copies {self.cache_copies:4d}  "
                f"large temporaries {len(self.large_temporaries):4d}  bytes / must-read {ratio:>5s}  "
                f"temp {self.memory.get('temp', 0) / 2**20:8.1f} MiB  compile {self.compile_s:5.1f} s")


# ------------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------------
def target_device(target: str):
    """One device of `target` (TARGETS) to compile for; a clear error naming what is missing."""
    import jax
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if target == "local":
        return jax.devices()[0]
    from jax._src import xla_bridge
    from jax.experimental import topologies
    if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
        # no backend started yet: only the CPU's, so that a GPU plugin without a GPU neither fails
        # loudly nor unregisters the compiler the deviceless compile needs
        jax.config.update("jax_platforms", "cpu")
    if target in ("h100", "h200"):
        try:
            import jax_plugins.xla_cuda12  # noqa: F401
        except ImportError:
            raise RuntimeError(f"--target {target} compiles with JAX's CUDA plugin, which is not "
                               "installed: pip install \"ssd_jax[inspect]\"") from None
        config = (_TARGET_CONFIGS / f"{target}.txtpb").read_text()
        try:
            topo = topologies.get_topology_desc(target, "cuda", target_config=config,
                                                topology="1x1x1")
        except NotImplementedError:
            raise RuntimeError(f"--target {target}: JAX's CUDA plugin did not register (without a "
                               "GPU it does only when JAX starts with JAX_PLATFORMS=cpu; set it "
                               "before importing jax)") from None
        return topo.devices[0]
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise RuntimeError("--target tpu-v5e compiles with libtpu, which is not installed: "
                           "pip install \"jax[tpu]\"") from None
    return topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]


def _bytes_accessed(compiled) -> float | None:
    """XLA's cost analysis of the optimized module (a deviceless GPU executable has none of its
    own: the CPU client analyses its module)."""
    try:
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0] if cost else None
        if cost and "bytes accessed" in cost:
            return float(cost["bytes accessed"])
        import jax
        from jax._src.lib import _jax
        module = compiled.runtime_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        return float(cost["bytes accessed"])
    except Exception:  # noqa: BLE001 - a report without the figure, not a failed inspection
        return None


# ------------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shapes:
    """A call's shapes: batch, cache slots, K, the prompt block, the tree's fan-out."""
    batch: int = 1
    max_len: int = 1024
    k: int = 4
    prompt: int = 128
    fanout: tuple[int, ...] = (3, 2, 2, 1, 1)


def default_ops(target: str, backend: str = "auto"):
    """The backend table `backend` ("auto", "xla", "pallas") on `target`'s platform, as the
    engine's `ssd_jax.models.backends.select` picks it ("auto": the pallas kernels on a GPU, the
    XLA ops on a TPU; for `local`, select's own answer here)."""
    from ssd_jax.models.backends import pallas_ops, select
    from ssd_jax.models.ops import XLA
    if backend not in ("auto", "xla", "pallas"):
        raise ValueError(f"backend must be auto, xla or pallas, got {backend!r}")
    if target == "local" or backend == "xla":
        return select(backend) if target == "local" else XLA
    if target == "tpu-v5e":
        if backend == "pallas":
            raise ValueError("the pallas backend's kernels are Triton (GPU) kernels: on tpu-v5e "
                             "choose --backend auto or xla")
        return XLA
    return pallas_ops("gpu")


def _step(name: str, cfg, sh: Shapes, ops=None) -> tuple[Callable, tuple, int, int]:
    """(fn, abstract args, the donated argument's index, KV bytes the step reads) for step
    `name`, its model ops from the table `ops` (default the XLA reference)."""
    import jax
    import jax.numpy as jnp

    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.ops import XLA
    from ssd_jax.models.params import init_params
    from ssd_jax.models.transformer import forward, init_branch_kv, tree_step

    ops = XLA if ops is None else ops

    B, S = sh.batch, sh.max_len
    params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    cache = jax.eval_shape(lambda: init_cache(cfg, B, S))
    kv = _kv_bytes(cfg, sh)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    if name in ("decode", "draft"):
        def fn(p, tok, c):
            logits, c = forward(p, cfg, tok, c, last_only=True, ops=ops)
            return jnp.argmax(logits, -1).astype(jnp.int32), c
        return fn, (params, i32(B, 1), cache), 2, kv
    if name == "verify":
        def fn(p, tok, c):
            return forward(p, cfg, tok, c, ops=ops)
        return fn, (params, i32(B, sh.k + 1), cache), 2, kv
    if name == "prefill":
        def fn(p, tok, n, c):
            logits, c = forward(p, cfg, tok, c, n, last_only=True, ops=ops)
            return jnp.argmax(logits, -1).astype(jnp.int32), c
        return fn, (params, i32(B, sh.prompt), i32(B), cache), 3, kv
    if name == "tree":
        mq = sum(sh.fanout)
        branch = jax.eval_shape(lambda: init_branch_kv(cfg, B, mq, sh.k))

        def fn(p, tok, pos, c, n, br, step, valid):
            logits, br = tree_step(p, cfg, tok, pos, c, n, br, step, valid, ops=ops)
            return jnp.argmax(logits, -1).astype(jnp.int32), br
        return fn, (params, i32(B, mq), i32(B, mq), cache, i32(B, mq), branch, i32(),
                    jax.ShapeDtypeStruct((B, mq), jnp.bool_)), 5, kv
    raise ValueError(f"step must be one of {', '.join(STEPS)}, got {name!r}")


# The engine's loops, one dispatch each (`ssd_jax.algorithm.round_steps`): AR's `decode_chunk`
# (AR_CHUNK decode steps), SD's `sd_chunk` and SSD's `ssd_chunk` (SD_CHUNK rounds), greedy, the
# draft on the target's device. A loop body is counted once: a chunk's kernels are one
# iteration's, its `layers` the decoder layers that iteration runs (the target's verify, and the
# draft's K steps for SD, its glue forward and K tree steps for SSD).
CHUNKS = ("ar_chunk", "sd_chunk", "ssd_chunk")


def chunk_layers(name: str, pair: dict, k: int) -> int:
    """Decoder layers one iteration of chunk `name` runs (see CHUNKS)."""
    t, d = pair["target"].num_layers, pair["draft"].num_layers
    return {"ar_chunk": t, "sd_chunk": t + k * d, "ssd_chunk": t + (k + 1) * d}[name]


def _chunk(name: str, pair: dict, sh: Shapes, ops):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.algorithm import round_steps as rs
    from ssd_jax.algorithm.decode_state import initial_state
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.algorithm.verify import rejection_sample
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.params import init_params

    B, S, K = sh.batch, sh.max_len, sh.k
    tcfg, dcfg = pair["target"], pair["draft"]
    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
    host = lambda t: jax.tree.map(shape, t)  # noqa: E731
    state = host(initial_state([[1] * sh.prompt] * B, S - sh.prompt - K - 2, [0], K))
    greedy = host(SamplingParams.per_request(SamplingParams(temperature=0.0), B))
    seed, rids = shape(np.int32(0)), shape(np.zeros(B, np.int32))
    tparams = jax.eval_shape(lambda k: init_params(tcfg, k), jax.random.key(0))
    tcache = jax.eval_shape(lambda: init_cache(tcfg, B, S))
    kv = functools.partial(_kv_bytes, shapes=sh)
    if name == "ar_chunk":
        def fn(p, c, st, seed, rids, smp):
            return rs.decode_chunk(p, tcfg, c, st, seed, rids, smp, vocab_size=tcfg.vocab_size,
                                   ops=ops)
        return fn, (tparams, tcache, state, seed, rids, greedy), (1, 2), kv(tcfg)
    dparams = jax.eval_shape(lambda k: init_params(dcfg, k), jax.random.key(0))
    dcache = jax.eval_shape(lambda: init_cache(dcfg, B, S))
    V = dcfg.vocab_size
    spec = jax.ShapeDtypeStruct((B, K), jnp.int32)
    rows = jax.ShapeDtypeStruct((B, K, V), jnp.float32)
    common = dict(vocab_size=tcfg.vocab_size, draft_vocab_size=V, row_vocab=V, k=K,
                  verifier=rejection_sample, tops=ops, dops=ops)
    if name == "sd_chunk":
        def fn(tp, tc, dp, dc, st, spec, rows, seed, dseed, rids, smp, dsmp):
            return rs.sd_chunk(tp, tcfg, tc, dp, dcfg, dc, st, spec, rows, seed, dseed, rids, smp,
                               dsmp, **common)
        args = (tparams, tcache, dparams, dcache, state, spec, rows, seed, seed, rids, greedy,
                greedy)
        return fn, args, (1, 3), kv(tcfg) + kv(dcfg)
    fanout = sh.fanout[:K + 1] + (0,) * max(0, K + 1 - len(sh.fanout))
    counters = host(rs.LookupCounters.zeros(K, B))
    from_backup = jax.ShapeDtypeStruct((B,), jnp.bool_)

    def fn(tp, tc, dp, dc, st, spec, rows, fb, counters, seed, dseed, rids, smp, dsmp, c):
        return rs.ssd_chunk(tp, tcfg, tc, dp, dcfg, dc, st, spec, rows, fb, counters, None, seed,
                            dseed, rids, smp, dsmp, c, None, backup="random",
                            fanout_hit=fanout, fanout_backup=fanout, **common)
    args = (tparams, tcache, dparams, dcache, state, spec, rows, from_backup, counters, seed, seed,
            rids, greedy, greedy, shape(np.float32(1.0)))
    return fn, args, (1, 3), kv(tcfg) + kv(dcfg)


def autotune_options(path: str | None, device) -> dict:
    """The XLA options that compile for `device` with the GEMM configurations an autotuner picked
    on a GPU (`path`: the results XLA writes under `--xla_gpu_dump_autotune_results_to`, text or
    binary), every one required: a GEMM the file has no configuration for is an error naming it,
    so that a report never mixes the device's picks with the deviceless heuristics. {} for None.
    A `ValueError` for a device that is no GPU or a file that is not there."""
    if path is None:
        return {}
    if device.platform not in ("cuda", "gpu", "rocm"):
        raise ValueError(f"autotune results are XLA:GPU's GEMM configurations: --autotune takes a "
                         f"GPU target (h100, h200, or local on a GPU), not {device.platform}")
    if not Path(path).is_file():
        raise ValueError(f"--autotune: no such file {path!r} (a GPU run writes one with "
                         f"XLA_FLAGS=--xla_gpu_dump_autotune_results_to=FILE)")
    return {"xla_gpu_load_autotune_results_from": str(Path(path).resolve()),
            "xla_gpu_require_complete_aot_autotune_results": True}


def inspect_step(name: str, cfg, shapes: Shapes = Shapes(), target: str = "local",
                 device=None, ops=None, pair: dict | None = None,
                 autotune: str | None = None) -> ProgramReport:
    """Compile step `name` (STEPS) of the model `cfg` (a `ModelConfig`; its dtype is the weights')
    at `shapes` for `target` (TARGETS) with the backend table `ops` (default: what the engine
    picks there, `default_ops`) and report what the program launches and moves. A chunk (CHUNKS)
    runs the pair {"target": cfg, "draft": ...} `pair` (default: cfg as both). autotune: a GPU's
    autotune results to take the GEMM configurations from (`autotune_options`; default the
    target's own: heuristics without a device, the autotuner on one)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from ssd_jax.algorithm.aot import step_jit

    device = device or target_device(target)
    tuned = autotune_options(autotune, device)
    ops = default_ops(target) if ops is None else ops
    sharding = SingleDeviceSharding(device)
    pair = pair or {"target": cfg, "draft": cfg}
    must = None
    if name in CHUNKS:
        fn, args, donate, kv = _chunk(name, pair, shapes, ops)
        params = (args[0], args[2]) if name != "ar_chunk" else args[0]
        layers = chunk_layers(name, pair, shapes.k)
        models = (pair["target"], pair["draft"]) if name != "ar_chunk" else (cfg,)
        if name != "ar_chunk":  # an iteration reads the draft's weights and KV once a forward
            per = [sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(p)) + _kv_bytes(m, shapes)
                   for p, m in zip(params, models)]
            passes = (layers - models[0].num_layers) // models[1].num_layers
            must = per[0] + passes * per[1]
    else:
        fn, args, donate, kv = _step(name, cfg, shapes, ops)
        params, layers, models = args[0], cfg.num_layers, (cfg,)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    t = time.perf_counter()
    # Pallas's Triton lowering reads the GPU it lowers for from the default device
    with jax.default_device(device):
        lowered = step_jit(fn, donate_argnums=donate).trace(*placed).lower()
    try:
        compiled = lowered.compile(tuned) if tuned else lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA's own error, said in the terms of the call
        if tuned and ("No cached config found" in str(e) or "Failed to get configs" in str(e)):
            raise ValueError(f"--autotune {autotune} has no GEMM configuration for a fusion of "
                             f"{name} at batch {shapes.batch} (results of other programs, shapes "
                             f"or XLA versions): {str(e).splitlines()[0][:300]}") from None
        raise
    return report(name, compiled, cfg, shapes, params, kv, time.perf_counter() - t, layers=layers,
                  cache_elems=tuple(shapes.batch * shapes.max_len * m.num_kv_heads * m.head_dim
                                    for m in models), must_read=must)


def _kv_bytes(cfg, shapes: Shapes) -> int:
    """Bytes of the K and V caches of `cfg` at `shapes`."""
    import jax.numpy as jnp
    return (2 * cfg.num_layers * shapes.batch * shapes.max_len * cfg.num_kv_heads * cfg.head_dim
            * jnp.dtype(cfg.dtype).itemsize)


def report(name: str, compiled, cfg, shapes: Shapes, params, kv_bytes: int,
           compile_s: float = 0.0, *, layers: int | None = None, cache_elems=None,
           must_read: int | None = None) -> ProgramReport:
    """The ProgramReport of a `compiled` step of the model `cfg` at `shapes` whose weights are
    `params` (arrays or shapes; a tuple of two models' for a chunk) and which reads `kv_bytes` of
    KV cache: also for a step compiled elsewhere (the engine's own,
    `steps.decode.jit.trace(...).lower().compile()`). layers: the decoder layers it runs (default
    cfg's); cache_elems: a layer's cache size(s) in elements (default cfg's at `shapes`);
    must_read: the bytes it must move (default the weights plus `kv_bytes`)."""
    import jax

    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    models = params if isinstance(params, tuple) else (params,)
    small = min(x.size * x.dtype.itemsize for p in models for x in jax.tree.leaves(p.layers[0])
                if x.ndim == 2)
    if cache_elems is None:
        cache_elems = shapes.batch * shapes.max_len * cfg.num_kv_heads * cfg.head_dim
    layers = cfg.num_layers if layers is None else layers
    counts = analyse(compiled.as_text(), layers=layers, cache_elems=cache_elems,
                     small_weight_bytes=small)
    accessed = _bytes_accessed(compiled)
    accessed = None if accessed is None else \
        accessed - counts["gather_excess"] + counts["loop_bytes"] + counts["custom_bytes"]
    m = compiled.memory_analysis()
    memory = {} if m is None else dict(arguments=m.argument_size_in_bytes,
                                       outputs=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
                                       temp=m.temp_size_in_bytes)
    must = weights + kv_bytes if must_read is None else must_read
    return ProgramReport(step=name, batch=shapes.batch, layers=layers, **counts,
                         bytes_accessed=accessed, must_read=must,
                         bytes_ratio=None if accessed is None else accessed / must,
                         memory=memory, compile_s=compile_s)


# The default pair's published shapes (HF config.json of Qwen2.5-Coder-1.5B- / 0.5B-Instruct).
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                 num_heads=12, num_kv_heads=2, head_dim=128, tie_embeddings=True)
QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, head_dim=64, tie_embeddings=True)
TARGET_STEPS, DRAFT_STEPS = ("decode", "verify", "prefill"), ("draft", "tree")


def default_pair(dtype: str = "bfloat16", max_len: int = 1024) -> dict:
    """{"target": cfg, "draft": cfg}: the default pair's shapes (weights never loaded)."""
    from ssd_jax.models.config import tiny_config
    return {name: tiny_config("qwen2", rope_theta=1e6, max_position_embeddings=max_len, dtype=dtype,
                              **shape)
            for name, shape in (("target", QWEN_1_5B), ("draft", QWEN_0_5B))}


def inspect_pair(pair: dict, target: str = "local", steps=STEPS, batches=(1, 16),
                 shapes: Shapes = Shapes(), on_report: Callable | None = None,
                 ops=None, autotune: str | None = None) -> list[ProgramReport]:
    """Every step of `steps` at every batch of `batches` for a pair {"target": cfg, "draft": cfg}
    (decode / verify / prefill on the target, draft / tree on the draft), compiled for `target`
    with the backend table `ops` (default `default_ops(target)`) and, given, a GPU's `autotune`
    results (`inspect_step`)."""
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        raise ValueError(f"steps must be a non-empty subset of {', '.join(STEPS)}, got {list(steps)}")
    if not batches or any(int(b) < 1 for b in batches):
        raise ValueError(f"batches must be positive, got {list(batches)}")
    device = target_device(target)
    autotune_options(autotune, device)  # refused before anything compiles
    reports = []
    for b in batches:
        for name in steps:
            cfg = pair["draft"] if name in DRAFT_STEPS else pair["target"]
            r = inspect_step(name, cfg, dataclasses.replace(shapes, batch=int(b)), target, device,
                             ops, pair, autotune)
            reports.append(r)
            if on_report is not None:
                on_report(r)
    return reports


# ------------------------------------------------------------------------------------------------
# ssd-jax inspect
# ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    """The `ssd-jax inspect` flags."""
    p.add_argument("--target", default="h100", choices=TARGETS,
                   help="what to compile for (default h100; `local`: this machine's backend)")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma-separated (default {','.join(STEPS)}: all of them)")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the weights' and caches' dtype (default bfloat16)")
    p.add_argument("--max-len", type=int, default=1024, help="KV cache slots (default 1024)")
    p.add_argument("-k", type=int, default=4, help="draft tokens a round (default 4)")
    p.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"),
                   help="the model ops compiled: auto (default) what the engine picks on the "
                        "target (the Pallas kernels on a GPU), or xla / pallas, to see what a "
                        "kernel replaces")
    p.add_argument("--autotune", default=None, metavar="FILE",
                   help="GPU targets: take every GEMM's configuration from the autotune results a "
                        "GPU run wrote (XLA_FLAGS=--xla_gpu_dump_autotune_results_to=FILE) instead "
                        "of the deviceless heuristics (default: none)")
    p.add_argument("--json", default=None,
                   help="also write the reports to this JSON file (default: none)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return vals


def run(args) -> int:
    """`ssd-jax inspect`: the default pair's steps compiled for --target, one line each."""
    import json

    steps = tuple(s for s in args.steps.split(",") if s)
    if not steps or any(s not in STEPS for s in steps):
        raise ValueError(f"--steps takes a comma-separated subset of {', '.join(STEPS)}, "
                         f"got {args.steps!r}")
    batches = _ints(args.batch, "--batch")
    if args.max_len < 2 or args.k < 1 or args.k + 1 > args.max_len:
        raise ValueError(f"--max-len must be >= 2 and -k in [1, max-len - 1], got --max-len "
                         f"{args.max_len}, -k {args.k}")
    shapes = Shapes(max_len=args.max_len, k=args.k, prompt=min(128, args.max_len))
    ops = default_ops(args.target, args.backend)
    autotune_options(args.autotune, target_device(args.target))
    tuned = f", the GEMMs as tuned in {args.autotune}" if args.autotune else ""
    print(f"ssd-jax inspect: the default pair's shapes ({args.dtype}, {args.max_len} cache slots, "
          f"K={args.k}) compiled for {args.target}, {ops.name} ops{tuned}", flush=True)
    reports = inspect_pair(default_pair(args.dtype, args.max_len), args.target, steps, batches,
                           shapes, on_report=lambda r: print(r.line(), flush=True), ops=ops,
                           autotune=args.autotune)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(target=args.target, backend=ops.name, dtype=args.dtype,
                           max_len=args.max_len, k=args.k, autotune=args.autotune,
                           reports=[dataclasses.asdict(r) for r in reports]), f, indent=1)
    return 0
