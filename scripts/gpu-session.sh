#!/usr/bin/env bash
# One GPU session for kv-sidecar, in one call on the H200 (or any CUDA host): every step runs even when an
# earlier one failed, each under a timeout bounded by the session's budget, then a summary.
#
#   steps: env -> install (wheels from .whl, unless nixl/zmq/msgspec import already)
#          -> slice   pytest -m gpu tests/gpu          (3/6 item 7; per-stage timings -> $OUT/gpu-slice.json)
#          -> e2e     bench e2e, one-GPU dry run      (6/6; -> $OUT/e2e-cuda0-cuda0.json, UCX transports)
#          -> pull    bench pull --device cuda        (-> $OUT/pull-cuda.json)
#          -> suite   pytest -m gpu on the rest of the suite (modules whose imports are missing are ignored)
#   $OUT gets at most 5 files: the 3 JSON results, summary.txt and logs.tar.gz (every step's log, the UCX
#   and daemon logs of the benches).
#
# First, here: ../shared/tools/gpu-wheels.sh && python3 scripts/slim-wheels.py   (.whl under the 64 MiB carry)
# On the device machine:  bash scripts/gpu-session.sh          (carry: .whl)
# Elsewhere:              OUT=/tmp/out PYTHON=.venv/bin/python bash scripts/gpu-session.sh
#   (without a GPU the GPU steps skip cleanly; the pytest steps still show that the tests skip).
# Knobs: GPU_SESSION_BUDGET_S (default 500: the whole session), E2E_ARGS (replaces the dry run's sizes),
#   GPU_SESSION_CPU=1 (run the e2e and pull benches on the CPU instead: to try this script without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-session-out}
BUDGET_S=${GPU_SESSION_BUDGET_S:-500}
RESERVE_S=20 # for the summary and the log archive
START=$(date +%s)
WORK=$(mktemp -d /tmp/kv-sidecar-gpu-XXXXXX)
LOGS=$WORK/logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y # one GPU: without it UCX falls back to tcp (0.4-0.6 GB/s)
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
SUMMARY=()

pack_logs() {
  # keep every log, but none over 8 MiB (the tail is what matters), in one archive
  find "$LOGS" -type f -size +8M -exec sh -c 'tail -c 8M "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null || echo "could not pack the logs"
  rm -rf "$WORK"
}
trap pack_logs EXIT

elapsed() { echo $(($(date +%s) - START)); }

# step NAME MAX_S CMD...: run CMD (a program, not a function) under `timeout`, its output in $LOGS/NAME.log,
# the last lines echoed; the status goes into the summary. A step starts only with >= 20 s of budget left.
step() {
  local name=$1 max=$2
  shift 2
  local left=$((BUDGET_S - $(elapsed) - RESERVE_S))
  local t=$((max < left ? max : left))
  if ((t < 20)); then
    SUMMARY+=("$(printf '%-8s %-8s %5ss  %s' "$name" SKIP 0 'the session budget is spent')")
    return 0
  fi
  echo "=== [$(elapsed)s] $name (timeout ${t}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout -k 10 "$t" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL_LINES:-25}" "$LOGS/$name.log"
  local what=ok
  ((rc == 124 || rc == 137)) && what=TIMEOUT
  ((rc != 0 && rc != 124 && rc != 137)) && what="rc=$rc"
  SUMMARY+=("$(printf '%-8s %-8s %5ss' "$name" "$what" $(($(date +%s) - t0)))")
  return 0
}

skip() { SUMMARY+=("$(printf '%-8s %-8s %5ss  %s' "$1" SKIP 0 "$2")"); }

# --- env ------------------------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  nvidia-smi topo -m 2>&1 | head -20 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpus", torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>&1
} | tee "$LOGS/env.log"

# --- install --------------------------------------------------------------------------------------------
export PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if "$PY" -c 'import nixl, zmq, msgspec' >/dev/null 2>&1; then
  skip install "nixl, pyzmq and msgspec import already"
elif compgen -G ".whl/*.whl" >/dev/null; then
  step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
else
  skip install "no .whl folder: run ../shared/tools/gpu-wheels.sh and scripts/slim-wheels.py here, carry .whl"
fi
"$PY" -m sidecar.cli version >>"$LOGS/env.log" 2>&1 && tail -n 12 "$LOGS/env.log"

HAVE_GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
DEV=cuda:0
PULL_DEV=cuda
if [[ ${GPU_SESSION_CPU:-0} == 1 ]]; then
  HAVE_GPU=1 DEV=cpu PULL_DEV=cpu
  unset UCX_CUDA_IPC_ENABLE_GET_ZCOPY # unused without cuda_ipc: UCX would warn about it on stdout
