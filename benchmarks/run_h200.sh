#!/usr/bin/env bash
# One GPU: the GPU tests, the decode benchmarks (JSON for benchmarks/results/) and start-up times. STAGES picks
# among "tests decode overlap fp8 startup" (default tests, decode and startup; they run in that order); run_h200x2.sh runs them on its
# two GPUs side by side. DEADLINE (seconds, default 590: a device call's limit) bounds the decode runs: each
# gets at most the time left (and at most 300 s: qwen3-30b-a3b's compiled baseline takes ~250 s to autotune on a
# cold inductor cache), and one with less than 100 s left is skipped, said so.
# Usage, from the repository root: OUT=dir [STAGES=...] [DEADLINE=s] bash benchmarks/run_h200.sh [MODEL:BATCH ...]
# (on the device machine, DISTMK_COMMIT=<hash> too: its checkout's git HEAD is not the tree it was sent)
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
STAGES=" ${STAGES:-tests decode startup} "
DEADLINE=${DEADLINE:-590}
mkdir -p "$OUT"
stamp() { echo "[$(date +%T)] $*"; }
# NO_COMPILE=1 leaves decode.py's torch.compile'd baselines out (max-autotune takes 60-250 s a run)
compiled=--compile-baseline
[ -n "${NO_COMPILE:-}" ] && compiled=
# what decode.py's logs leave out: warnings and inductor's autotuning tables (the JSON keeps the traced step)
noise="Warn\|warn(\|AUTOTUNE\|^  [a-z_]*mm[_ ]\|^  decompose_k\|^strides:\|^dtypes:\|Autotune Choices\|num_choices"

if [[ $STAGES == *" tests "* ]]; then
  # TESTS picks them (-k; default: all but the two-GPU ones); virtual ranks' first
  stamp "GPU tests (${TESTS:-not tp2})"
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -s tests/test_gpu.py -k "${TESTS:-not tp2}" 2>&1 | grep -v Warn \
      > "$OUT/gpu_tests.log"
  tail -n 4 "$OUT/gpu_tests.log"
fi

if [[ $STAGES == *" decode "* ]]; then
  # against the torch.compile'd CUDA graph (max-autotune), the yardstick
  # MODEL:BATCH, or MODEL:BATCH:vN for N virtual ranks on this GPU beside the tp=1 step (decode.py --virtual-tp)
  for one in ${@:-llama-3-8b:1 llama-3-8b:8 qwen3-8b:1 qwen3-8b:8 llama-3.2-1b:1}; do
    IFS=: read -r model batch virtual <<< "$one"
    tp=${virtual#v} left=$((DEADLINE - SECONDS))
    [ $left -lt 100 ] && { stamp "decode $one skipped: ${left} s left"; continue; }
    stamp "decode $one"
    name=decode_${model}_b${batch}_${virtual:+v}tp${tp:-1}
    timeout $((left < 300 ? left : 300)) python3 benchmarks/decode.py --model "$model" --batch "$batch" \
        --virtual-tp "${tp:-1}" --context 512 --iters 100 --skip-hf $compiled --json --out "$OUT/$name.json" 2>&1 \
        | grep -v "$noise" \
        > "$OUT/$name.log"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('step_ms', \
'tp1_step_ms', 'step_vs_tp1', 'cudagraph_compiled_ms', 'speedup_vs_compiled', 'efficiency')})" "$OUT/$name.json" \
        2>/dev/null || tail -n 3 "$OUT/$name.log"
  done
fi

if [[ $STAGES == *" overlap "* ]]; then
  # overlap.py at virtual tp (OVERLAP_TP, default "2 4"): each layer's o_proj tiles with and without their all-reduce
  for tp in ${OVERLAP_TP:-2 4}; do
    stamp "overlap.py, virtual tp=$tp"
    timeout 200 python3 benchmarks/overlap.py --virtual-tp "$tp" --out "$OUT/overlap_vtp$tp.json" 2>&1 \
        | grep -v "Warn\|warn(" > "$OUT/overlap_vtp$tp.log"
    tail -n 1 "$OUT/overlap_vtp$tp.log" | cut -c1-300
  done
fi

