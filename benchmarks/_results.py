"""The files a study script leaves in benchmarks/results/: `<script>-<time>.json` (the command,
date, CPU features and load average, the script's own payload, and the printed report),
`<script>-<time>.md` (the command and the report) and, when the script plots, a `.png`."""
from __future__ import annotations

import datetime
import json
import os
import sys
import time


def write_results(script: str, out: str, payload: dict, text: str, plot=None,
                  name: str | None = None, stem: str | None = None) -> str:
    """Write the result files of benchmarks/`script`.py into `out`; returns their path stem.

    payload: the JSON's own keys beside `meta` and `report` (e.g. `results`); plot: a function of
    the .png path, or None; name: the files' name before the time (default `script`); stem: the
    files' own path without the extension instead of `out`/`name`-`time` (a result named once,
    e.g. a commit's "before" numbers)."""
    from ssd_jax.runtime.defaults import cpu_features
    if stem is None:
        stem = os.path.join(out, f"{name or script}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    meta = dict(command=f"python benchmarks/{script}.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                cpu_features=cpu_features(), loadavg=os.getloadavg())
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, **payload, report=text), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"`{meta['command']}`\n\n{text}\n")
    if plot is not None:
        plot(stem + ".png")
    print(f"\nwrote {stem}.json / .md" + (" / .png" if plot is not None else ""))
    return stem
