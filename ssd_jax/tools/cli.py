"""`ssd-jax`: fetch the default models, generate text with ar | sd | ssd, benchmark them.

Errors a user can trigger (missing model, bad flag values, unfetched weights, mismatched
tokenizers) print one line and exit non-zero, without a traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import contextlib
import os
import re
import sys

from ssd_jax.models import registry
from ssd_jax.models.config import canonical_dtype
from ssd_jax.runtime.batch import TokenSink
from ssd_jax.runtime.config import BACKUPS
from ssd_jax.tools.flags import DEFAULT_K, default_fanout, naming_flags  # noqa: F401 - cli.DEFAULT_K

EXIT_USAGE = 2


class GenerateError(RuntimeError):
    """The run could not start (e.g. the draft process did not join)."""

def _default_fanout_text() -> str:
    return ",".join(map(str, default_fanout(DEFAULT_K["ssd"]))) + \
        f" at K={DEFAULT_K['ssd']}, i.e. 0 at every position but the last"


def _fanout(text: str) -> tuple[int, ...] | str:
    if text == "plan":  # SSDConfig(fanout="plan"): planned from the engine's own AR and SD runs
        return text
    try:
        f = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"fan-out must be comma-separated integers or 'plan', "
                                         f"got {text!r}")
    if min(f) < 0:
        raise argparse.ArgumentTypeError(f"fan-out entries F_0,..,F_K must be >= 0, got {text!r}")
    return f


# Flags whose value may start with "-" ("--fanout -1,2": argparse would take "-1,2" for an option
# and say only "expected one argument"); `_join_dash_values` hands it to the flag's own check.
_DASH_VALUE_FLAGS = ("--fanout",)


def _join_dash_values(argv: list[str]) -> list[str]:
    """argv with `FLAG -VALUE` written `FLAG=-VALUE` for the flags above when VALUE looks like
    numbers ("-1,2"), so both spellings give the flag's own message."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _DASH_VALUE_FLAGS and i + 1 < len(argv) and \
                re.fullmatch(r"-[0-9][0-9,\s-]*", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _version() -> str:
    """The installed distribution's version (its metadata), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ssd_jax")
    except PackageNotFoundError:
        import ssd_jax
        return ssd_jax.__version__


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one line, `ssd-jax: error: ...`, like every other user error."""

    def error(self, message):
        sub = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        where = f"{sub}: " if sub else ""
        print(f"ssd-jax: error: {where}{message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The `ssd-jax` argument parser (fetch, generate, bench, inspect)."""
    from ssd_jax.tools import bench

    p = _Parser(prog="ssd-jax", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"ssd-jax {_version()}",
                   help="print the installed ssd_jax version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    from ssd_jax.tools.datasets import DATASETS
    f = sub.add_parser("fetch", help="download, verify and cache default models and datasets")
    f.add_argument("names", nargs="*", default=[registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT],
                   help=f"default models: {', '.join(registry.MODELS)} (default: the Qwen pair); "
                        f"datasets of `bench --suite paper`: {', '.join(DATASETS)}")
    f.add_argument("--cache-dir", default=None,
                   help="where models are cached (default $SSD_JAX_HOME or ~/.cache/ssd_jax)")

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text with plain decoding (ar), speculative decoding "
                                   "(sd) or speculative speculative decoding (ssd). Every argument "
                                   "is checked before a model loads.")
    g.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help="the target model: a default model name, a .gguf file, an HF folder, or "
                        "a Hub id Org/Name in the local HF cache ($HF_HOME; never downloaded) "
                        f"(default {registry.DEFAULT_TARGET})")
    g.add_argument("--draft", default=registry.DEFAULT_DRAFT,
                   help="the draft model (sd, ssd), as --target "
                        f"(default {registry.DEFAULT_DRAFT})")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (use --chat to apply the chat template); "
                                      "this or --prompt-file is required, no default")
    src.add_argument("--prompt-file", help="a UTF-8 file holding the prompt (instead of "
                                           "--prompt; no default)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the target tokenizer's chat template, as one user turn")
    g.add_argument("--system", default=None, metavar="TEXT",
                   help="a system prompt before the user turn (implies --chat; default: none)")
    g.add_argument("--mode", choices=("ar", "sd", "ssd"), default="ssd",
                   help="ar: plain decoding; sd: speculative decoding; ssd: speculative "
                        "speculative decoding, the next round pre-drafted while the target "
                        "verifies (default)")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (>= 1; default 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (>= 0; 0 = greedy, the default)")
    g.add_argument("--top-k", type=int, default=0,
                   help="keep the k most likely tokens (>= 0; 0 = off, the default)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass in (0, 1] (1 = off, the default)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    g.add_argument("--backend", default="auto",
                   help="the op table: auto (default: the cpu kernels on a one-device CPU where "
                        "they build, pallas on a GPU, else xla), xla, pallas, or a plug-in "
                        "(ssd_jax.models.backends.backend_names())")
    g.add_argument("--dtype", default="auto",
                   help="weights and activations: float32/fp32, bfloat16/bf16, or auto "
                        "(default): the fastest with this machine's kernels (bf16 where the CPU "
                        "kernels serve AVX-512 BF16 or on a GPU, else fp32; "
                        "ssd_jax.runtime.defaults.choose)")
    g.add_argument("--draft-quant", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="the draft's weights: int8 (per-column scales), int4 (groups of 32, head "
                        "int8), none, or auto (default): the fewest bytes with a fast path here "
                        "(int4 / int8 where the CPU kernels serve AVX-512 VNNI, else none). A "
                        "format without a fast path here runs as none, with one warning. Output "
                        "stays exact, acceptance may change")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="cut the draft's head to token ids [0, N) (models/draft_head.py): fewer "
                        "bytes per draft step; output stays exact, acceptance may change "
                        "(default: the whole head)")
    g.add_argument("--k", type=int, default=None,
                   help=f"lookahead K, draft tokens per round (1..8, the bound "
                        f"ssd_jax.runtime.config.MAX_K; default {DEFAULT_K['sd']} "
                        f"for sd, {DEFAULT_K['ssd']} for ssd)")
    g.add_argument("--fanout", type=_fanout, default=None,
                   help="SSD fan-out F_0..F_K: candidates pre-drafted per outcome position, K+1 "
                        "non-negative integers with a positive sum, e.g. 0,0,0,0,1 (default: "
                        f"{_default_fanout_text()})")
    g.add_argument("--saguaro-c", type=float, default=1.0,
                   help="Saguaro sampling C in (0, 1] (default 1: off)")
    g.add_argument("--backup", choices=BACKUPS, default="neural",
                   help="what SSD proposes after a miss (default neural: the draft; auto: "
                        "chosen each round, ssd_jax.runtime.auto_backup)")
    g.add_argument("--placement", choices=("auto", "split", "colocated", "two-process"),
                   default="auto",
                   help="where target and draft run: two-process (the draft in its own process "
                        "on its own core), split (two meshes in one process), colocated (one "
                        "device), or auto (default): two-process for SSD on a CPU with two "
                        "usable cores, else split; the layout and why go to stderr")
    g.add_argument("--stop", action="append", default=[],
                   help="stop string, the text is cut before it (repeatable; default: none)")
    g.add_argument("--max-len", type=int, default=4096,
                   help="KV cache length: prompt plus new tokens (default 4096)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {text, token_ids, logprobs, finish_reason, "
                        "metrics} instead of streaming the text")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show loading, conversion and compile progress on stderr (default: when "
                        "stderr is a terminal)")
    g.add_argument("--cache-dir", default=None,
                   help="where models are fetched and converted (default $SSD_JAX_HOME or "
                        "~/.cache/ssd_jax)")
    g.add_argument("--step-store", action=argparse.BooleanOptionalAction, default=True,
                   help="keep each compiled step's exported module beside JAX's persistent "
                        "compilation cache, so the next run skips tracing and lowering it "
                        "(default on; ssd_jax.algorithm.aot)")

    b = sub.add_parser("bench", help="AR, SD and SSD (and HF assisted generation) side by side",
                       description=bench.__doc__.split("\n\n")[0])
    bench.add_arguments(b, _fanout)
    from ssd_jax.tools import inspect
    i = sub.add_parser("inspect", help="what each step compiles to for an H100 / H200 / TPU v5e, "
                       "without one", description=inspect.__doc__.split("\n\n")[0])
    inspect.add_arguments(i)
    return p