if [[ $STAGES == *" fp8 "* ]]; then
  # the ring streaming e4m3 products (kernel option stream_e4m3): its GPU tests, stream.py's probe (bf16, W8A16, W8A8),
  # then decode.py --quantize fp8 for FP8_MODELS (MODEL:BATCH; default: issue 43's, llama-3-8b and qwen3-8b at
  # batch 1 and 8, qwen3-30b-a3b at 1), each with distmk's bf16 step and the compiled bf16 and FP8 (weight-only,
  # W8A8) baselines from the same process; then prefill.py on llama-3-8b's FP8 twin and on its bf16 weights, and
  # fp8_accuracy.py for FP8_ACCURACY (default llama-3-8b). FP8_STEPS picks among "tests probe decode prefill
  # accuracy" (default all): a device call's 600 s hold the tests, the probes and one or two decode runs, so the
  # other decode runs take calls of their own (FP8_STEPS=decode FP8_MODELS=...)
  FP8_STEPS=" ${FP8_STEPS:-tests probe decode prefill accuracy} "
  if [[ $FP8_STEPS == *" tests "* ]]; then
    stamp "GPU tests (e4m3 products; transformers' own FP8 on the same checkpoint)"
    timeout 300 python3 -m pytest -q -s tests/test_gpu.py -k "e4m3 or (matches_tl and fp8) or transformers_fp8 or scaled_mm_blocks or w8a8_prefill" 2>&1 | grep -v Warn \
        > "$OUT/gpu_tests_fp8.log"
    tail -n 4 "$OUT/gpu_tests_fp8.log"
  fi
  if [[ $FP8_STEPS == *" probe "* ]]; then
    # the probe at the megakernel's padded batch up to 8: bf16, W8A16 (and on two consumer warpgroups) and W8A8 over
    # the same bytes (an H100 had W8A8 the slower: results/h100-2026-12-06-bf2ceb1), on every SM, then W8A16's loops on
    # 33 programs, where HBM does not bound them (results/h100-2026-12-07-5750d7f)
    stamp "stream.py --probe-only"
    timeout 150 python3 benchmarks/stream.py --probe-only --probe-kernels gluon,gluon-fp8,gluon-fp8-2wg,gluon-w8a8 \
        --probe-rows 64,128 --probe-pad 8 --iters 20 --json --out "$OUT/stream_probe.json" 2>&1 \
        | grep "\[stream\]" | grep "barrier 0" | grep "BK 256 stages \(9\|4 x 4\)"
    timeout 100 python3 benchmarks/stream.py --probe-only --probe-kernels gluon-fp8,gluon-fp8-2wg --probe-rows 128 \
        --probe-pad 8 --probe-programs 33 --iters 20 --json --out "$OUT/stream_probe_per_sm.json" 2>&1 \
        | grep "\[stream\]" | grep "barrier 0" | grep "BK 256 stages 9"
  fi
  if [[ $FP8_STEPS == *" decode "* ]]; then
    for one in ${FP8_MODELS:-llama-3-8b:1 llama-3-8b:8 qwen3-8b:1 qwen3-8b:8 qwen3-30b-a3b:1}; do
      IFS=: read -r model batch <<< "$one"
      stamp "decode $one, e4m3 products"
      left=$((DEADLINE - SECONDS))
      [ $left -lt 100 ] && { stamp "decode $one skipped: ${left} s left"; continue; }
      timeout $((left < 400 ? left : 400)) python3 benchmarks/decode.py --model "$model" --batch "$batch" --context 512 \
          --iters 100 --skip-hf $compiled --quantize fp8 --stream-e4m3 1 --json \
          --out "$OUT/decode_${model}_b${batch}_fp8.json" 2>&1 | grep -v "$noise" \
          > "$OUT/decode_${model}_b${batch}_fp8.log"
      python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('step_ms', \
  'roofline_ms', 'efficiency', 'bf16_step_ms', 'cudagraph_compiled_ms', 'cudagraph_compiled_fp8_ms', \
  'cudagraph_compiled_w8a8_ms')})" \
          "$OUT/decode_${model}_b${batch}_fp8.json" \
          2>/dev/null || tail -n 3 "$OUT/decode_${model}_b${batch}_fp8.log"
    done
  fi
  if [[ $FP8_STEPS == *" prefill "* ]]; then
    for quantize in fp8 ""; do      # a 512-token chunk: the FP8 twin dequantizes its weights a layer at a time
      left=$((DEADLINE - SECONDS))
      [ $left -lt 60 ] && { stamp "prefill.py ${quantize:-bf16} skipped: ${left} s left"; continue; }
      stamp "prefill.py llama-3-8b ${quantize:-bf16}"
      timeout $((left < 120 ? left : 120)) python3 benchmarks/prefill.py --model llama-3-8b ${quantize:+--quantize $quantize} \
          --chunks 512 --baseline none --iters 10 --json --out "$OUT/prefill_llama-3-8b_${quantize:-bf16}.json" \
          2> "$OUT/prefill_llama-3-8b_${quantize:-bf16}.log" > /dev/null
      grep "tokens " "$OUT/prefill_llama-3-8b_${quantize:-bf16}.log" | cut -c1-120
    done
  fi
  if [[ $FP8_STEPS == *" accuracy "* ]]; then
    for model in ${FP8_ACCURACY:-llama-3-8b}; do     # the FP8 twin's logits against the bf16 model's
      left=$((DEADLINE - SECONDS))
      [ $left -lt 60 ] && { stamp "fp8_accuracy.py $model skipped: ${left} s left"; continue; }
      stamp "fp8_accuracy.py $model"
      timeout $((left < 200 ? left : 200)) python3 benchmarks/fp8_accuracy.py --model "$model" --positions 512 \
          --out "$OUT/fp8_accuracy_$model.json" 2> "$OUT/fp8_accuracy_$model.log" | grep "top1\|rel_err_median\|kl_mean"
    done
  fi
