"""The flags the `ssd-jax` commands share: their names in the library's messages, the CLI's
defaults (K, fan-out), and the arguments `generate`, `bench` and `bench --suite paper` parse alike.
Imported by those commands' modules, importing none of them."""
from __future__ import annotations

import argparse
import contextlib
import re

# The library's argument names in its messages, as the flags that set them (one message names
# the flag a user typed: `--max-new-tokens must be an int >= 1`, not `max_new_tokens`).
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
          "top_p": "--top-p", "saguaro_c": "--saguaro-c", "seed": "--seed", "stop": "--stop",
          "backup": "--backup", "max_len": "--max-len", "lookahead K": "--k",
          "fan-out": "fan-out (--fanout)"}
_LIBRARY_NAME = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, _FLAGS)) + r")(?![\w-])")


def as_flags(message: str) -> str:
    """`message` with the first mention of each library argument name replaced by its flag."""
    seen = set()

    def flag(m):
        if m.group(1) in seen:
            return m.group(1)
        seen.add(m.group(1))
        return _FLAGS[m.group(1)]
    return _LIBRARY_NAME.sub(flag, message)


@contextlib.contextmanager
def naming_flags():
    """Around a command's argument checks: a ValueError raised inside comes out `as_flags`."""
    try:
        yield
    except ValueError as e:
        raise ValueError(as_flags(str(e))) from e


# The CLI's lookahead K per mode and its SSD fan-out, as measured best on a 2-core Xeon
# (benchmarks/README.md at 8faea7c, "CLI defaults"): SD at K=4; SSD at K=5 with the narrow fan-out
# 0,...,0,1 (pre-draft only the all-accepted outcome: a wide tree outlasts the verify on a CPU).
DEFAULT_K = {"ar": 4, "sd": 4, "ssd": 5}


def default_fanout(k: int) -> tuple[int, ...]:
    """The CLI's SSD fan-out at lookahead `k` when --fanout is not given: F_0..F_{K-1} = 0,
    F_K = 1 (one tree branch, for the outcome where every draft token is accepted)."""
    return (0,) * int(k) + (1,)


def resolve_formats(args, default_dtype: str, default_quant: str) -> None:
    """--dtype / --draft-quant: None takes the defaults given, "auto" what
    ssd_jax.runtime.defaults.choose picks for a CPU process (without starting JAX)."""
    from ssd_jax.models.config import canonical_dtype
    from ssd_jax.runtime.defaults import choose

    dtype = args.dtype or default_dtype
    quant = args.draft_quant or default_quant
    if "auto" in (dtype, quant):
        c = choose("auto", dtype, quant, platform="cpu")
        dtype, quant = c["dtype"], c["draft_quant"]
    args.dtype, args.draft_quant = canonical_dtype(dtype), quant


def add_suite_arguments(b: argparse.ArgumentParser) -> None:
    """`--suite`, `--datasets`, `--per-dataset` on the bench parser."""
    from ssd_jax.tools.datasets import PAPER_SUITE

    def names(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
        bad = [x for x in items if x not in PAPER_SUITE]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"--datasets must be a comma-separated subset of "
                                             f"{','.join(PAPER_SUITE)}, got {text!r}")
        return items

    b.add_argument("--suite", choices=("paper",), default=None,
                   help="paper: the paper's table per dataset (ssd_jax.tools.bench_paper): AR and "
                        "SD on core A, SSD adding the draft's core B (default: no suite, the "
                        "benchmark set or --prompts-file)")
    b.add_argument("--datasets", type=names, default=PAPER_SUITE,
                   help=f"--suite paper: comma-separated subset of {','.join(PAPER_SUITE)} "
                        "(default all, the paper's order)")
    b.add_argument("--per-dataset", type=int, default=8, metavar="N",
                   help="--suite paper: the first N prompts of each set's sample (default 8; the "
                        "paper: 128)")