fi
E2E_OUT=$OUT/e2e-${DEV//:/}-${DEV//:/}.json
PULL_OUT=$OUT/pull-$PULL_DEV.json

# --- 3/6 item 7: the slice on one GPU -------------------------------------------------------------------
# KV_SIDECAR_BENCH_OUT only here: the daemon refuses unknown KV_SIDECAR_* variables (the test hides it from
# the daemons it starts; other tests' daemons would not).
step slice 170 env KV_SIDECAR_BENCH_OUT="$OUT/gpu-slice.json" \
  "$PY" -m pytest -m gpu -p no:cacheprovider -rA --durations=10 tests/gpu

# --- 6/6 dry run: both roles on cuda:0 -------------------------------------------------------------------
if [[ $HAVE_GPU == 1 ]]; then
  E2E_MAX=220
  left=$((BUDGET_S - $(elapsed) - RESERVE_S))
  e2e_t=$((E2E_MAX < left ? E2E_MAX : left))
  # shellcheck disable=SC2206
  E2E=(${E2E_ARGS:---contexts 4096,16384 --concurrency 1,8,32 --max-batch-tokens 131072
    --pairs direct/random,staged/random,staged/contiguous --reps 2 --warmup 1})
  TAIL_LINES=40 step e2e "$E2E_MAX" "$PY" -m sidecar.bench.e2e --prefill-device "$DEV" --decoder-device "$DEV" \
    "${E2E[@]}" --budget-s $((e2e_t > 120 ? e2e_t - 60 : e2e_t / 2)) --logs "$LOGS/e2e" --out "$E2E_OUT"
else
  skip e2e "no CUDA device"
fi

# --- bench pull on the GPU -------------------------------------------------------------------------------
if [[ $HAVE_GPU == 1 ]]; then
  # UCX logs to stdout by default, where bench pull's target announces itself: send UCX's lines to a file
  step pull 100 env UCX_LOG_FILE="$LOGS/ucx-pull-%p.log" \
    "$PY" -m sidecar.cli bench pull --device "$PULL_DEV" --out "$PULL_OUT"
else
  skip pull "no CUDA device"
fi

# --- the rest of the suite's GPU tests --------------------------------------------------------------------
# Collection imports every test module: ignore those whose imports this machine lacks (e.g. the deploy
# tests' kubernetes-validate), and say which.
mapfile -t IGNORES < <("$PY" - <<'EOF'
import ast, importlib.util, pathlib, sys
ours = {"tests", "sidecar", "vllm_glue"}
for path in sorted(pathlib.Path("tests").rglob("*.py")):
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        continue
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    missing = sorted(n for n in names - ours if importlib.util.find_spec(n) is None)
    if missing:
        target = path.parent if path.name == "conftest.py" else path
        gpu = "gpu" in path.read_text()
        print(f"--ignore={target}")
        print(f"  ignored {target}: no {', '.join(missing)}{' (mentions gpu!)' if gpu else ''}", file=sys.stderr)
EOF
)
step suite 300 "$PY" -m pytest -m gpu -p no:cacheprovider -rA --durations=15 --ignore=tests/gpu "${IGNORES[@]}" tests

# --- summary --------------------------------------------------------------------------------------------
{
  echo
  echo "=== kv-sidecar GPU session: $(elapsed)s of ${BUDGET_S}s"
  printf '%s\n' "${SUMMARY[@]}"
  OUT="$OUT" E2E_OUT="$E2E_OUT" PULL_OUT="$PULL_OUT" "$PY" - <<'EOF'
import json, os
out = os.environ["OUT"]

def load(name):
    try:
        with open(os.path.join(out, os.path.basename(name))) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        print(f"{name}: {exc}")
        return None

s = load("gpu-slice.json")
for mode, d in (s or {}).get("modes", {}).items():
    for rnd in ("cold", "warm"):
        r = d.get(rnd, {})
        st = r.get("stages_ms", {})
        p50 = lambda k: st.get(k, {}).get("p50", float("nan"))
        print(f"slice {mode:6} {rnd}: {r.get('requests')} requests bit-exact={r.get('bit_exact')} "
              f"{r.get('GBps', 0):.2f} GB/s; p50 ms: transfer {p50('transfer'):.2f} convert {p50('convert'):.2f} "
              f"end_to_end {p50('end_to_end'):.2f}")
    print(f"slice {mode:6} UCX reads: {d.get('transports', {}).get('read_transports')}")
e = load(os.environ["E2E_OUT"])
if e:
    if e.get("error"):
        print(f"e2e error: {e['error']}")
    for c in e.get("cells", []):
        head = f"e2e {c['mode']:6} {c['order']:10} {c['context']:>5} x{c['concurrency']:<2}"
        if "skipped" in c:
            print(f"{head} skipped: {c['skipped'][:90]}")
            continue
        ms = c["must_show"]
        ratio = ms["nixl_over_peer"]
        print(f"{head} peer {c['peer_copy']['GBps']:7.1f} | bare {c['bare']['GBps']:7.2f} GB/s "
              f"({c['bare']['descriptors_per_request']} descs/req) | kv-sidecar {c['sidecar']['GBps']:7.2f} GB/s "
              f"x{ms['sidecar_over_bare']:.3f} | nixl/peer {ratio if ratio is None else round(ratio, 4)} | "
              f"mismatches {c['verified'].get('mismatches')}")
    for role, t in e.get("transports", {}).items():
        print(f"e2e UCX reads of {role}: {t.get('read_transports')} notes: {t.get('notes', [])[:2]}")
    print(f"e2e must-show misses: {len(e.get('must_show_failures', []))}")
p = load(os.environ["PULL_OUT"])
for mode, r in (p or {}).get("throughput", {}).items():
    g = r["GBps"]
    print(f"pull {mode:6}: ours {g['ours']:.2f} bare {g['bare']:.2f} single {g['single']:.2f} GB/s, "
          f"ours/bare {r['ours_over_bare']:.3f}")
EOF
  echo "files in \$OUT: $(ls "$OUT" | tr '\n' ' ') logs.tar.gz"
} 2>&1 | tee "$OUT/summary.txt"
