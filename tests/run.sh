#!/usr/bin/env bash
# The test suite in its two passes (README "Test"), each in a virtual environment of its own:
#   main   Python 3.12 and the newest jax / jaxlib / flax / orbax-checkpoint pip resolves within
#          pyproject's pins: the whole suite except the tests marked `oracle` (HF transformers on
#          torch, whose CPU build is kept on CI's disk for Python 3.11 only; on 3.12 pip would fetch
#          a CUDA build of several GB), then JAX's CUDA plugin and the `gpu_aot` tests.
#   floor  Python 3.11 and the oldest versions pyproject admits (tests/floor-constraints.txt), with
#          the oracle: every `oracle` test, then the engine, the exactness quick loop, loading,
#          checkpoints, the golden ids and the real models again on the old JAX, then the model
#          and engine tests with the CPU kernels built for AVX2 only (on a CPU with AVX-512).
#          When both passes run, its environment is installed while the main pass's tests run.
# SSD_JAX_TEST_PASSES="main" (or "floor") runs one; PYTHON312 / PYTHON311 name the interpreters.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # $1: "3.12"; $2: an interpreter the caller named (may be empty)
  local want=$1 p
  for p in "${2:-}" "python$want" "$(pyenv root 2>/dev/null)/versions/$want"*/bin/"python$want"; do
    if [ -n "$p" ] && "$p" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$want')" 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  echo "tests/run.sh: no Python $want found (name one: PYTHON${want/./}=/path/to/python$want)" >&2
  return 1
}

venv() {  # $1: folder, $2: interpreter; leaves it activated
  "$2" -m venv --clear "$1"  # a folder left by another Python is made anew
  . "$1/bin/activate"
  python -m pip install -q --upgrade pip
}

floor_env() {  # $1: the Python 3.11 interpreter; the floor pass's environment, made and installed
  venv .venv-floor "$1"
  python -m pip install -q -c tests/floor-constraints.txt -e ".[test,oracle]"
}

# The floor pass's environment is made in the background while the main pass's tests run: its
# install took ~90 s of wall clock, ~85 s of it one core's work (unpacking, byte-compiling), so
# beside the tests it costs them about half that. It starts after the main pass's own install (two
# editable installs of one source tree at once would share its egg-info), and is waited for before
# any other install and before the floor pass.
FLOOR_ENV_PID="" FLOOR_ENV_LOG="" FLOOR_ENV_READY=""
trap 'if [ -n "$FLOOR_ENV_PID" ]; then wait "$FLOOR_ENV_PID" || true; fi' EXIT  # no install left behind
start_floor_env() {
  local py
  py=$(find_python 3.11 "${PYTHON311:-}")  # a missing interpreter fails here, before any test
  FLOOR_ENV_LOG=$(mktemp)
  ( floor_env "$py" ) >"$FLOOR_ENV_LOG" 2>&1 &
  FLOOR_ENV_PID=$!
}
wait_floor_env() {  # returns non-zero, with the install's output, if making it failed
  [ -n "$FLOOR_ENV_PID" ] || return 0
  local pid=$FLOOR_ENV_PID
  FLOOR_ENV_PID=""
  if ! wait "$pid"; then
    cat "$FLOOR_ENV_LOG" >&2
    echo "tests/run.sh: making the floor pass's environment (.venv-floor) failed: its output is above" >&2
    return 1
  fi
  FLOOR_ENV_READY=1
}

main_pass() {  # $1: "floor" if the floor pass follows (its environment is made meanwhile)
  venv .venv "$(find_python 3.12 "${PYTHON312:-}")"
  python -m pip install -q -e ".[test]"
  if [ "${1:-}" = floor ]; then start_floor_env; fi
  python -c "import jax, jaxlib, flax, orbax.checkpoint as o, sys; print('main pass: Python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'orbax-checkpoint', o.__version__)"
  ssd-jax fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m humaneval sharegpt mt-bench asdiv
  python -m pytest -n 2 -m "not real_weights and not oracle and not gpu_aot"
  python -m pytest -n 2 -m "real_weights and not alone and not oracle"
  # then JAX's CUDA plugin and libtpu (the `inspect` extra, ~850 MB) and what compiles for an
  # H100 or a TPU v5e without one; installed last so that the suite above runs as a CPU user's
  # install does
  wait_floor_env
  python -m pip install -q -e ".[inspect]"
  python -m pytest -n 2 -m gpu_aot
  deactivate
}

FLOOR_MODULES=(tests/unit/test_generate.py tests/statistical/test_engine_exactness.py
               tests/unit/test_golden_ids.py tests/real_weights/test_loading.py
               tests/unit/test_checkpoint.py tests/unit/test_tokenizer.py
               tests/unit/test_model_oracle.py tests/unit/test_api.py)

floor_pass() {
  wait_floor_env
  if [ -n "$FLOOR_ENV_READY" ]; then
    . .venv-floor/bin/activate
  else
    floor_env "$(find_python 3.11 "${PYTHON311:-}")"
  fi
  python -c "import jax, jaxlib, flax, orbax.checkpoint as o, sys; print('floor pass: Python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'orbax-checkpoint', o.__version__)"
  ssd-jax fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m
  python -m pytest -n 2 -m "not real_weights and (oracle or not slow)" "${FLOOR_MODULES[@]}"
  # the real weights on the old JAX: loading (orbax, the conversion cache) and the real models;
  # the CLI's real-weight tests (pure Python over the engine tested above) run in the main pass
  python -m pytest -n 2 -m "real_weights and not alone and (oracle or not slow)" \
    tests/real_weights/test_loading.py tests/real_weights/test_real_models.py
  python -m pytest -m alone tests/real_weights/test_real_models.py  # its one module: no whole-suite collection
  # The portable path and the backend / dtype / draft-format selection: the model and engine tests
  # again with the CPU kernels built for AVX2 only (SSD_JAX_CPU_ISA=avx2 compiles out the AVX-512
  # BF16 / VNNI paths and ssd_jax.runtime.defaults masks those features, so everything is chosen as
  # on a CPU without them). The algorithm's rules do not depend on the ISA; the kernels' numerics do.
  # On a CPU without AVX-512 the passes above ran that path already, so it is not run twice.
  if python -c "import sys; from ssd_jax.runtime.defaults import AVX512, cpu_features; f = cpu_features(); sys.exit(not any(f[x] for x in AVX512))"; then
    SSD_JAX_CPU_ISA=avx2 python -m pytest -q -n 2 -m "not slow" tests/unit/test_backends.py \
      tests/unit/test_generate.py tests/unit/test_model_oracle.py tests/unit/test_defaults.py
  else
    echo "floor pass: this CPU has no AVX-512 ($(python -c 'from ssd_jax.runtime.defaults import describe; print(describe())')): the AVX2-only path ran above"
  fi
  deactivate
}

PASSES=(${SSD_JAX_TEST_PASSES:-main floor})
for i in "${!PASSES[@]}"; do
  pass=${PASSES[$i]}
  case "$pass" in
    main) main_pass "${PASSES[$((i + 1))]:-}" ;;
    floor) floor_pass ;;
    *) echo "tests/run.sh: unknown pass '$pass' (main, floor)" >&2; exit 2 ;;
  esac
done
