#!/usr/bin/env bash
# The GPU checks and measurements, in the order that matters:
# CUDA tests, then each benchmark, each under its own time limit so that one slow
# part cannot starve the rest. Tables and logs go to $OUT (default benchmarks/results).
#   bash benchmarks/run_gpu.sh [tests|quant|gemm|linear|layer|floors|token_rows|graph|wgrad_acc|deferred|demo|autotune|mx|tune|suite|suite1|suite2|ep|hf ...]
#   (default: all but layer, floors, token_rows, graph, wgrad_acc, deferred, mx, tune, suite*, ep and hf)
# suite runs the whole test suite on the GPUs, one pytest process per test file, six at a time
# per GPU (compilation is CPU-bound; more than 10 minutes on one H200: suite1 and suite2 run
# half the files each, one device call each): tests that
# are not marked cuda can still fail only there (a config that faults, a miscompiled store).
# One process per file also keeps a fault that poisons the
# CUDA context inside its file.
set -uo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
parts=${*:-tests quant gemm linear demo autotune}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name exit $? ($(date +%T))"
  tail -n 25 "$out/$name.log"
}
for part in $parts; do
  case $part in
    tune) step tune 215 python -m kernels_helion.tune --budget-s 190 \
            --kernels quantize_rowwise_rows quantize_rowwise_cols_grouped quantize_rowwise_expert_weights_both_layouts_amax quantize_rowwise_expert_weights_both_layouts_cast
          tar czf "$out/autotune_cache_sm90.tgz" autotune_cache/sm90 ;;
    # The quantization tests run whole (the GPU casts natively: bitwise checks on every edge
    # case); the others' GPU-specific tests are marked cuda (CI runs the rest on CPU).
    tests) step tests 220 python -m pytest -q -p no:warnings tests/test_quantize_rowwise.py \
             tests/test_quantize_rowwise_grouped.py tests/test_quantize_rowwise_weights.py
           step tests_cuda 200 python -m pytest -q -p no:warnings -m cuda ;;
    quant) step quant 330 python -m benchmarks.quant --recipe rowwise --out "$out/quant_h200.md"
           step quant_blockwise 300 python -m benchmarks.quant --recipe blockwise --out "$out/quant_blockwise_h200.md" ;;
    gemm) step gemm 240 python -m benchmarks.grouped_gemm --out "$out/grouped_gemm_h200.md" ;;
    linear) step linear 150 python -m benchmarks.grouped_linear --out "$out/grouped_linear_h200.md" ;;
    layer) step layer 560 python -m benchmarks.moe_layer --routing uniform --out "$out/moe_layer_h200.md" ;;
    # The fused FP8 layer against bf16 with kernel tables (the profiled steps' wall time and SM clock included),
    # then what bounds each config (benchmarks.layer_floors; SonicMoE's step times from its committed
    # run); FLOOR_CONFIGS picks the configs (default: all four; the DeepSeek-V3-like ones take most
    # of a device call).
    floors) configs=${FLOOR_CONFIGS:-qwen3-8k qwen3-32k dsv3-256 dsv3-32}
            # shellcheck disable=SC2086
            step layer_profiled 560 python -m benchmarks.moe_layer --configs $configs --routing uniform \
              --micro-batches 1 --sonic-configs --peers bf16 'fp8 fused' --profile-dir "$out" \
              --out "$out/moe_layer_profiled_h200.md"
            profiles=$(for c in $configs; do echo "$c=$out/profile_moe_layer_${c}_uniform.txt"; done)
            # shellcheck disable=SC2086
            step layer_floors 60 python -m benchmarks.layer_floors --profiles $profiles \
              --results benchmarks/results/sonicmoe/moe_layer_sonic_h200.json "$out/moe_layer_profiled_h200.json" \
              --out "$out/layer_floors_h200.md" ;;
    # w2's dgrad on token rows (RowwiseOptions.down_dgrad_token_rows): its tests on the GPU, then the layer's
    # default ("auto") against both forms at the Qwen3-30B-like configs and the 32-expert one, with kernel tables.
    token_rows) step token_rows_tests 200 python -m pytest -q -p no:warnings tests/test_grouped_gemm.py \
                  tests/test_moe_fused.py tests/test_quantize_rowwise_two_pass.py tests/test_down_dgrad_token_rows.py \
                  -k "token_rows or rows_read or gathered_columns or auto or accumulate"
                step token_rows_layer 380 python -m benchmarks.moe_layer --configs qwen3-8k qwen3-32k dsv3-32 \
                  --routing uniform --micro-batches 1 --peers bf16 'fp8 fused' 'fp8 fused, w2 dgrad folded' \
                  'fp8 fused, w2 dgrad on token rows' --profile-dir "$out" --out "$out/moe_layer_token_rows_h200.md" ;;
    # The whole layer step captured in a CUDA graph: its test, then the Qwen3-30B-like 8192-token layer (bound
    # by host time in eager mode) timed as replays, one and four micro-batches.
    graph) step graph_tests 200 python -m pytest -q -p no:warnings tests/test_moe_fused.py tests/test_ops.py \
             -k "captures_in_a_cuda_graph"
           step graph_layer 300 python -m benchmarks.moe_layer --configs qwen3-8k qwen3-32k --routing uniform \
             --micro-batches 4 --cuda-graph --peers bf16 'fp8 fused' --out "$out/moe_layer_cuda_graph_h200.md" ;;
    # The FP8 wgrad tuned adding into a bf16 .grad (its keys with ACC: 1; the tuner prints each shape's time
    # before and after), then the layer at 4 micro-batches adding dW into .grad.
    wgrad_acc) step wgrad_acc_tune 330 python -m kernels_helion.tune --kernels grouped_mm_wgrad --shapes ACC=1 --budget-s 300
               cp autotune_cache/sm90/grouped_mm_wgrad.json "$out/"
               step wgrad_acc_layer 240 python -m benchmarks.moe_layer --configs dsv3-256 qwen3-32k --routing uniform \
                 --micro-batches 4 --peers bf16 'fp8 fused, dW into .grad' --out "$out/moe_layer_wgrad_acc_h200.md" ;;
    # The experts' wgrads deferred to one run a step (RowwiseOptions.deferred_wgrad): its CUDA tests, then the
    # layer at 4 micro-batches against the per-micro-batch wgrad, same run (an H200: three peers at dsv3-256).
    deferred) step deferred_tests 200 python -m pytest -q -p no:warnings -m cuda tests/test_deferred_wgrad.py
              PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step deferred_layer 500 python -m benchmarks.moe_layer \
                --configs dsv3-256 qwen3-8k qwen3-32k --routing uniform --micro-batches 4 --peers bf16 \
                'fp8 fused, dW into .grad' 'fp8 fused, deferred wgrad, dW into .grad' \
                --out "$out/moe_layer_deferred_wgrad_h200.md" ;;
    demo) step demo 120 python -m benchmarks.moe_training_demo --steps 60 \
            --plot "$out/moe_training_demo_h200.png" --out "$out/moe_training_demo_h200.md" ;;
    # Hugging Face transformers models converted by ops.convert_to_fp8: step times against transformers'
    # own bf16 experts and our bf16 layer, then the loss curves of 200 steps.
    hf) step hf_time_qwen3 170 python -m benchmarks.hf_finetune --time --variants bf16 ops_bf16 fp8 \
          --out "$out/hf_finetune_time_qwen3_h200.md"
        step hf_time_gpt_oss 150 python -m benchmarks.hf_finetune --model gpt_oss --time --variants bf16 ops_bf16 fp8 \
          --out "$out/hf_finetune_time_gpt_oss_h200.md"
        step hf_loss 200 python -m benchmarks.hf_finetune --steps 300 --lr 1e-3 --variants bf16 ops_bf16 fp8 \
          --out "$out/hf_finetune_qwen3_lr1e-3_h200.md" ;;
    autotune) step autotune 120 python -m benchmarks.autotune --out "$out/autotune_h200.md" ;;
    mx) step mx 240 python -m benchmarks.mx --out "$out/mx_h200.md"
        step linear_mx 200 python -m benchmarks.grouped_linear --recipe mxfp8 --out "$out/grouped_linear_mxfp8_h200.md" ;;
    suite|suite1|suite2) echo "=== $part ($(date +%T))"
           # Six files at a time per GPU; with several GPUs each single-GPU file gets one of them
           # (round robin) and the distributed files (NCCL ranks on 2 and 4 GPUs) see them all.
           # suite1 / suite2: every other file (the first, third, ... / the second, fourth, ...),
           # for device calls too short for the whole suite.
           gpus=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
           case $part in suite1) half=0 ;; suite2) half=1 ;; *) half=both ;; esac
           i=0; j=0; for f in tests/test_*.py; do
             j=$((j + 1)); if [ "$half" != both ] && [ $(((j - 1) % 2)) != "$half" ]; then continue; fi
             case $(basename "$f") in
               test_fsdp.py|test_expert_parallel.py|test_distributed_harness.py) echo "all $f" ;;
               *) echo "$((i % gpus)) $f"; i=$((i + 1)) ;;
             esac
           done | xargs -P $((6 * gpus)) -L 1 sh -c 'name=$(basename "$2" .py); \
             if [ "$1" != all ]; then export CUDA_VISIBLE_DEVICES=$1; fi; \
             timeout 500 python -m pytest -q -p no:warnings -p no:cacheprovider -rfE "$2" > "$0/suite_$name.log" 2>&1; \
             echo "$name exit $?: $(tail -n 1 "$0/suite_$name.log")"' "$out" | sort
           echo "=== $part done ($(date +%T))" ;;
    # Expert parallelism on every GPU of the machine (2 or more): its CUDA tests (2 and 4 GPUs,
    # the host-sync count), the benchmark at EP = 1, 2 and 4 where the GPUs exist, the demo.
    ep) gpus=$(python -c "import torch; print(torch.cuda.device_count())")
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        step ep_tests 500 python -m pytest -q -p no:warnings -m cuda tests/test_expert_parallel.py
        for n in 1 2 4; do
          [ "$n" -le "$gpus" ] && step "moe_parallel_ep$n" 500 torchrun --nproc_per_node "$n" \
            -m benchmarks.moe_parallel --out "$out/moe_parallel_ep${n}.md"
        done
        step ep_demo 500 torchrun --nproc_per_node "$gpus" -m benchmarks.moe_training_demo \
          --plot "$out/moe_training_demo_ep${gpus}.png" --out "$out/moe_training_demo_ep${gpus}.md" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
