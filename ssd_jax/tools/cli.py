"""`ssd-jax`: fetch the default models, generate text with ar | sd | ssd, benchmark them.

Errors a user can trigger (missing model, bad flag values, unfetched weights, mismatched
tokenizers) print one line and exit non-zero, without a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

from ssd_jax.models import registry
from ssd_jax.models.config import canonical_dtype

EXIT_USAGE = 2


def _fanout(text: str) -> tuple[int, ...] | str:
    if text == "plan":  # SSDConfig(fanout="plan"): planned from the engine's own AR and SD runs
        return text
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"fan-out must be comma-separated integers or 'plan', "
                                         f"got {text!r}")


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one line, `ssd-jax: error: ...`, like every other user error."""

    def error(self, message):
        sub = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        where = f"{sub}: " if sub else ""
        print(f"ssd-jax: error: {where}{message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from ssd_jax.tools import bench

    p = _Parser(prog="ssd-jax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    f = sub.add_parser("fetch", help="download, verify and cache default models")
    f.add_argument("names", nargs="*", default=[registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT],
                   help=f"default models: {', '.join(registry.MODELS)} (default: the Qwen pair)")
    f.add_argument("--cache-dir", default=None)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--target", default=registry.DEFAULT_TARGET,
                   help="a default model name, a .gguf file or an HF folder")
    g.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (use --chat to apply the chat template)")
    src.add_argument("--prompt-file", help="a file holding the prompt")
    g.add_argument("--chat", action="store_true")
    g.add_argument("--mode", choices=("ar", "sd", "ssd"), default="ssd")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="auto",
                   help="float32/fp32, bfloat16/bf16, or auto (default): bf16 on an accelerator or "
                        "where the CPU matmul kernel builds, else fp32 (ssd_jax.models.cpu_matmul.fastest_dtype)")
    g.add_argument("--draft-quant", choices=("none", "int8", "int4"), default="none",
                   help="int8: the draft's matmul weights as int8 with per-column scales (half "
                        "bf16's bytes per draft step); int4: its layers as int4 in groups of 32, "
                        "head int8 (models/int4.py). Output stays exact, acceptance may change")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="cut the draft's head to token ids [0, N) (models/draft_head.py): fewer "
                        "bytes per draft step; output stays exact, acceptance may change")
    g.add_argument("--k", type=int, default=4, help="lookahead K (draft tokens per round)")
    g.add_argument("--fanout", type=_fanout, default=None, help="F_0..F_K, e.g. 2,2,1,1,1")
    g.add_argument("--saguaro-c", type=float, default=1.0)
    g.add_argument("--backup", choices=("neural", "random", "ngram"), default="neural")
    g.add_argument("--placement", choices=("split", "colocated"), default="split")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--max-len", type=int, default=4096)
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {text, token_ids, metrics} instead of streaming")
    g.add_argument("--cache-dir", default=None)

    b = sub.add_parser("bench", help="AR, SD and SSD (and HF assisted generation) side by side",
                       description=bench.__doc__.split("\n\n")[0])
    bench.add_arguments(b, _fanout)
    return p


def _fetch(args) -> int:
    for name in args.names:
        path = registry.fetch(name, cache_dir=args.cache_dir)
        print(f"{name}: {path}")
    return 0


def _generate(args) -> int:
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.algorithm.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.fanout == "plan":  # one generate call has no earlier AR and SD runs to plan from
        raise ValueError("--fanout plan needs AR and SD runs to plan from: use it with "
                         "`ssd-jax bench`, or give F_0..F_K")
    prompt = args.prompt
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as fh:
            prompt = fh.read()
    if args.dtype == "auto":
        from ssd_jax.models.cpu_matmul import fastest_dtype
        args.dtype = fastest_dtype()
    args.dtype = canonical_dtype(args.dtype)
    target = load_model(args.target, args.dtype, cache_dir=args.cache_dir)
    draft = None
    if args.mode != "ar":
        draft = load_draft(args.draft, args.dtype, args.draft_quant, args.draft_vocab,
                           cache_dir=args.cache_dir)
    engine = Engine(target, draft, placement=args.placement, max_len=args.max_len)
    tok = target.tokenizer
    streamed: list[int] = []
    printed = [0]

    def on_tokens(row: int, ids: list[int]) -> None:
        streamed.extend(ids)
        text = tok.decode(streamed)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[printed[0]:])
            sys.stdout.flush()
            printed[0] = len(text)

    out = engine.generate(
        [prompt], mode=args.mode, max_new_tokens=args.max_new_tokens, sampling=sampling, k=args.k,
        ssd=SSDConfig(fanout=args.fanout, saguaro_c=args.saguaro_c, backup=args.backup),
        seed=args.seed, stop=args.stop, chat=args.chat, on_tokens=None if args.json else on_tokens)
    if args.json:
        print(json.dumps({"text": out.texts[0], "token_ids": out.token_ids[0],
                          "metrics": {**out.metrics.to_dict(), "dtype": args.dtype}}))
    else:
        sys.stdout.write("\n")
        print(out.metrics.summary(), file=sys.stderr)
    return 0


def _bench(args) -> int:
    from ssd_jax.tools import bench
    return bench.run(args)


def main(argv=None) -> int:
    from ssd_jax.tools.bench import BenchError
    from ssd_jax.tools.benchmark_set import BenchmarkSetError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # recorded by `bench`
    try:
        return {"fetch": _fetch, "generate": _generate, "bench": _bench}[args.command](args)
    except (ValueError, registry.FetchError, FileNotFoundError, OSError, BenchError,
            BenchmarkSetError) as e:
        msg = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
        print(f"ssd-jax: error: {msg}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
