"""What the prefill bucket costs the engine's statistical cases: SD and SSD runs of the cases' own
pair (tests/_engine_stats.py) with the smallest prefill bucket at 16 (the engine's), 8 and 4.

    python benchmarks/prefill_bucket_ab.py               # 20,000 requests a run, two passes
    python benchmarks/prefill_bucket_ab.py --rows 5000 --passes 1

The cases' prompt has 3 tokens, which the engine pads to its smallest prefill bucket, 16; each
setting is patched into `ssd_jax.runtime.request.prefill_bucket` in turn, and the settings
alternate within each pass (interleaved, so the shared machine's drift falls on all of them). SD
reads tokens 1-4 (`sd-t1.0`), SSD tokens 5-8 with fan-out (2, 2, 1) and Saguaro C = 0.5
(`ssd-t0.7-saguaro0.5`'s configuration at T = 1). Each run is preceded by a warm-up of one chunk
(its compiles), so the timed run is steady state; the checksum of the first 2,000 windows shows
the tokens do not depend on the bucket.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000, help="requests per timed run")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 8, 4])
    a = ap.parse_args(argv)
    if a.rows < 1 or a.passes < 1 or any(b < 1 for b in a.buckets):
        ap.error("--rows, --passes and --buckets must be >= 1")

    import _engine_stats as es

    from ssd_jax.runtime import request
    from ssd_jax.runtime.defaults import describe
    from ssd_jax.runtime.engine import SSDConfig

    print(f"# cpu: {describe()}; {os.cpu_count()} cores", flush=True)
    pair = es.make_pair()
    runs = {"sd": {}, "ssd": {"skip": 4, "ssd": SSDConfig(fanout=(2, 2, 1), saguaro_c=0.5)}}
    print("pass  bucket  mode  seconds  checksum")
    for p in range(a.passes):
        for b in a.buckets:
            request.prefill_bucket = lambda n, b=b: max(b, 1 << (n - 1).bit_length())
            for mode, kw in runs.items():
                es.sample_windows(pair, mode, es.T10, n=es.CHUNK, **kw)  # compiles
                t0 = time.perf_counter()
                toks, _ = es.sample_windows(pair, mode, es.T10, n=a.rows, **kw)
                print(f"{p:4d}  {b:6d}  {mode:4s}  {time.perf_counter() - t0:7.2f}  "
                      f"{int(toks[:2000].sum())}", flush=True)


if __name__ == "__main__":
    main()
