#!/usr/bin/env bash
# Interleaved A/B of the CLI's load (issue 33's "load time not slower"): the default target's AR
# call, restore path (each side's conversion cache written first: the formats differ, so each
# keeps its own entry), alternating OLD / NEW worktrees REPS times per dtype.
# Usage: benchmarks/load_time_ab.sh OLD_WORKTREE NEW_WORKTREE [REPS] [DTYPES...]  > out.txt
# SSD_JAX_HOME: the cache root both sides use (default ~/.cache/ssd_jax).
set -u
echo 1000 > /proc/self/oom_score_adj 2>/dev/null || true  # if memory runs out, these runs go first
OLD=$1 NEW=$2 REPS=${3:-3}; shift 3 2>/dev/null || shift $#
DTYPES=${*:-bfloat16 float32}
run() {  # side dtype label
  local dir=$1 dt=$2 label=$3 err out
  err=$(mktemp) out=$(mktemp)
  ( cd "$dir" && . .venv/bin/activate && /usr/bin/time -v ssd-jax generate --target qwen2.5-coder-1.5b \
      --mode ar --max-new-tokens 8 --dtype "$dt" --prompt "def fibonacci(n):" --json --progress \
      >"$out" 2>"$err" )
  python3 - "$label" "$dt" "$out" "$err" <<'PY'
import json, re, sys
label, dt, out, err = sys.argv[1:]
e = open(err).read()
wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", e).group(1)
m, s = wall.split(":")[-2:]
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", e).group(1)) * 1024 / 1e9
load = re.search(r"target loaded in ([\d.]+) s", e)
conv = "converting" in e
try:
    d = json.loads(open(out).read().strip().splitlines()[-1])
    ids, comp = d["token_ids"], d["metrics"].get("compile_s")
except Exception as x:  # noqa: BLE001
    ids, comp = f"no json ({x}); stderr tail: {e[-400:]!r}", None
print(f"{label:5s} {dt:9s} wall_s={int(m) * 60 + float(s):6.1f} load_s={load.group(1) if load else '-':>5s} "
      f"compile_s={comp if comp is None else round(comp, 2)} peak_rss_GB={rss:.2f} "
      f"{'first-load ' if conv else ''}ids={ids}", flush=True)
PY
  rm -f "$err" "$out"
}
echo "# load_time_ab.sh $OLD (old: $(git -C "$OLD" rev-parse --short HEAD)) vs $NEW (new: $(git -C "$NEW" rev-parse --short HEAD)), $(date -u +%FT%TZ)"
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; features: $(grep -o 'avx512[a-z_0-9]*\|amx[a-z_]*\|avx2' /proc/cpuinfo | sort -u | xargs)"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for dt in $DTYPES; do
  run "$OLD" "$dt" warm-old; run "$NEW" "$dt" warm-new  # caches written (a first load when absent)
  for i in $(seq "$REPS"); do run "$OLD" "$dt" old; run "$NEW" "$dt" new; done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
