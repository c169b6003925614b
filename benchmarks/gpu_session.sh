#!/usr/bin/env bash
# What was run on the lent GPU machine (2 x H200, torch 2.11, transformers 5.17, Python 3.12) for BENCHMARKS.md.
#   bash benchmarks/gpu_session.sh tests bench fsdp broadcast compile final disaggregated
# Expects the small wheels that machine lacks in .whl/ (cattrs, math-verify and its deps); writes to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site
editables=(-e .); for d in plugins/*/; do editables+=(-e "$d"); done
python3 -m pip install -q --no-deps --no-build-isolation "${editables[@]}" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
BENCH=(python3 benchmarks/policy_update.py --size 2b --device cuda --attn varlen --image-size 448 --min-completion 64
       --max-completion 768 --samples 64 --warmup 1 --iters 3)
for step in "$@"; do
  echo "== $step"
  case $step in
    deepstack) timeout 200 python3 -m pytest -q -p no:cacheprovider -rs plugins/vlmreg-qwen3-vl/tests/test_deepstack.py plugins/vlmreg-qwen3-vl/tests/test_patch_embed.py \
                 tests/modeling/test_vision_calls.py tests/data/test_pixels_on_device.py 2>&1 | tail -3 ;;
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider plugins tests/resolution tests/loading tests/sdk \
             tests/train/test_packing.py tests/train/test_gpu.py tests/inference/test_embedded.py 2>&1 | tee "$OUT/tests.log" | tail -4 ;;
    bench) timeout 400 "${BENCH[@]}" --budget 16384 2> "$OUT/bench.err" | tee "$OUT/policy_update_2b.json" | head -24 ;;
    fsdp) for f in qwen3_vl qwen3_5_moe; do
            timeout 150 torchrun --standalone --nproc_per_node 2 tests/train/fsdp_gradients.py $f cuda 2>&1 | grep -E "OK|Error" | head -4
          done
          timeout 200 torchrun --standalone --nproc_per_node 2 -m vlmreg train examples/configs/qwen3_vl_tiny.toml --set trainer.device=cuda \
            --set trainer.steps=6 --set trainer.format_warmup_steps=4 --set trainer.save_every=3 --set eval.every=3 --output-dir /tmp/run2 2>&1 \
            | grep -E "^step|^error|checkpoint|Error" | tail -8 ;;
    broadcast) timeout 200 vlmreg bench broadcast --family qwen3_vl --size 2b --backend nccl --iters 10 2>&1 | tee "$OUT/broadcast_2b.json" | tail -20 ;;
    final) timeout 500 "${BENCH[@]}" --budget 32768 --modes vlmreg-packed,plain-padded --compile 2> "$OUT/final.err" \
             | tee "$OUT/policy_update_2b_final.json" | head -20 ;;
    disaggregated) timeout 300 vlmreg train examples/configs/qwen3_vl_tiny.toml --set trainer.device=cuda --set trainer.steps=4 \
             --set trainer.format_warmup_steps=2 --set rollout.engine=openai --set rollout.launch=true --set broadcast.transport=nccl \
             --set eval.every=0 --output-dir /tmp/run3 2>&1 | grep -E "^step|^error|launched|done" | tail -8
           python3 -c "import json; [print({k: r[k] for k in ('step', 'mismatch_kl', 'sync_s')}) for r in map(json.loads, open('/tmp/run3/metrics.jsonl'))]"
           grep -c "POST /v1/weights" /tmp/run3/server.log ;;
    update15) # issue 15: the update (vision encoder in one varlen call per block, compiled CompensatedAdamW) next to the
              # fair peers in one run; then the same update as before both changes; then a smaller budget (memory)
              timeout 330 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --compile --modes vlmreg-packed,hf-frozen,hf-liger-frozen \
                2> "$OUT/update15.err" | tee "$OUT/update15.json" | head -30; tail -3 "$OUT/update15.err"
              VLMREG_COMPILED_OPTIMIZER=0 timeout 150 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --compile --modes vlmreg-packed \
                --per-image-vision 2> "$OUT/update15_before.err" | tee "$OUT/update15_before.json" | head -8
              for budget in ${BUDGETS:-15360}; do
                timeout 150 "${BENCH[@]}" --budget $budget --warmup 2 --iters 5 --compile --modes vlmreg-packed 2> "$OUT/update15_$budget.err" \
                  | tee "$OUT/update15_$budget.json" | head -8
              done ;;
    recompute) # issue 15 with the vision tower trained: trainer.memory_budget_gib picks what recomputes; the GPU tests;
               # the frozen case under the same budget (nothing should recompute); the 2B GPU config as shipped
               [ -z "${NOTESTS:-}" ] && timeout 400 python3 -m pytest -q -p no:cacheprovider -s tests/modeling/test_recompute.py \
                 tests/train/test_gpu.py tests/train/test_optim.py 2>&1 | tee "$OUT/recompute_tests.log" | grep -E "passed|failed|Error|peak_gib" | tail -8
               for gib in ${GIBS-60}; do
                 timeout 200 "${BENCH[@]}" --budget ${MB:-16384} --warmup 2 --iters 5 --compile --modes vlmreg-packed --trainable-vision \
                   --memory-budget-gib $gib 2> "$OUT/recompute_$gib.err" | tee "$OUT/recompute_$gib.json" \
                   | grep -E 'seconds_per_step|"mfu|peak_memory|peak_reserved|alloc_retries|recomputed_|predicted_peak_gib|margin' 
               done
               [ -n "${FROZEN:-}" ] && timeout 150 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --compile --modes vlmreg-packed \
                 --memory-budget-gib 60 2> "$OUT/recompute_frozen.err" | tee "$OUT/recompute_frozen.json" | head -30 ;;
    peers60) # the shipped configuration (budget 16384, trainer.memory_budget_gib = 60) next to the fair peers, one process
              timeout 330 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --compile --memory-budget-gib 60 \
                --modes vlmreg-packed,hf-frozen,hf-liger-frozen 2> "$OUT/peers60.err" | tee "$OUT/peers60.json" \
                | grep -E '^  "|seconds_per_step|"mfu|peak_memory|alloc_retries|_vs_' ;;
    config2b) rm -rf /tmp/run2b; timeout 300 vlmreg train examples/configs/qwen3_vl_2b_gpu.toml --set trainer.steps=${STEPS:-4} --set eval.every=0 \
                --set logging.rollout_page_every=0 ${CONFIG_SETS:-} --output-dir /tmp/run2b 2>&1 | grep -vi warn | tail -12
              python3 -c "import json; [print({k: r.get(k) for k in ('step', 'reward_mean', 'update_s', 'rollout_s', 'step_s', 'update_peak_gib', 'predicted_peak_gib', 'recompute_layers', 'recompute_vision_blocks')}) for r in map(json.loads, open('/tmp/run2b/metrics.jsonl'))]" ;;
    dense30) # issue 30 item 5, the dense goals with the peers in the same process: the shipped 2B update (budget 16384,
             # compiled, memory budget 60 GiB, 2 warm-up and 5 timed steps) beside transformers and transformers + Liger, the
             # vision tower frozen (hf-frozen, hf-liger-frozen) and trained (hf-trained, hf-liger-trained): HOW="frozen
             # trained". HOOKED=1 first runs vlmreg's update alone with the vision FLOPs counted by hooks inside the
             # encoder during the timed steps, as before 2026-11-28 (they broke the compiled vision blocks' graphs): an A/B
             for how in ${HOW:-frozen trained}; do
               modes=vlmreg-packed,hf-$how,hf-liger-$how; extra=(); [ "$how" = trained ] && extra=(--trainable-vision)
               runs=(plain); [ -n "${HOOKED:-}" ] && runs=(hooked plain)
               for run in "${runs[@]}"; do
                 opts=(--modes "$modes"); [ "$run" = hooked ] && opts=(--modes vlmreg-packed --hooked-vision-count)
                 timeout 400 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --compile --memory-budget-gib 60 "${extra[@]}" \
                   "${opts[@]}" --output "$OUT/dense30_${how}_$run.json" 2> "$OUT/dense30_${how}_$run.err" > /dev/null
                 echo "dense30 $how $run: exit $?"; tail -2 "$OUT/dense30_${how}_$run.err" | cut -c1-300
                 python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(m, {k: d[m].get(k) for k in ('seconds_per_step',
                   'seconds_each', 'mfu', 'mfu_with_vision', 'peak_memory_gib')}) for m in d if isinstance(d[m], dict) and 'mfu' in d[m]
                   ] + [print({k: v for k, v in d.items() if k.startswith('packed_vs')})]" "$OUT/dense30_${how}_$run.json"
               done
             done ;;
    dense55) # issue 30 item 5: the shipped 2B update (budget 16384, compiled, memory budget 60 GiB) with the vision tower
             # frozen, then trained, each followed by one profiled step (top CUDA ops, how much of the step the GPU is busy)
             for how in frozen trained; do
               extra=(); [ "$how" = trained ] && extra=(--trainable-vision)
               timeout 240 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --compile --memory-budget-gib 60 --modes vlmreg-packed \
                 --profile "${extra[@]}" 2> "$OUT/dense55_$how.err" > "$OUT/dense55_$how.json"; echo "dense55 $how: exit $?"
               grep -E 'seconds_per_step|"mfu|peak_memory_gib|recomputed_' "$OUT/dense55_$how.json" | head -8
               grep -A28 "== profile" "$OUT/dense55_$how.err" | cut -c1-220 | head -32
             done ;;
    waits) # issue 30 item 5: where the host waits for the GPU. The 2B update as dense55 runs it, in one lease: "before" derives
           # the vision encoder's inputs on the device, indexes DeepStack by boolean masks and reads the step's sums before
           # queueing the optimizer step (the host waits in all three); "after" does none of them; "host" and "sums" each
           # change one; "profile" is "after" with one profiled step and one step under the sync debugger; "hostprof" one
           # step under cProfile (--compile compiles the vision blocks too since 2026-11-27 14:45 UTC, as trainer.compile);
           # "uncached" is "after" with the micro-batches' host inputs derived as before 2026-11-27 21:00 UTC (per grid
           # shape and per prompt now): HOW="frozen trained" VARIANTS="uncached after uncached after" for an A/B; "trace"
           # writes the profiled step (no Python stacks) as $OUT/trace_HOW.vlmreg-packed.json.gz, to be read elsewhere
           for how in ${HOW:-frozen}; do
             extra=(); [ "$how" = trained ] && extra=(--trainable-vision)
             for variant in ${VARIANTS:-before after profile}; do
               case $variant in
                 before) opts=(--device-vision-inputs --sums-first) ;; host) opts=(--sums-first) ;;
                 sums) opts=(--device-vision-inputs) ;; after) opts=() ;; profile) opts=(--profile --sync-debug) ;;
                 hostprof) opts=(--host-profile) ;; uncached) opts=(--uncached-host-inputs) ;;
                trace) opts=(--profile --trace "$OUT/trace_$how") ;;
               esac
               timeout 250 "${BENCH[@]}" --budget ${MB:-16384} --warmup 2 --iters 5 --compile --memory-budget-gib 60 --modes vlmreg-packed \
                 "${extra[@]}" "${opts[@]}" 2> "$OUT/waits_${how}_$variant.err" > "$OUT/waits_${how}_$variant.json"
               echo "waits $how $variant: exit $?"
               python3 -c "import json, sys; d = json.load(open(sys.argv[1]))['vlmreg-packed']; print({k: d.get(k) for k in
                 ('seconds_per_step', 'seconds_each', 'mfu', 'mfu_with_vision', 'peak_memory_gib', 'first_microbatch_s', 'host_queued_s',
                 'final_wait_s')})" "$OUT/waits_${how}_$variant.json"
               [ "$variant" = profile ] || [ "$variant" = trace ] && grep -E "^== |^ +[0-9.]+ ms|^ +[0-9]+  " "$OUT/waits_${how}_$variant.err" | cut -c1-200 | head -90
               [ "$variant" = hostprof ] && grep -A80 "^== host profile" "$OUT/waits_${how}_$variant.err" | cut -c1-170
             done
           done ;;
    trainedmem) # issue 30 item 5, the trained tower: what recomputing the vision blocks costs. Under the 60 GiB budget the
           # planner recomputes every vision block at 16,384 tokens a micro-batch (2026-11-27 17:53 UTC); TRAINEDMEM: runs
           # "BUDGET:GIB" each, the micro-batch token budget and the memory budget (GIB above 60 only to see the cost)
           for run in ${TRAINEDMEM:-16384:80 8192:60 12288:60}; do
             timeout 250 "${BENCH[@]}" --budget "${run%%:*}" --warmup 2 --iters 5 --compile --memory-budget-gib "${run#*:}" \
               --modes vlmreg-packed --trainable-vision 2> "$OUT/trainedmem_${run/:/_}.err" > "$OUT/trainedmem_${run/:/_}.json"
             echo "trainedmem $run: exit $?"; grep -h "^memory budget" "$OUT/trainedmem_${run/:/_}.err" | tail -1
             python3 -c "import json, sys; d = json.load(open(sys.argv[1]))['vlmreg-packed']; print({k: d.get(k) for k in
               ('seconds_per_step', 'seconds_each', 'mfu', 'mfu_with_vision', 'peak_memory_gib')})" "$OUT/trainedmem_${run/:/_}.json"
           done ;;
    optim) for opt in compensated fused; do  # the optimizer step's cost: CompensatedAdamW (the trainer's) vs torch's fused AdamW
             timeout 250 "${BENCH[@]}" --budget 16384 --warmup 2 --iters 5 --modes vlmreg-packed --compile --optimizer $opt 2> "$OUT/optim_$opt.err" \
               | tee "$OUT/optim_$opt.json" | head -12; tail -2 "$OUT/optim_$opt.err"
           done ;;
    compile) for budget in 32768; do
               timeout 300 "${BENCH[@]}" --budget $budget --modes vlmreg-packed --compile 2> "$OUT/compile.err" \
                 | tee "$OUT/policy_update_2b_compile_$budget.json" | head -8; tail -3 "$OUT/compile.err"
             done ;;
  esac
done
