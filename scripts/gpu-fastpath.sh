#!/usr/bin/env bash
# Issue 12/13 evidence on one H200 in one device call (carry: .whl): each step under its own timeout, every
# step runs even when an earlier one failed, results as JSON under $OUT (packed into fastpath-out.tar.gz when
# there are more than the device hands back, 8), a one-line status per step at the end.
#
#   bash scripts/gpu-fastpath.sh STEP...
#   steps: tests launchtests graphtests daemontests launch graphlaunch sweep convertgraph contiguous defaults
#          graphsab groupsab gilab headcheck ab orders groups poll interference profile daemonprofile map
#          mapped lingerab convertlead convertsweep pieces loopbench
#          coldab alltests peertests hops queuepieces fireparts gatestests gatesab directgatesab
#          gateprobe percallpieces hazardtests convertfired connab loadingab shapetests
# Knobs: FASTPATH_BUDGET_S (default 560: the whole call), GROUPS_SWEEP (layer groups the groups step runs).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-fastpath-out}
BUDGET_S=${FASTPATH_BUDGET_S:-560}
START=$(date +%s)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y NIXL_LOG_LEVEL=WARN
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
STATUS=()
# the GPU's model in every result name (h100, h200): a kind may be lent as either
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o 'H[0-9]\+' | head -n 1 | tr 'H' 'h')
GPU_TAG=${GPU_TAG:-gpu}
ONE_GPU=(python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 --warmup 1)
E2E=("${ONE_GPU[@]}" --daemon-set nixl_num_threads=4)
CONTIGUOUS_CELLS=(--contexts 4096,16384 --concurrency 1,8 --reps 10 --pairs staged/contiguous)
# scattered orders draw their blocks from a prefill pool 4 x the batch, into staging 2 x it (room for gaps)
SCATTERED_POOLS=(--max-batch-tokens 65536 --prefill-pool-factor 4 --staging-factor 2)

# run NAME MAX_S CMD...: CMD's output to $OUT/NAME.log (its tail echoed), bounded by what the call has left.
run() {
  local name=$1 max=$2
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - START) - 10))
  local t=$((max < left ? max : left))
  if ((t < 20)); then
    STATUS+=("$name: skipped, the call's budget is spent")
    return
  fi
  echo "=== [$(($(date +%s) - START))s] $name (timeout ${t}s)"
  timeout -k 5 "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "━\|─" "$OUT/$name.log" | tail -n "${TAIL:-12}"
  STATUS+=("$name: rc=$rc")
}

