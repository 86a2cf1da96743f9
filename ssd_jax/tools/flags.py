"""The flags of the `ssd-jax` commands in the library's messages."""
from __future__ import annotations

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