def _fetch(args) -> int:
    from ssd_jax.tools import datasets
    bad = [n for n in args.names if n not in registry.MODELS and n not in datasets.DATASETS]
    if bad:  # said before anything downloads
        raise ValueError(f"unknown name {bad[0]!r}: default models are "
                         f"{', '.join(registry.MODELS)}; datasets are {', '.join(datasets.DATASETS)}")
    for name in args.names:
        if name in datasets.DATASETS:  # a prompt set (ssd_jax.tools.datasets), else a model
            path = datasets.fetch(name, cache_dir=args.cache_dir)
        else:
            path = registry.fetch(name, cache_dir=args.cache_dir)
        print(f"{name}: {path}")
    return 0


def _validate_generate(args) -> None:
    """Every generate argument, checked before any model loads (a ValueError naming the bad one;
    `_generate` puts the flag in its message, `naming_flags`): the request's rules are the engine's
    own (`ssd_jax.runtime.config.check_request`: mode, max-new-tokens, K, sampling, fan-out,
    Saguaro C, backup, seed, stop, and whether max-new-tokens + K fit --max-len), then the backend, dtype, placement, max-len, draft-vocab
    and cache-dir. The SSD knobs' values are checked in every mode (a bad value is an error even
    where the mode ignores it), but only --mode ssd lets --fanout set K."""
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models import backends
    from ssd_jax.runtime.config import MAX_K, MAX_LEN, SSDConfig, check_request

    if args.fanout == "plan":  # one generate call has no earlier AR and SD runs to plan from
        raise ValueError("--fanout plan needs AR and SD runs to plan from: use it with "
                         "`ssd-jax bench`, or give F_0..F_K")
    if args.k is not None and args.k < 1:
        raise ValueError(f"lookahead K must be an int >= 1, got {args.k}")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.k is None:
        ssd_sets_k = args.mode == "ssd" and args.fanout is not None
        args.k = len(args.fanout) - 1 if ssd_sets_k else DEFAULT_K[args.mode]
        if ssd_sets_k and args.k > MAX_K:
            raise ValueError(f"--fanout has {len(args.fanout)} entries, so K = {args.k}, past the "
                             f"bound MAX_K={MAX_K} (F_0..F_K: K+1 entries)")
    if not 2 <= args.max_len <= MAX_LEN:
        raise ValueError(f"--max-len must be in [2, MAX_LEN={MAX_LEN}] (prompt plus new tokens), "
                         f"got {args.max_len}")
    if any(not s for s in args.stop):
        raise ValueError("--stop needs a non-empty string")
    if args.system is not None and not args.system.strip():
        raise ValueError("--system needs a non-empty system prompt")
    args.fanout_used = args.fanout if args.fanout is not None else default_fanout(args.k)
    ssd = SSDConfig(fanout=args.fanout_used, saguaro_c=args.saguaro_c, backup=args.backup)
    check_request(args.mode, args.max_new_tokens, args.k, sampling, ssd=ssd, seed=args.seed,
                  stop=args.stop, max_len=args.max_len)
    if args.mode != "ssd":  # ignored here, but a bad value is still an error
        SSDConfig(fanout=args.fanout, saguaro_c=args.saguaro_c, backup=args.backup).lists(
            len(args.fanout) - 1 if args.fanout is not None else 1)
    if args.backend not in backends.backend_names():
        raise ValueError(f"unknown --backend {args.backend!r}: choose one of "
                         f"{', '.join(backends.backend_names())}")
    if args.dtype != "auto":
        with _flag("--dtype"):
            args.dtype = canonical_dtype(args.dtype)
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise ValueError(f"the draft head's vocabulary (--draft-vocab) must be >= 1, got "
                         f"{args.draft_vocab}")
    if args.placement == "two-process" and args.mode == "ar":
        raise ValueError("--placement two-process runs a draft in its own process: use it with "
                         "--mode sd or ssd")
    if args.cache_dir is not None and os.path.exists(args.cache_dir) \
            and not os.path.isdir(args.cache_dir):
        raise ValueError(f"--cache-dir {args.cache_dir} is a file, not a folder")
    args.sampling = sampling