for step in "$@"; do
  case $step in
    # every GPU test of the repository (390-460 s on an H100: 450 s cut the last two off once; run it with
    # FASTPATH_BUDGET_S=590 and alone)
    alltests) TAIL=12 run alltests 570 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE --durations=8 \
      tests/sidecar tests/gpu ;;
    # where a lone pull's round trip goes (delivery, the daemon, return, the rest), staged and mapped
    # the daemon's and NIXL's GPU tests and every real-process one, not the converter kernels' own (about half
    # of alltests' time): for changes to the daemon, the peers or the mapped path
    peertests) TAIL=20 run peertests 420 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE --durations=8 \
      tests/gpu/test_gpu_mapped.py tests/sidecar/wire tests/sidecar/nixl tests/sidecar/daemon tests/gpu ;;
    # the converter's tiling of pages off the powers of two, with the graph launches that share it
    shapetests) TAIL=12 run shapetests 200 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE --durations=5 \
      tests/sidecar/convert/test_convert_graphs_gpu.py tests/sidecar/convert/test_convert_triton.py \
      -k "graphs or off_the_powers or 8-16-128-bfloat16 or 3-32-64-float16" ;;
    hops) TAIL=8 run hops 100 "${ONE_GPU[@]}" --contexts 4096,16384 --concurrency 1,8 --reps 10 \
      --pairs staged/contiguous,mapped/contiguous --budget-s 85 --out "$OUT/e2e-$GPU_TAG-hops.json" ;;
    tests) run tests 360 python3 -m pytest -m gpu -p no:cacheprovider -q tests/sidecar/convert \
      tests/sidecar/daemon tests/gpu/test_gpu_slice.py ;;
    launchtests) TAIL=40 run launchtests 100 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
      tests/sidecar/convert/test_convert_launch_gpu.py tests/sidecar/convert/test_convert_src_index.py ;;
    graphtests) TAIL=30 run graphtests 200 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
      tests/sidecar/convert/test_convert_graphs_gpu.py tests/sidecar/convert/test_convert_launch_gpu.py \
      tests/gpu/test_gpu_slice.py ;;
    daemontests) TAIL=20 run daemontests 260 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
      tests/sidecar/daemon tests/gpu/test_gpu_slice.py tests/gpu/test_gpu_tp.py ;;
    defaults) TAIL=30 run defaults 160 python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 \
      --warmup 1 --contexts 4096,16384 --concurrency 1,8 --reps 10 --pairs staged/contiguous,direct/contiguous \
      --budget-s 140 \
      --out "$OUT/e2e-$GPU_TAG-contiguous-defaults.json" ;;
    graphlaunch) run graphlaunch 90 python3 -m sidecar.cli bench launch --iters 200 --modes staged,staged_gaps \
      --paths new,graph,graphcap --graph-programs 1056 --out "$OUT/launch-probe-$GPU_TAG-graphcap.json" ;;
    convertgraph) run convertgraph 120 python3 -m sidecar.cli bench convert --device cuda --dtype bfloat16 \
      --shapes qwen3-8b-4k,qwen3-8b-16k --no-plot --reps 40 --tag "$GPU_TAG-graph-per-call" --out-dir "$OUT" \
      --variant default: --variant p1056:oop_max_programs=1056 ;;
    # one layer group against four, graphs on, groups converting as they land during the post; with four,
    # each cell's landing_spread (Done timings) says whether the groups land one after another or together
    groupsab) for g in 1 4; do
        TAIL=14 run "groups-ab$g" 100 python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 \
          --warmup 1 --contexts 4096,16384 --concurrency 1,8 --reps 10 --pairs staged/contiguous \
          --layer-groups "$g" --budget-s 80 --out "$OUT/e2e-$GPU_TAG-groups-ab$g.json"
      done ;;
    # a short check of HEAD: the graph and slice GPU tests and the staged contiguous cells at the daemon's
    # defaults (about 2 minutes of device time); HEAD_ORDERS=1 adds the scattered orders (about 95 s more)
    headcheck) TAIL=6 run headtests 110 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
        tests/sidecar/convert/test_convert_graphs_gpu.py tests/gpu/test_gpu_slice.py
      TAIL=8 run headcontiguous 45 "${ONE_GPU[@]}" "${CONTIGUOUS_CELLS[@]}" --budget-s 35 \
        --out "$OUT/e2e-$GPU_TAG-head-contiguous.json"
      [ -n "${HEAD_ORDERS:-}" ] && TAIL=8 run headorders 95 "${ONE_GPU[@]}" --contexts 4096 --concurrency 1,8 \
        --reps 3 --modes staged --orders churn,density-0.25,random "${SCATTERED_POOLS[@]}" --budget-s 80 \
        --out "$OUT/e2e-$GPU_TAG-head-orders.json" ;;
    # HEAD against another tree (AB_OLD: a folder holding that tree's sidecar/ and vllm_glue/, e.g. from
    # `git archive <commit> sidecar vllm_glue | tar -x -C ab-old`; not git-ignored, so it travels), old and
    # new alternating for AB_ROUNDS rounds: AB_CELLS (default the staged contiguous cells) at the daemon's
    # defaults, each run under AB_RUN_S, plus AB_OLD_ARGS / AB_NEW_ARGS for one side's bench; each side runs
    # from its own folder (python -m puts the working directory first on the path). AB_NEW_SETS (daemon
    # settings, space-separated, e.g. "gil_switch_interval_us=500 gil_switch_interval_us=50"): one new side each
    ab) cells=${AB_CELLS:---contexts 4096,16384 --concurrency 1,8 --reps 10 --pairs staged/contiguous --budget-s 45}
        read -ra sets <<<"${AB_NEW_SETS:-}"
        ((${#sets[@]})) || sets=("")
        for r in $(seq 1 "${AB_ROUNDS:-2}"); do
          for side in old "${sets[@]/#/new:}"; do
            root=$PWD extra=${AB_NEW_ARGS:-} name=new
            if [ "$side" = old ]; then
              root=$(cd "${AB_OLD:?AB_OLD: the other tree}" && pwd) extra=${AB_OLD_ARGS:-} name=old
            elif [ "$side" != new: ]; then
              extra="$extra --daemon-set ${side#new:}" name="new-${side#new:}" name=${name//=/-}
            fi
            TAIL=5 run "ab-$name-$r" "${AB_RUN_S:-60}" bash -c "cd '$root' && PYTHONPATH='$root:/tmp/site' \
              python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 --warmup 1 $cells \
              $extra --out '$OUT/e2e-$GPU_TAG-ab-$name-$r.json'"
          done
        done ;;
    # the GIL switch interval (gil_switch_interval_us, GIL_VALUES) alternating for GIL_ROUNDS rounds: the staged
    # contiguous cells and the 4k x 8 scattered ones, each value with its own bare reads in the same run
    gilab) for r in $(seq 1 "${GIL_ROUNDS:-2}"); do
        for g in ${GIL_VALUES:-500 50 20}; do
          TAIL=5 run "gil$g-contiguous-$r" 60 "${ONE_GPU[@]}" "${CONTIGUOUS_CELLS[@]}" \
            --daemon-set gil_switch_interval_us="$g" --budget-s 45 --out "$OUT/e2e-$GPU_TAG-gil$g-contiguous-$r.json"
          TAIL=4 run "gil$g-orders-$r" 50 "${ONE_GPU[@]}" --contexts 4096 --concurrency 8 --reps 3 --modes staged \
            --orders churn,density-0.25 "${SCATTERED_POOLS[@]}" --daemon-set gil_switch_interval_us="$g" \
            --budget-s 35 --out "$OUT/e2e-$GPU_TAG-gil$g-orders-$r.json"
        done
      done ;;
    # the daemon's defaults with conversion graphs on and off, one after the other in one call
    graphsab) for g in true false; do
        TAIL=14 run "graphs-$g" 100 python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 \
          --warmup 1 --contexts 4096,16384 --concurrency 1,8 --reps 10 --pairs staged/contiguous \
          --daemon-set conversion_graphs=$g --budget-s 80 --out "$OUT/e2e-$GPU_TAG-graphs-$g.json"
      done ;;
    launch) run launch 120 python3 -m sidecar.cli bench launch --iters 200 --out "$OUT/launch-probe-$GPU_TAG.json" ;;
    sweep) run sweep 100 python3 -m sidecar.cli bench convert --device cuda --dtype bfloat16 \
      --shapes qwen3-8b-4k,qwen3-8b-16k --no-verify --no-plot --reps 40 --tag "$GPU_TAG-sweep-stages" --out-dir "$OUT" \
      --variant default: --variant p1056:oop_max_programs=1056 --variant p2112:oop_max_programs=2112 \
      --variant p1056s2:oop_max_programs=1056,oop_stages=2 --variant p528s3:oop_max_programs=528,oop_stages=3 \
      --variant p1056o4ks2:oop_max_programs=1056,oop_elems=4096,oop_stages=2 \
      --variant pipe2:in_place=pipe,pipe_ctas_per_sm=2 --variant whole:in_place=whole ;;
    contiguous) TAIL=30 run contiguous 190 "${E2E[@]}" --contexts 4096,16384 --concurrency 1,8 --reps 3 \
      --pairs staged/contiguous,direct/contiguous --budget-s 150 --out "$OUT/e2e-$GPU_TAG-contiguous.json" ;;
    orders) TAIL=30 run orders 160 "${E2E[@]}" --contexts 4096 --concurrency 1,8 --reps 3 --modes staged \
      --orders churn,density-0.25,random "${SCATTERED_POOLS[@]}" --budget-s 120 --out "$OUT/e2e-$GPU_TAG-orders.json" ;;
    # staged only: direct reads of the stand-in's scattered local blocks take 18,432 descriptors per 4k request
    # (0.1-0.2 s each), which ran every step of this sweep past its timeout once.
    groups) for g in ${GROUPS_SWEEP:-1 2 4 9}; do  # the daemon's defaults, layer groups set for both sides
        TAIL=14 run "groups$g" 60 python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 \
          --warmup 1 --contexts 4096,16384 --concurrency 1,8 --reps 8 --pairs staged/contiguous \
          --layer-groups "$g" --budget-s 40 --out "$OUT/e2e-$GPU_TAG-groups$g.json"
      done ;;
    poll) TAIL=20 run poll 120 python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 \
      --warmup 1 --contexts 4096 --concurrency 1,8 --reps 3 --pairs staged/contiguous \
      --daemon-set poll_busy_s=0 --budget-s 70 --out "$OUT/e2e-$GPU_TAG-poll0.json" ;;
    # py-spy (its wheel in .whl) samples every process of a 4k staged cell, without pausing them: where the
    # daemon's threads spend their time. Raw stacks go to $OUT/profile-*.txt.gz.
    profile) for c in 1 8; do
        TAIL=6 run "profile$c" 110 /tmp/site/bin/py-spy record --nonblocking --subprocesses --threads --rate 1000 \
          --format raw -o "$OUT/profile-4k-x$c.txt" -- python3 -m sidecar.bench.e2e --prefill-device cuda:0 \
          --decoder-device cuda:0 --warmup 1 --contexts 4096 --concurrency "$c" --reps 30 \
          --pairs staged/contiguous --budget-s 90 --out "$OUT/e2e-$GPU_TAG-profile-x$c.json"
        gzip -f "$OUT/profile-4k-x$c.txt"
      done ;;
    # py-spy attached by pid to the daemon of a bench e2e run (--subprocesses never reached it), for its
    # whole life (at most SPY_S seconds; idle samples are not kept, so the bare reads' phase adds little):
    # raw stacks per thread in $OUT/daemon-<tokens>-x<in flight>.txt.gz (SPY_CONTEXT 4096, SPY_CONC 8,
    # SPY_PAIRS staged/contiguous by default; SPY_RATE samples per second; SPY_NATIVE=1 adds C frames, which
    # pauses the daemon at each sample: its start then took the whole of a 40 s SPY_BENCH_S once; PY_SPY: a
    # py-spy installed apart, else the one from py-spy's wheel in .whl, put there by `pip download py-spy
    # --no-deps -d .whl`); SPY_REPS must leave the pulls inside SPY_S (2000 at 8 in flight ran the bare reads
    # alone for a minute); scripts/pyspy-summary.py turns them into the shares the README quotes
    daemonprofile) (
        python3 -m sidecar.bench.e2e --prefill-device cuda:0 --decoder-device cuda:0 --warmup 1 \
          --contexts "${SPY_CONTEXT:-4096}" --concurrency "${SPY_CONC:-8}" --reps "${SPY_REPS:-400}" \
          --pairs "${SPY_PAIRS:-staged/contiguous}" --budget-s "${SPY_BENCH_S:-150}" \
          --out "$OUT/e2e-$GPU_TAG-daemonprofile-${SPY_CONTEXT:-4096}-x${SPY_CONC:-8}.json" \
          >"$OUT/daemonprofile-bench-x${SPY_CONC:-8}.log" 2>&1 &
        bench=$!
        pid=""
        for _ in $(seq 1 240); do
          pid=$(pgrep -f "sidecar.cli serve" | head -1)
          [ -n "$pid" ] && break
          sleep 0.5
        done
        echo "daemon pid ${pid:-none}"
        spy_mode=--nonblocking
        [ -n "${SPY_NATIVE:-}" ] && spy_mode=--native  # C frames need py-spy to pause the daemon per sample
        [ -n "$pid" ] && timeout -k 5 $((${SPY_S:-120} + 20)) "${PY_SPY:-/tmp/site/bin/py-spy}" record \
          --pid "$pid" \
          "$spy_mode" --threads --rate "${SPY_RATE:-1000}" --duration "${SPY_S:-120}" --format raw \
          -o "$OUT/daemon-${SPY_CONTEXT:-4096}-x${SPY_CONC:-8}.txt"
        wait "$bench"
        tail -n 12 "$OUT/daemonprofile-bench-x${SPY_CONC:-8}.log"
        gzip -f "$OUT/daemon-${SPY_CONTEXT:-4096}-x${SPY_CONC:-8}.txt"
      ) 2>&1 | tail -n 30
      STATUS+=("daemonprofile: done") ;;
    interference) TAIL=16 run interference 250 python3 -m sidecar.cli bench interference --source daemon \
      --settings none,mps-cap --cells "4096:0,10,20,50 16384:0,10" --phase-s 4 --budget-s 220 \
      --daemon-set nixl_num_threads=4 --out "$OUT/interference" ;;
    # the converting read's first question (docs/converting-read.md): does UCX map the prefill's VRAM from its
    # NIXL metadata (ucp_rkey_ptr), are the mapped pages the prefill's, and what does a gather through the
    # mapping cost beside a local gather, a device copy and a bare NIXL READ? Then the same with the prefill's
    # pages from torch's expandable segments (VMM memory: expected not to map without fabric handles).
    map) TAIL=20 run maptest 90 python3 -m pytest -m gpu -p no:cacheprovider -q -rf tests/gpu/test_gpu_remote_map.py
      TAIL=40 run map 120 python3 -m sidecar.cli bench map --device cuda:0 --prefill-device cuda:0 \
        --context 4096 --reps 10 --out "$OUT/map-$GPU_TAG-4k.json"
      TAIL=12 run mapvmm 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m sidecar.cli bench map \
        --device cuda:0 --prefill-device cuda:0 --context 4096 --reps 5 --orders contiguous \
        --out "$OUT/map-$GPU_TAG-4k-expandable.json" ;;
    # the mapped read mode's GPU tests with the slice's (on a cold H100 200 s ran out after 9 tests, 2026-12-07)
    mappedtests) TAIL=12 run mappedtests 330 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
        tests/gpu/test_gpu_mapped.py tests/gpu/test_gpu_remote_map.py tests/gpu/test_gpu_slice.py ;;
    # the mapped read mode (pull_mode = "mapped"): the issue-12 cells side by side with staged (contiguous at 1,
    # 8 and 32 in flight) and its scattered orders (25 % density against its own contiguous rate, churn and
    # random); its tests are the step above
    mapped) TAIL=16 run mappedcontiguous 160 "${ONE_GPU[@]}" --contexts 4096,16384 --concurrency 1,8,32 --reps 10 \
        --max-batch-tokens 131072 --pairs mapped/contiguous,staged/contiguous --budget-s 140 \
        --out "$OUT/e2e-$GPU_TAG-mapped-contiguous.json"
      TAIL=12 run mappedorders 130 "${ONE_GPU[@]}" --contexts 4096 --concurrency 1,8 --reps 3 \
        --pairs mapped/contiguous,mapped/density-0.25,mapped/churn,mapped/random "${SCATTERED_POOLS[@]}" \
        --budget-s 110 --out "$OUT/e2e-$GPU_TAG-mapped-orders.json" ;;
    # poll_linger_s (LINGER_VALUES) alternating for LINGER_ROUNDS rounds: mapped contiguous pulls at 1 and 8 in
    # flight (LINGER_CONC), each value with its own bare reads in the same run
    lingerab) for r in $(seq 1 "${LINGER_ROUNDS:-2}"); do
        for v in ${LINGER_VALUES:-0 0.05}; do
          TAIL=5 run "linger$v-$r" 70 "${ONE_GPU[@]}" --contexts 4096,16384 --concurrency "${LINGER_CONC:-1,8}" \
            --reps 10 --pairs mapped/contiguous --daemon-set poll_linger_s="$v" --budget-s 55 \
            --out "$OUT/e2e-$GPU_TAG-linger$v-$r.json"
        done
      done ;;
    # the converter beside a copy with the launch hidden from the kernel's events, per call against the copy
    # per call, on every GPU shape (the larger ones without the byte check: it clones their 8,192-block caches
    # twice, past the GPU's memory)
    convertlead) TAIL=24 run convertlead 150 python3 -m sidecar.cli bench convert --device cuda --dtype bfloat16 \
        --shapes qwen3-8b-4k,qwen3-8b-16k --no-plot --reps 40 --tag "$GPU_TAG-lead" --out-dir "$OUT" --variant default:
      TAIL=16 run convertleadshapes 200 python3 -m sidecar.cli bench convert --device cuda --dtype bfloat16 \
        --shapes qwen3-8b-tp8-4k,l64-h8-n32-d128-4k,llama3.2-1b-d64-16k,l42-h8-n16-d256-4k,l42-h8-n32-d256-4k \
        --no-verify --no-plot --reps 20 --tag "$GPU_TAG-lead-shapes" --out-dir "$OUT" --variant default: ;;
    # out-of-place and in-place launch shapes on the 4k shape, the launch hidden from the events (CONVERT_VARIANTS)
    convertsweep) TAIL=30 run convertsweep 200 python3 -m sidecar.cli bench convert --device cuda --dtype bfloat16 \
      --shapes qwen3-8b-4k --no-verify --no-plot --reps 40 --tag "$GPU_TAG-lead-sweep" --out-dir "$OUT" \
      ${CONVERT_VARIANTS:---variant default: --variant o4k:oop_elems=4096 --variant o4kw8:oop_elems=4096,oop_warps=8 \
      --variant w8:oop_warps=8 --variant o1k:oop_elems=1024 --variant e64:in_place_elems_per_thread=64 \
      --variant e256:in_place_elems_per_thread=256 --variant ev:streaming=true} ;;
    # the loop's thread CPU by piece (config loop_pieces) for mapped 4k pulls at 8 and 1 in flight, one file each
    # (PIECES_PAIRS: another mode, e.g. staged/contiguous; PIECES_SET: one more --daemon-set KEY=VALUE)
    pieces) p=${PIECES_PAIRS:-mapped/contiguous}; tag=${p%%/*}${PIECES_TAG:-}
      for c in 8 1; do
        TAIL=5 run "pieces-$tag-x$c" 90 "${ONE_GPU[@]}" --contexts 4096 --concurrency "$c" --reps 30 \
          --pairs "$p" --budget-s 70 --daemon-set "loop_pieces=\"$OUT/loop-pieces-$GPU_TAG-$tag-x$c.json\"" \
          ${PIECES_SET:+--daemon-set "$PIECES_SET"} --logs "$OUT/logs-$tag-x$c" \
          --out "$OUT/e2e-$GPU_TAG-pieces-$tag-x$c.json"
      done ;;
    # a graph launch's fire split into its calls (bench launch), and the same pieces inside the daemon, a
    # lone pull's every call kept (pieces' .slow.json) to split each Done's launch
    fireparts) TAIL=24 run fireparts 100 python3 -m sidecar.cli bench launch --iters 200 --modes staged \
        --per-launch 36 --paths graph --out "$OUT/launch-probe-$GPU_TAG-fire.json"
      TAIL=8 run firepieces 60 "${ONE_GPU[@]}" --contexts 4096,16384 --concurrency 1 --reps 10 \
        --pairs staged/contiguous --budget-s 45 --daemon-set "loop_pieces=\"$OUT/pieces-$GPU_TAG-fire.json\"" \
        --daemon-set loop_pieces_slow_us=1 --out "$OUT/e2e-$GPU_TAG-fire-pieces.json" ;;
    # conversion gates (config conversion_gates): their GPU tests, then the staged cells with gates off and on,
    # alternating, two rounds
    gatestests) TAIL=20 run gatestests 260 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
        tests/sidecar/convert/test_convert_gates_gpu.py tests/sidecar/convert/test_convert_graphs_gpu.py \
        tests/gpu/test_gpu_slice.py ;;
    gatesab) for r in 1 2; do
        for g in false true; do
          TAIL=6 run "gates-$g-$r" 60 "${ONE_GPU[@]}" "${CONTIGUOUS_CELLS[@]}" --budget-s 45 \
            --daemon-set "conversion_gates=$g" --out "$OUT/e2e-$GPU_TAG-gates-$g-$r.json"
        done
      done ;;
    # direct reads (in-place launches) with gates off and on, alternating, two rounds: the launch after landing
    directgatesab) for r in 1 2; do
        for g in false true; do
          TAIL=6 run "direct-gates-$g-$r" 70 "${ONE_GPU[@]}" --contexts 4096 --concurrency 1,8 --reps 6 \
            --pairs direct/contiguous --budget-s 50 --daemon-set "conversion_gates=$g" \
            --out "$OUT/e2e-$GPU_TAG-direct-gates-$g-$r.json"
        done
      done ;;
    # which host calls wait for work held behind a closed gate, with lazy and with eager module loading
    gateprobe) for m in LAZY EAGER; do
        TAIL=12 CUDA_MODULE_LOADING=$m run "gate-probe-$m" 120 python3 scripts/gate-probe.py \
          --out "$OUT/gate-probe-$GPU_TAG-$(echo $m | tr A-Z a-z).json"
      done ;;
    # one in-place graph launch per call split into its host and device pieces, beside a copy
    percallpieces) TAIL=4 run percallpieces 120 python3 scripts/convert-percall-pieces.py \
        --out "$OUT/convert-percall-pieces-$GPU_TAG.json" ;;
    # a kernel's first launch behind a closed gate held up later work on every stream (an H100, 2026-12-06,
    # lazy module loading): did the hardware queues matter? Staged 4k/16k x 1/x 8, gates on and off,
    # CUDA_DEVICE_MAX_CONNECTIONS 8 (CUDA's default) and 32 for every process of the run
    connab) for arm in true-32 true-8 false-32 false-8; do
        export CUDA_DEVICE_MAX_CONNECTIONS=${arm#*-}
        TAIL=6 run "conn-$arm" 60 "${ONE_GPU[@]}" "${CONTIGUOUS_CELLS[@]}" --budget-s 45 \
          --daemon-set "conversion_gates=${arm%-*}" --out "$OUT/e2e-$GPU_TAG-conn-$arm.json"
      done
      unset CUDA_DEVICE_MAX_CONNECTIONS ;;
    # the host-call hazards behind closed gates (graphs, the fp8 re-encode's warm-up, a mapping's close) and the
    # daemon's conversions with ids checked once a request
    hazardtests) TAIL=20 run hazardtests 300 python3 -m pytest -m gpu -p no:cacheprovider -q -rf \
        tests/sidecar/convert/test_convert_gates_gpu.py tests/sidecar/convert/test_convert_graphs_gpu.py \
        tests/sidecar/nixl/test_mapping_gpu.py tests/sidecar/daemon tests/gpu/test_gpu_mapped.py ;;
    # CUDA's module loading, lazy (torch's default) against eager: init time, device memory, and whether a
    # kernel's first launch behind a closed gate holds other streams; then staged 4k/16k x 1/x 8 with gates on
    # under each, alternating, every process of the run in that mode
    loadingab) TAIL=4 run moduleloading 60 python3 scripts/module-loading.py \
        --out "$OUT/module-loading-$GPU_TAG.json"
      for m in EAGER LAZY; do
        export CUDA_MODULE_LOADING=$m
        TAIL=6 run "loading-$m" 60 "${ONE_GPU[@]}" "${CONTIGUOUS_CELLS[@]}" --budget-s 45 \
          --daemon-set conversion_gates=true --out "$OUT/e2e-$GPU_TAG-gates-loading-$m.json"
      done
      unset CUDA_MODULE_LOADING ;;
    # per call with the launch made ready ahead (fired) beside the whole launch, Qwen3-8B 4k and 16k
    convertfired) TAIL=10 run convertfired 150 python3 -m sidecar.cli bench convert --device cuda --dtype bfloat16 \
        --shapes qwen3-8b-4k,qwen3-8b-16k --no-plot --reps 40 --tag "$GPU_TAG-fired" --out-dir "$OUT" \
        --variant default: ;;
    # the queue at 8 in flight under a magnifier: staged contiguous 4k and 16k x 8, every call of the daemon of
    # 0.1 ms or more kept one by one (loop_pieces_slow_us), to lay over the cells' timelines:
    # python -m sidecar.bench.overlay e2e-<gpu>-queue-pieces.json pieces-<gpu>-queue.slow.json
    queuepieces) TAIL=6 run queuepieces 110 "${ONE_GPU[@]}" --contexts 4096,16384 --concurrency 8 --reps 40 \
        --pairs staged/contiguous --budget-s 75 --daemon-set "loop_pieces=\"$OUT/pieces-$GPU_TAG-queue.json\"" \
        --daemon-set loop_pieces_slow_us=100 --out "$OUT/e2e-$GPU_TAG-queue-pieces.json" ;;
    # a lone staged pull on a cold core against a warm one, alternating for COLD_ROUNDS rounds: the daemon's
    # defaults; poll_linger_s=3 (its loop keeps polling 3 s after each change); and the host's CPU idle states
    # held shallow for the run (PM QoS: /dev/cpu_dma_latency 0 while a holder keeps it open; root only, ends
    # with the holder), each arm with its own bare reads in the same run
    coldab) for r in $(seq 1 "${COLD_ROUNDS:-2}"); do
        for arm in base linger qos; do
          set_arg=() holder=
          [ "$arm" = linger ] && set_arg=(--daemon-set poll_linger_s=3)
          if [ "$arm" = qos ]; then
            python3 -c 'import struct, time; f = open("/dev/cpu_dma_latency", "wb", 0)
f.write(struct.pack("i", 0)); print("held", flush=True); time.sleep(3600)' & holder=$!
            sleep 1
          fi
          TAIL=5 run "cold-$arm-$r" 60 "${ONE_GPU[@]}" --contexts 4096,16384 --concurrency 1 --reps 15 \
            --pairs staged/contiguous "${set_arg[@]}" --budget-s 45 --out "$OUT/e2e-$GPU_TAG-cold-$arm-$r.json"
          [ -n "$holder" ] && kill "$holder" 2>/dev/null && wait "$holder" 2>/dev/null
        done
      done ;;
    # the loop's CPU per pull on this host's CPU (no GPU in it): back to back and after idling
    loopbench) TAIL=5 run loopbench 120 python3 -m sidecar.bench.loop_cost --bursts 200 --out "$OUT/loop-$GPU_TAG-host.json" ;;
    *) STATUS+=("$step: unknown step") ;;
  esac
done
echo "=== $(($(date +%s) - START))s"
printf '%s\n' "${STATUS[@]}"
# the device hands back at most 8 files from $OUT: more than that go into one archive
mapfile -t made < <(cd "$OUT" && ls -A)
if ((${#made[@]} > 8)); then
  tar -czf "$OUT/fastpath-out.tar.gz" -C "$OUT" --remove-files "${made[@]}" &&
    echo "packed ${#made[@]} files into $OUT/fastpath-out.tar.gz"
fi
