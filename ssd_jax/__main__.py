"""`python -m ssd_jax ...` is the `ssd-jax` command."""
from ssd_jax.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