def _layout(args):
    """(placement to run, two-process cores or None, the stderr line or None)."""
    from ssd_jax.runtime.defaults import Layout, ssd_layout, usable_cores

    if args.placement == "auto":
        if args.mode != "ssd":
            return "split", None, None
        if args.backend not in ("auto", "cpu"):
            lay = Layout("split", None, f"--backend {args.backend}: the draft's own process "
                                        f"chooses its backend itself; running split in one process")
        else:
            lay = ssd_layout()
        if lay.placement == "two-process":
            return lay.placement, lay.cores, f"ssd-jax: SSD with {lay.reason}"
        return lay.placement, None, f"ssd-jax: SSD with the draft in its own process cannot run " \
                                    f"here: {lay.reason}"
    if args.placement == "two-process":
        cores = usable_cores()
        if len(cores) >= 2:
            return "two-process", (cores[0], cores[1]), (
                f"ssd-jax: {args.mode.upper()} with the draft in its own process on core "
                f"{cores[1]}, the target on core {cores[0]}")
        return "two-process", None, (f"ssd-jax: {args.mode.upper()} with the draft in its own "
                                     f"process; only {len(cores)} usable core, so both processes "
                                     f"share it")
    return args.placement, None, None


def _choose(args, platform=None) -> dict:
    """`defaults.choose` for the flags; its warnings printed as one stderr line each."""
    import warnings
    from ssd_jax.runtime.defaults import choose

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        c = choose(args.backend, args.dtype, args.draft_quant if args.mode != "ar" else "none",
                   platform=platform)
    for note in c["notes"]:
        print(f"ssd-jax: warning: {note.removeprefix('ssd_jax: ')}", file=sys.stderr)
    return c