fi

if [[ $STAGES == *" startup "* ]]; then
  # process start to first token, with empty Triton, distmk and bytecode caches (cold: compiling, autotuning)
  # and warm. The device image sets PYTHONDONTWRITEBYTECODE, so its site-packages hold no bytecode and every
  # process compiled torch's sources again (3 s); a pip install writes bytecode, so here it goes to a cache
  # of its own (cold compiles it, warm reads it).
  export TRITON_CACHE_DIR=/tmp/distmk_startup/triton DISTMK_CACHE_DIR=/tmp/distmk_startup/distmk
  export PYTHONPYCACHEPREFIX=/tmp/distmk_startup/pycache; unset PYTHONDONTWRITEBYTECODE
  rm -rf /tmp/distmk_startup /tmp/distmk_startup_cold
  for run in cold warm; do
    stamp "start-up, $run" >&2
    t0=$(date +%s.%N)
    python3 -m distmk.generate --model llama-3-8b --prompt-ids 1,2,3 --max-new-tokens 1 --backend triton \
        --device cuda --json > /tmp/startup_$run.json 2> /tmp/startup_$run.log
    t1=$(date +%s.%N)
    generated=$( [ -s /tmp/startup_$run.json ] && cat /tmp/startup_$run.json || echo null )
    # kernels in the Triton cache after the run: a warm start that compiles adds some
    entries=$(ls "$TRITON_CACHE_DIR" 2>/dev/null | wc -l)
    (cd "$TRITON_CACHE_DIR" && ls -t */*.json) > "$OUT/startup_triton_cache_$run.txt" 2>&1
    echo "{\"run\": \"$run\", \"process_to_first_token_s\": $(python3 -c "print(round($t1 - $t0, 2))"), \"triton_cache_entries\": $entries, \"generate\": $generated}"
    [ $run = cold ] && cp -a /tmp/distmk_startup /tmp/distmk_startup_cold
  done > "$OUT/startup_llama-3-8b.jsonl"
  # where a first warm start spends its time: the caches as the cold run left them, under cProfile
  rm -rf /tmp/distmk_startup && cp -a /tmp/distmk_startup_cold /tmp/distmk_startup
  python3 -m cProfile -o /tmp/startup_warm.prof -m distmk.generate --model llama-3-8b --prompt-ids 1,2,3 \
      --max-new-tokens 1 --backend triton --device cuda --json > /dev/null 2>&1
  python3 -c "import pstats; s = pstats.Stats('/tmp/startup_warm.prof'); s.sort_stats('cumulative').print_stats(
      'distmk/|triton/(runtime|compiler)', 60); s.print_callers('_do_compile|make_cubin')" > "$OUT/startup_warm_profile.txt" 2>&1
fi
[ -n "${NO_TABLE:-}" ] || python3 benchmarks/results_table.py "$OUT"
