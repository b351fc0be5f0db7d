#!/usr/bin/env bash
# Converter sweep on the H200 (issue 12 item 7): variants side by side with a copy, kernel and per call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
V=(--variant default: --variant g2:split_group=2 --variant g4:split_group=4 --variant e256:in_place_elems_per_thread=256
   --variant e64g2:in_place_elems_per_thread=64,split_group=2 --variant scr16:in_place=scratch,scratch_bytes=16777216
   --variant scr64:in_place=scratch,scratch_bytes=67108864 --variant o4k:oop_elems=4096 --variant o4kw8:oop_elems=4096,oop_warps=8
   --variant o8kw8:oop_elems=8192,oop_warps=8 --variant ev:streaming=true)
for dt in bfloat16 float8_e4m3fn; do
  timeout 240 python3 -m sidecar.cli bench convert --device cuda --dtype $dt --shapes qwen3-8b-4k,qwen3-8b-16k \
    --no-verify --no-plot --reps 40 --tag h200-sweep-$dt --out-dir $OUT "${V[@]}" 2>&1 | grep -v "━\|─" | tail -30
done