def _native_stdout_to_stderr() -> None:
    """Native libraries (XLA, the draft process's runtime) may print to file descriptor 1: from
    here on fd 1 is stderr, and `sys.stdout` (the text, the JSON) a copy of the real stdout, so
    `--json` output stays parseable."""
    import os
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(real, "w", buffering=1, encoding="utf-8")


class _Printer(TokenSink):
    """The CLI's streaming callback, on the calling thread (so Ctrl-C stops at once): each
    commit's text to stdout (`ssd_jax.runtime.stream.TextDecoder`: never a split UTF-8
    character, stop strings held back and cut), and the token count to `progress`."""

    def __init__(self, tokenizer, stop, progress, text: bool):
        from ssd_jax.runtime.stream import TextDecoder
        self.decoder, self.progress, self.text = TextDecoder(tokenizer, stop), progress, text

    def commit(self, row, ids, logprobs, finish) -> bool:
        """Print the text `ids` complete (with `text`), count them; never ends the row."""
        self.progress.delta(len(ids), counting=not self.text)
        out = self.decoder.finish(finish, ids) if finish else self.decoder.push(ids)
        if self.text:
            sys.stdout.write(out)
            sys.stdout.flush()
        return True


def _read_prompt_file(path: str) -> str:
    """The text of --prompt-file; a ValueError naming the flag and the file if it cannot be read
    as UTF-8 text."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {os.path.abspath(path)}: not UTF-8 text (byte "
                         f"{e.object[e.start:e.start + 1]!r} at offset {e.start})") from e
    except OSError as e:
        raise ValueError(f"--prompt-file {os.path.abspath(path)}: "
                         f"{e.strerror or type(e).__name__}") from e


@contextlib.contextmanager
def _flag(flag: str):
    """Name `flag` in a file or model error raised inside (the path is in the error already)."""
    try:
        yield
    except (ValueError, OSError) as e:
        if str(e).startswith(flag):
            raise
        kind = ValueError if isinstance(e, ValueError) else OSError
        raise kind(f"{flag}: {e}") from e


def _generate(args) -> int:
    with naming_flags():
        _validate_generate(args)
    prompt = args.prompt
    if args.prompt_file is not None:
        prompt = _read_prompt_file(args.prompt_file)
    if not prompt and not args.chat and args.system is None:
        raise ValueError("the prompt is empty (--prompt / --prompt-file): give at least one "
                         "character, or --chat for the template alone")
    from ssd_jax.models.load import check_source
    from ssd_jax.tools.progress import Progress

    with _flag("--target"):  # a missing, unfetched, empty or truncated model: one line, now,
        check_source(args.target, args.cache_dir)  # before any process starts
    if args.mode != "ar":
        with _flag("--draft"):
            check_source(args.draft, args.cache_dir)
    from ssd_jax.runtime.config import SSDConfig

    request = dict(mode=args.mode, max_new_tokens=args.max_new_tokens, sampling=args.sampling,
                   k=args.k, ssd=SSDConfig(fanout=args.fanout_used, saguaro_c=args.saguaro_c,
                                           backup=args.backup),
                   seed=args.seed, stop=args.stop)
    if args.system is not None:  # a system prompt, then the prompt as the user's turn
        request["messages"] = [{"role": "system", "content": args.system},
                               {"role": "user", "content": prompt}]
    else:
        request.update(prompts=[prompt], chat=args.chat)
    progress = Progress(args.progress)
    placement, cores, line = _layout(args)
    remote = plan = tokenizer = warmup = warm_error = None
    if placement == "two-process":
        _native_stdout_to_stderr()
        # the draft process first, so this process's core pinning covers XLA's threads: the
        # backend and formats are chosen without starting JAX
        choice = _choose(args, platform="cpu")
        from ssd_jax.models.load import load_tokenizer, read_config
        from ssd_jax.runtime.transport import start_two_process
        from ssd_jax.runtime.wire import TransportError
        from ssd_jax.runtime.warmup import call_plan

        # the call's shapes from the target's tokenizer and header, so that the draft process
        # readies its first round's programs while this one loads the target
        with _flag("--target"):
            tokenizer = load_tokenizer(args.target, args.cache_dir)
            target_cfg = read_config(args.target, choice["dtype"], args.cache_dir)
        with naming_flags():  # the call's own checks, before any process starts
            plan = call_plan(tokenizer, target_cfg, max_len=args.max_len, **request)
        try:
            with progress.step(f"starting the draft process ({args.draft})", "draft process ready"):
                remote = start_two_process(args.draft, dtype=choice["dtype"],
                                           quant=choice["draft_quant"],
                                           draft_vocab=args.draft_vocab, cores=cores,
                                           cache_dir=args.cache_dir, step_store=args.step_store)
        except RuntimeError as e:
            raise GenerateError(f"the draft process (--draft {args.draft}) did not start: {e} "
                                f"(--placement split runs in one process)") from e
        if plan is not None:
            try:
                remote.warm(plan)
            except TransportError as e:  # the call meets the failure itself, and says so
                plan, warm_error = None, str(e)
        backend = args.backend  # the target process selects it for its own device
    else:
        choice = _choose(args)
        backend = choice["backend"]
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.defaults import cpu_features
    from ssd_jax.runtime.engine import Engine
    from ssd_jax.runtime.metrics import memory_of

    dtype, quant = choice["dtype"], choice["draft_quant"]
    with progress.step(f"loading target {args.target} ({dtype})", "target loaded"):
        with _flag("--target"):
            target = load_model(args.target, dtype, cache_dir=args.cache_dir,
                                with_tokenizer=tokenizer is None)
    if tokenizer is not None:
        target.tokenizer = tokenizer
    if remote is not None:
        engine = Engine(target, remote_draft=remote, max_len=args.max_len, backend=backend,
                        step_store=args.step_store)
        if plan is not None:
            with progress.step("readying the first round's programs in both processes",
                               "ready"):
                t = engine.warm_up(plan)
                try:
                    d = remote.warmed()
                except TransportError as e:  # the draft process is down: the call falls back
                    d = dict(seconds=0.0, waited_s=0.0, programs={}, error=str(e))
            warmup = dict(target=t, draft=d)
            progress.say(f"  the draft process readied {_programs(d)} in {d['seconds']:.1f} s "
                         f"beside the target's load ({d['waited_s']:.1f} s waited for), the target "
                         f"{_programs(t)} in {t['seconds']:.1f} s"
                         + (f"; the draft's warm-up failed: {d['error']}" if d["error"] else ""))
        elif warm_error is not None:
            progress.say(f"  the draft process could not warm up: {warm_error}")
    else:
        draft = None
        if args.mode != "ar":
            with progress.step(f"loading draft {args.draft} ({dtype}, {quant})", "draft loaded"):
                with _flag("--draft"):
                    draft = load_draft(args.draft, dtype, quant, args.draft_vocab,
                                       cache_dir=args.cache_dir)
        engine = Engine(target, draft, placement=placement, max_len=args.max_len, backend=backend,
                        step_store=args.step_store)
    if line:  # said once the layout runs (errors before this are one line each)
        print(line, file=sys.stderr)
    with progress.generating(warmed=warmup is not None):
        out = engine.generate(**request, on_tokens=_Printer(target.tokenizer, args.stop, progress,
                                                           text=not args.json))
    if args.json:
        out.metrics.memory = memory_of(engine)
        metrics = out.metrics.to_dict()
        metrics.update(dtype=dtype, draft_quant=quant if args.mode != "ar" else None,
                       backend=metrics.get("backend") or engine.backend, placement=placement,
                       cpu_features=cpu_features())
        if warmup is not None:
            metrics["warmup"] = warmup
        print(json.dumps({"text": out.texts[0], "token_ids": out.token_ids[0],
                          "logprobs": [x if math.isfinite(x) else None for x in out.logprobs[0]],
                          "finish_reason": out.finish_reasons[0],
                          "metrics": metrics}))
    else:
        sys.stdout.write("\n")
        print(out.metrics.summary(), file=sys.stderr)
    return 0


def _programs(warmup: dict) -> str:
    """How many programs a warm-up's account compiled or loaded ("3 programs"; a program only
    traced inside another one is not counted)."""
    n = sum(1 for p in warmup["programs"].values() if p["count"])
    return f"{n} program{'s' * (n != 1)}"


def _bench(args) -> int:
    if args.suite == "paper":
        from ssd_jax.tools import bench_paper
        return bench_paper.run(args)
    from ssd_jax.tools import bench
    return bench.run(args)


def main(argv=None) -> int:
    """The `ssd-jax` command: run `argv` (default sys.argv[1:]); user errors print one
    `ssd-jax: error: ...` line and return non-zero."""
    from ssd_jax.tools.bench import BenchError
    from ssd_jax.tools.benchmark_set import BenchmarkSetError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_join_dash_values(argv))
    args.argv = argv  # recorded by `bench`
    from ssd_jax.algorithm import aot
    store = aot.store_dir()  # process-wide: generate's step store must not outlive the call
    try:
        from ssd_jax.tools import inspect
        return {"fetch": _fetch, "generate": _generate, "bench": _bench,
                "inspect": inspect.run}[args.command](args)
    except (ValueError, registry.FetchError, FileNotFoundError, OSError, BenchError,
            BenchmarkSetError, GenerateError) as e:
        msg = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
        print(f"ssd-jax: error: {msg}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, ValueError) else 1
    finally:
        aot.set_store(store)


if __name__ == "__main__":
    sys.exit(main())
