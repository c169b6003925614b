#!/usr/bin/env bash
# The GPU session behind the vLLM figures in BENCHMARKS.md (one H100, torch 2.11, transformers 5.17, Python 3.12).
# The machine has no network and takes at most 64 MiB per transfer, so vLLM comes from ../shared/vllm-bundle in
# three parts, each copied into a git-ignored folder of the checkout and carried by its own command:
#   cp ../shared/vllm-bundle/*part-00 .gl/p0/; cp ../shared/vllm-bundle/*part-01 .gl/p1/
#   cp ../shared/vllm-bundle/{*part-02,SHA256SUMS,install.sh} .gl/p2/
#   run: bash benchmarks/vllm_session.sh part0      (carry .gl/p0)
#   run: bash benchmarks/vllm_session.sh part1      (carry .gl/p1)
#   run: bash benchmarks/vllm_session.sh part2 install ipc probe vllm  (carry .gl/p2 and .whl)
# .whl/ holds cattrs, math-verify and its parsers (`pip download --python-version 3.12 --no-deps ...`), and .whl/extra/ the
# packages the bundle left out that some families' vLLM model modules import (compressed-tensors==0.17.0,
# mistral_common 1.13.1, and their dependencies: loguru jsonschema jsonschema-specifications referencing rpds-py tiktoken regex
# pydantic-extra-types pycountry, cp312 manylinux wheels); install puts each in /tmp/site only where the machine lacks it.
#   run: bash benchmarks/vllm_session.sh embedded moe
# On two GPUs (nvidia-h200-x2): part0, part1, then
#   run: bash benchmarks/vllm_session.sh part2 install rawnccl nccl0      (carry .gl/p2 and .whl)
#   run: bash benchmarks/vllm_session.sh nccl1 tp2
#   run: bash benchmarks/vllm_session.sh ipc0 ipc1
# nccl0/nccl1: trainer on GPU 0, vLLM launched on GPU 1, NCCL syncs, max_off_policy_steps 0 / 1; rawnccl: the same
# bytes as one flat NCCL broadcast GPU 0 -> GPU 1; tp2: vLLM with tensor parallel 2 on both GPUs, logprob parity after
# a gloo sync to both workers; ipc0/ipc1: one GPU, CUDA IPC syncs (direct load), max_off_policy_steps 0 / 1;
# nccl0d/nccl1d: nccl0/nccl1 with direct loads (the workers replay copy plans from their NCCL staging buffers), with the
# run's exit status and wall time (a run that does not exit after its last step is killed at 420 s).
# fast0/fast1: one GPU, vLLM with CUDA graphs on the same GPU, CUDA IPC (direct load), the trainer's decoder layers
# compiled and no gradient checkpointing (micro-batches of 8192 tokens), max_off_policy_steps 0 / 1; fast0-noplan: fast0
# with VLMREG_COPY_PLAN=0 (every sync through vLLM's load_weights); copyref: one device-to-device copy of the same bytes
# (benchmarks/device_copy.py), the reference of the same-GPU sync target;
# budget48: the shipped 2B config (varlen, 16384-token micro-batches) with vLLM beside it and a 48 GiB memory budget;
# embedded-fast: the same trainer settings with the embedded engine; peers: the policy update against the fair peers
# (transformers with the vision tower frozen, with and without Liger kernels; liger-kernel's wheel in .whl/).
# onefile: a third party's transport into vLLM: the example plugin's one_file (vLLM on the same GPU, weight-transfer
# API), 3 steps, its trace counting the sender's and each worker's calls; profile: the compiled policy update with
# --profile (warm-up 2, so recompiles stay out of the figures).
# On four GPUs (nvidia-h100-x4 / h200-x4), issue 25: part0, part1, then
#   run: bash benchmarks/vllm_session.sh part2 install rawnccl fsdp22      (carry .gl/p2 and .whl)
#   run: bash benchmarks/vllm_session.sh tp2d nccl1d
#   run: bash benchmarks/vllm_session.sh servers3 twonode
# fsdp22: FSDP2 on GPUs 0-1, two vLLM servers on GPUs 2 and 3; tp2d: vLLM TP 2 with direct loads; servers3: one trainer, three
# servers; twonode: two torchrun agents as two nodes (c10d rendezvous on the host's address) and an attached vLLM.
# Issue 25 item 4, the NCCL sync against a raw broadcast, in one command (4 GPUs; about 7-9 minutes):
#   run: bash benchmarks/vllm_session.sh part2 install        (carry .gl/p2 and .whl; after part0 part1)
#   run: bash benchmarks/vllm_session.sh syncratio
# syncratio: `vlmreg bench broadcast` of the 2B shape GPU 0 -> GPU 1 (its raw_seconds: one flat NCCL broadcast of the
# same 3.44 GB) and GPU 0 -> GPUs 1-2, then a 6-step nccl0d-like run (trainer GPU 0, vLLM --enforce-eager launched on
# GPU 1, NCCL, direct loads, max_off_policy_steps 0, so the workers are asked for each sync during the update) and the
# same with vLLM --tensor-parallel-size 2 on GPUs 1-2; benchmarks/sync_ratio.py prints each step's sync_s next to the
# raw figure with where the time went (sync_ready/send/ack, the workers' receive/copy/tail). syncratio-raw,
# syncratio-tp1 and syncratio-tp2 are its parts (a run's part needs its raw part first, in the same command or $OUT).
# Issue 29, LoRA syncs (one GPU, after part0 part1 part2 install): lora-PRESET-RANK-HOW, PRESET language or all (the
# all-linear preset, vision tower trained), RANK 16 or 64, HOW adapters (only the LoRA factors travel, vLLM serves them
# with --enable-lora) or merged (broadcast.lora_sync = "merged": whole merged weights, as before); the 2B config with
# vLLM on the same GPU, CUDA IPC, eager vLLM, lr 1e-4, printing per step mismatch_kl, sync_s and sync_bytes, e.g.
#   run: bash benchmarks/vllm_session.sh lora-language-16-adapters lora-language-16-merged lora-language-64-adapters
#   run: bash benchmarks/vllm_session.sh lora-language-64-merged lora-all-16-adapters lora-all-16-merged
#   run: bash benchmarks/vllm_session.sh lora-all-64-adapters lora-all-64-merged
# (lora-language and lora-all run their four variants in a row: only where a command may run 20 minutes.)
# Steps run in the order given; results go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=/tmp/vsite:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts
TRAIN=(vlmreg train examples/configs/qwen3_vl_2b_gpu.toml --set trainer.steps=${STEPS:-6} --set trainer.save_every=0 --set eval.every=0 ${EXTRA_SETS:-})  # EXTRA_SETS: more --set KEY=VALUE for every run
VLLM=(--set rollout.engine=openai --set rollout.server=vllm --set rollout.launch=true --set rollout.launch_gpu=same
      --set rollout.gpu_memory_fraction=0.3 --set broadcast.transport=ipc)
DIRECT=(--set broadcast.vllm_load=direct)
FAST=(--set trainer.compile=true --set trainer.gradient_checkpointing=false --set trainer.max_tokens_per_microbatch=8192)
NEXT=(--set rollout.engine=openai --set rollout.server=vllm --set rollout.launch=true --set rollout.launch_gpu=next
      --set broadcast.transport=nccl)
summary() {  # per-step figures of a run directory
  python3 -c "
import json, sys
for r in map(json.loads, open(sys.argv[1] + '/metrics.jsonl')):
    print(json.dumps({k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in ('step', 'step_s', 'rollout_s', 'rollout_wait_s', 'update_s', 'sync_s', 'sync_bytes', 'mismatch_kl', 'tis_weight_mean', 'policy_version', 'off_policy_steps_max', 'reward_mean', 'samples', 'response_length', 'rollout_completions_per_server')}))
" "$1" | tee "$OUT/$2.jsonl"
}
stop_servers() {  # the vLLM servers of one run directory only: steps on other GPUs of this machine keep theirs
  pkill -f "[v]llm.entrypoints.openai.api_server --model $1" 2>/dev/null; sleep 2
}
lora_run() {  # lora_run PRESET RANK HOW: one LoRA run of issue 29 (see the header)
  local preset=$1 rank=$2 how=$3 name="lora-$1-$2-$3" targets=language frozen=true
  if [ "$preset" = all ]; then targets=all-linear; frozen=false; fi
  timeout 400 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" --set 'rollout.server_args=["--enforce-eager"]' \
    --set model.lora.targets="$targets" --set model.lora.r="$rank" --set model.lora.alpha="$((2 * rank))" \
    --set model.vlm.freeze_vision_encoder="$frozen" --set trainer.learning_rate=1e-4 --set broadcast.lora_sync="$how" \
    --output-dir "/dev/shm/run_$name" > "$OUT/${name}_train.log" 2>&1
  echo "exit $?"; grep -E "^step|^error|LoRA syncs|ready" "$OUT/${name}_train.log" | cut -c1-300 | tail -10
  grep -E "vlmreg worker|LoRA|lora|ERROR" "/dev/shm/run_$name/vllm.log" 2>/dev/null | cut -c1-200 | tail -8 > "$OUT/${name}_vllm.txt"
  cp "/dev/shm/run_$name/vllm.log" "$OUT/${name}_vllm.log" 2>/dev/null
  summary "/dev/shm/run_$name" "$name"; stop_servers "/dev/shm/run_$name"; rm -rf "/dev/shm/run_$name"
}
sync_raw() {  # sync_raw R: the 2B shape's step sync broadcast GPU 0 -> GPUs 1..R by vlmreg's Sender and as one flat buffer
  local r=$1 gpus=0,1
  if [ "$r" = 2 ]; then gpus=0,1,2; fi
  CUDA_VISIBLE_DEVICES=$gpus timeout 110 vlmreg bench broadcast --family qwen3_vl --size 2b --backend nccl --receivers "$r" \
    --iters 10 > "$OUT/syncratio_raw$r.json" 2> "$OUT/syncratio_raw$r.err"; echo "raw broadcast to $r receiver(s): exit $?"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('receivers', 'bytes', 'seconds', 'raw_seconds', 'ratio', 'verified')})" \
    "$OUT/syncratio_raw$r.json" || tail -3 "$OUT/syncratio_raw$r.err"
}
sync_run() {  # sync_run TP: the 6-step run with vLLM TP 1 (GPU 1) or TP 2 (GPUs 1-2), its syncs against the raw broadcast
  local tp=$1 gpus=0,1 args='["--enforce-eager"]' dir=/dev/shm/run_sync$1 started
  if [ "$tp" = 2 ]; then gpus=0,1,2; args='["--enforce-eager", "--tensor-parallel-size", "2"]'; fi
  started=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpus timeout "${SYNC_RUN_S:-225}" "${TRAIN[@]}" "${NEXT[@]}" "${DIRECT[@]}" --set trainer.max_off_policy_steps=0 \
    --set "rollout.server_args=$args" --output-dir "$dir" > "$OUT/syncratio_tp${tp}_train.log" 2>&1
  echo "TP $tp: exit $? after $(( $(date +%s) - started )) s (timeout ${SYNC_RUN_S:-225})"
  grep -E "^error|Error|ready after" "$OUT/syncratio_tp${tp}_train.log" | cut -c1-300 | tail -4
  grep -h "vlmreg worker" "$dir"/vllm*.log 2>/dev/null | cut -c1-300 | tail -8
  python3 benchmarks/sync_ratio.py --raw "$OUT/syncratio_raw$tp.json" --metrics "$dir/metrics.jsonl" --label "TP $tp" \
    | tee "$OUT/syncratio_tp$tp.jsonl"
  cp "$dir/vllm.log" "$OUT/syncratio_tp${tp}_vllm.log" 2>/dev/null; cp "$dir/metrics.jsonl" "$OUT/syncratio_tp${tp}_metrics.jsonl" 2>/dev/null
  stop_servers "$dir"; rm -rf "$dir"
}
declare -A NEEDS=([fsdp2a]=420 [think]=200 [fsdp22]=330 [fsdpemb]=200 [tp2d]=300 [servers3]=330 [twonode]=300 [nccl0d]=300 [nccl1d]=300 [one0]=300 [one1]=300 [rollout-profile]=420 [lora-language]=1600 [lora-all]=1600 [syncratio]=560 [syncratio-raw]=120 [syncratio-tp1]=230 [syncratio-tp2]=230)
for p in language all; do for r in 16 64; do for h in adapters merged; do NEEDS[lora-$p-$r-$h]=420; done; done; done
for step in "$@"; do
  # UNTIL (epoch seconds): a step that would not end before it is skipped, so one command keeps to the device's limit
  if [ -n "${UNTIL:-}" ] && [ $(( $(date +%s) + ${NEEDS[$step]:-60} )) -gt "$UNTIL" ]; then
    echo "== $step skipped: needs about ${NEEDS[$step]:-60} s, $(( UNTIL - $(date +%s) )) s left"; continue
  fi
  echo "== $step $(date +%T)"
  case $step in
    part0) cp .gl/p0/* /tmp/parts/ && ls -la /tmp/parts ;;
    part1) cp .gl/p1/* /tmp/parts/ && ls -la /tmp/parts ;;
    part2) cp .gl/p2/* /tmp/parts/ && ls -la /tmp/parts ;;
    install)
      PY=python3 bash /tmp/parts/install.sh /tmp/parts /tmp/vsite 2>&1 | tail -6
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
      # what the bundle left out but glm4v, qwen3_5(_moe) (compressed_tensors) and llava_onevision (mistral_common) import when
      # vLLM inspects their model classes (issue 26), with their dependencies where the machine lacks them
      for pair in compressed_tensors:compressed_tensors mistral_common:mistral_common loguru:loguru jsonschema:jsonschema \
                  jsonschema_specifications:jsonschema_specifications referencing:referencing rpds_py:rpds tiktoken:tiktoken regex:regex \
                  pydantic_extra_types:pydantic_extra_types pycountry:pycountry; do
        python3 -c "import ${pair#*:}" 2> /dev/null && continue
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/${pair%%:*}-*.whl >> "$OUT/install.log" 2>&1 \
          && echo "installed ${pair%%:*}" || echo "extra wheel failed: ${pair%%:*}"
      done
      for d in . plugins/*/; do  # one at a time: a plugin that fails to install does not take the others with it
        python3 -m pip install -q --no-deps --no-build-isolation -e "$d" >> "$OUT/install.log" 2>&1 || echo "install failed: $d"
      done
      python3 -c "import torch, transformers, vllm, vlmreg; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())" ;;
    ipc) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/broadcast/test_ipc.py 2>&1 | tail -4 ;;
    gputests) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/broadcast/test_ipc.py tests/train/test_optim.py \
                tests/train/test_packing.py tests/train/test_gpu.py 2>&1 | tee "$OUT/gputests.log" | tail -6 ;;
    probe) timeout 500 python3 benchmarks/vllm_probe.py --family qwen3_vl --size 2b ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" | grep -E '^\{|Error|error|^[0-9]{3}:|^[0-9]+: ' | tail -24; cp /tmp/vllm-probe/vllm.log "$OUT/probe_server.log" ;;
    probe-moe) timeout 400 python3 benchmarks/vllm_probe.py --family qwen3_vl_moe --size small --server-args=--enforce-eager 2>&1 \
                 | tee "$OUT/probe_moe.log" | grep -E '^\{|Error|error' | tail -12 ;;
    vllm) timeout 560 "${TRAIN[@]}" "${VLLM[@]}" --output-dir /tmp/run_vllm 2>&1 | tee "$OUT/vllm_train.log" | grep -E "^step|^error|launched|ready|vLLM" | tail -12
          summary /tmp/run_vllm vllm_2b; cp /tmp/run_vllm/vllm.log "$OUT/vllm_server.log" 2>/dev/null ;;
    vllm-direct) timeout 560 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" --output-dir /tmp/run_direct 2>&1 | tee "$OUT/direct_train.log" | grep -E "^step|^error|ready" | tail -8
          summary /tmp/run_direct vllm_direct_2b ;;
    syncratio) sync_raw 1; sync_raw 2; sync_run 1; sync_run 2 ;;
    syncratio-raw) sync_raw 1; sync_raw 2 ;;
    syncratio-tp1|syncratio-tp2) sync_run "${step#syncratio-tp}" ;;
    rawnccl) timeout 240 vlmreg bench broadcast --family qwen3_vl --size 2b --backend nccl 2>&1 | tee "$OUT/rawnccl.log" | tail -14 ;;
    nccl0|nccl1) timeout 560 "${TRAIN[@]}" "${NEXT[@]}" --set trainer.max_off_policy_steps="${step#nccl}" --output-dir "/dev/shm/run_$step" 2>&1 \
                   | tee "$OUT/${step}_train.log" | grep -E "^step|^error|ready" | tail -10
                 summary "/dev/shm/run_$step" "$step"; cp "/dev/shm/run_$step/vllm.log" "$OUT/${step}_server.log" 2>/dev/null
                 stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    nccl0d|nccl1d) n=${step#nccl}; n=${n%d}; started=$(date +%s)
                   timeout 420 "${TRAIN[@]}" "${NEXT[@]}" "${DIRECT[@]}" --set trainer.max_off_policy_steps="$n" --output-dir "/dev/shm/run_$step" \
                     > "$OUT/${step}_train.log" 2>&1; echo "exit $? after $(( $(date +%s) - started )) s (timeout 420)"
                   grep -E "^step|^error|ready" "$OUT/${step}_train.log" | tail -10
                   grep "vlmreg worker" "/dev/shm/run_$step/vllm.log" | cut -c1-200 | tail -10
                   summary "/dev/shm/run_$step" "$step"; cp "/dev/shm/run_$step/vllm.log" "$OUT/${step}_server.log" 2>/dev/null
                   stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    one0|one1) # the table's one-GPU row: the shipped 2B config, vLLM on the trainer's GPU (CUDA graphs), CUDA IPC, direct loads,
               # memory budget 48 GiB beside it, max_off_policy_steps 0 / 1
               started=$(date +%s)
               timeout 400 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" --set trainer.memory_budget_gib=48 --set trainer.max_off_policy_steps="${step#one}" \
                 --output-dir "/dev/shm/run_$step" > "$OUT/${step}_train.log" 2>&1; echo "exit $? after $(( $(date +%s) - started )) s (timeout 400)"
               grep -E "^step|^error|ready" "$OUT/${step}_train.log" | tail -10
               summary "/dev/shm/run_$step" "$step"; stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    rollout-profile) # issue 25 item 7: where vLLM's generation time goes (benchmarks/rollout_profile.py), one GPU
               timeout 560 python3 benchmarks/rollout_profile.py ${PROFILE_ARGS:-} > "$OUT/rollout_profile.jsonl" 2> "$OUT/rollout_profile.err"
               echo "exit $?"; cat "$OUT/rollout_profile.jsonl"; grep -E "Error|error" "$OUT/rollout_profile.err" | tail -5
               cp /dev/shm/rollout_profile/variant-0/vllm.log "$OUT/rollout_profile_vllm0.log" 2>/dev/null; stop_servers /dev/shm/rollout_profile ;;
    lora-language|lora-all) for rank in 16 64; do for how in adapters merged; do lora_run "${step#lora-}" "$rank" "$how"; done; done ;;
    lora-*-*-*) IFS=- read -r _ preset rank how <<< "$step"; lora_run "$preset" "$rank" "$how" ;;
    ipc0|ipc1) timeout 560 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" --set 'rollout.server_args=["--enforce-eager"]' --set trainer.max_off_policy_steps="${step#ipc}" --output-dir "/dev/shm/run_$step" 2>&1 \
                 | tee "$OUT/${step}_train.log" | grep -E "^step|^error|ready" | tail -10
               summary "/dev/shm/run_$step" "$step"; stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    tp2) timeout 500 python3 benchmarks/vllm_probe.py --family qwen3_vl --size 2b --transport gloo --launch-gpu same --quick \
           --server-args="--tensor-parallel-size 2" --output /tmp/probe_tp2 2>&1 | tee "$OUT/tp2.log" | grep -E '^\{|Error|error' | tail -8
         cp /tmp/probe_tp2/vllm.log "$OUT/tp2_server.log" 2>/dev/null ;;
    copyref) python3 benchmarks/device_copy.py --gb 3.44 --tensors 310 2>&1 | tee "$OUT/copyref.log" ;;
    fast0-noplan) VLMREG_COPY_PLAN=0 TORCH_LOGS=recompiles timeout 570 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" "${FAST[@]}" \
                    --set trainer.max_off_policy_steps=0 --output-dir "/dev/shm/run_$step" > "$OUT/${step}_train.log" 2>&1
                  grep -E "^step|^error|ready" "$OUT/${step}_train.log" | tail -10
                  summary "/dev/shm/run_$step" "$step"; cp "/dev/shm/run_$step/vllm.log" "$OUT/${step}_server.log" 2>/dev/null
                  grep "vlmreg worker" "$OUT/${step}_server.log" | cut -c1-200 | tail -12
                  stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    fast0|fast1) TORCH_LOGS=recompiles timeout 570 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" "${FAST[@]}" --set trainer.max_off_policy_steps="${step#fast}" \
                   --output-dir "/dev/shm/run_$step" > "$OUT/${step}_train.log" 2>&1
                 grep "vlmreg worker" "/dev/shm/run_$step/vllm.log" | cut -c1-200 | tail -12
                 grep -E "^step|^error|ready" "$OUT/${step}_train.log" | tail -10
                 summary "/dev/shm/run_$step" "$step"; cp "/dev/shm/run_$step/vllm.log" "$OUT/${step}_server.log" 2>/dev/null
                 stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    fsdp3) # issue 16 on a 4-GPU machine: an FSDP2 trainer on GPUs 0-1 (torchrun), vLLM launched on GPU 2 (NCCL syncs)
           sed '/^memory_budget_gib/d' examples/configs/qwen3_vl_2b_gpu.toml > examples/configs/fsdp_2b.toml  # one process only
           timeout 420 torchrun --standalone --nproc_per_node 2 -m vlmreg train examples/configs/fsdp_2b.toml --set trainer.steps=${STEPS:-5} \
             --set trainer.save_every=0 --set eval.every=0 --set trainer.compile=false "${NEXT[@]}" --output-dir /dev/shm/run_fsdp3 \
             > "$OUT/fsdp3_train.log" 2>&1; echo "exit $?"; cp /dev/shm/run_fsdp3/vllm.log "$OUT/fsdp3_vllm.log" 2>/dev/null
           grep -E "^step|^error|ready|launched|Error" "$OUT/fsdp3_train.log" | cut -c1-300 | tail -12
           summary /dev/shm/run_fsdp3 fsdp3; grep -E "vlmreg worker|ERROR" /dev/shm/run_fsdp3/vllm.log | cut -c1-200 | tail -6
           stop_servers /dev/shm/run_fsdp3; rm -rf /dev/shm/run_fsdp3 ;;
    tp2-train) # issue 16: one trainer process on GPU 0, vLLM with tensor parallel 2 on GPUs 1-2 (NCCL syncs reach both workers)
         timeout 400 "${TRAIN[@]}" "${NEXT[@]}" --set trainer.steps=${STEPS:-5} --set 'rollout.server_args=["--tensor-parallel-size", "2"]' \
           --output-dir /dev/shm/run_tp2 > "$OUT/tp2_train.log" 2>&1; echo "exit $?"; cp /dev/shm/run_tp2/vllm.log "$OUT/tp2_vllm.log" 2>/dev/null
         grep -E "^step|^error|ready|launched|worker\(s\)|Error" "$OUT/tp2_train.log" | cut -c1-300 | tail -12
         summary /dev/shm/run_tp2 tp2; grep -E "vlmreg worker|ERROR" /dev/shm/run_tp2/vllm.log | cut -c1-200 | tail -6
         stop_servers /dev/shm/run_tp2; rm -rf /dev/shm/run_tp2 ;;
    fsdp22) # issue 25 item 5: an FSDP2 trainer on GPUs 0-1 (torchrun), two vLLM servers launched on GPUs 2 and 3, NCCL, direct loads
            sed '/^memory_budget_gib/d' examples/configs/qwen3_vl_2b_gpu.toml > /tmp/fsdp_2b.toml  # the memory budget is for one process only: every layer recomputes instead
            started=$(date +%s)
            VLMREG_STACKS_EVERY=${STACKS:-400} timeout 520 torchrun --standalone --nproc_per_node 2 -m vlmreg train /tmp/fsdp_2b.toml --set trainer.gradient_checkpointing=true --set trainer.steps=${STEPS:-10} \
              --set trainer.save_every=0 --set eval.every=0 --set trainer.compile=false "${NEXT[@]}" "${DIRECT[@]}" --set rollout.servers=2 ${FSDP_SETS:-} \
              --output-dir /dev/shm/run_fsdp22 > "$OUT/fsdp22_train.log" 2>&1; echo "exit $? after $(( $(date +%s) - started )) s (timeout 520)"
            grep -E "^step|^error|ready|launched|worker\(s\)|Error" "$OUT/fsdp22_train.log" | cut -c1-300 | tail -16
            summary /dev/shm/run_fsdp22 fsdp22; grep -hE "vlmreg worker|ERROR" /dev/shm/run_fsdp22/vllm-*.log | cut -c1-200 | tail -8
            cp /dev/shm/run_fsdp22/vllm-0.log "$OUT/fsdp22_vllm0.log" 2>/dev/null
            stop_servers /dev/shm/run_fsdp22; rm -rf /dev/shm/run_fsdp22 ;;
    fsdpemb) # an FSDP2 trainer on GPUs 0-1 with the embedded engine, 2 steps; every rank's stacks every 150 s if it seems stuck
            sed '/^memory_budget_gib/d' examples/configs/qwen3_vl_2b_gpu.toml > /tmp/fsdp_2b.toml  # the memory budget is for one process only: every layer recomputes instead
            started=$(date +%s)
            VLMREG_STACKS_EVERY=${STACKS:-150} timeout 320 torchrun --standalone --nproc_per_node 2 -m vlmreg train /tmp/fsdp_2b.toml --set trainer.gradient_checkpointing=true \
              --set trainer.steps=2 --set trainer.save_every=0 --set eval.every=0 --set trainer.compile=false ${FSDP_SETS:-} --output-dir /dev/shm/run_fsdpemb \
              > "$OUT/fsdpemb_train.log" 2>&1; echo "exit $? after $(( $(date +%s) - started )) s (timeout 320)"
            grep -E "^step|^error|Error" "$OUT/fsdpemb_train.log" | cut -c1-300 | tail -8; summary /dev/shm/run_fsdpemb fsdpemb
            grep -B2 -A25 "most recent call first" "$OUT/fsdpemb_train.log" | grep -E "File|Thread" | cut -c1-200 | head -60; rm -rf /dev/shm/run_fsdpemb ;;
    tp2d|servers3) # tp2d: one trainer on GPU 0, vLLM with tensor parallel 2 on GPUs 1-2, NCCL, direct loads (copy plans replayed by both
            # workers from their staging buffers); servers3: one trainer on GPU 0, three vLLM servers on GPUs 1-3, max_off_policy_steps 1
            if [ "$step" = tp2d ]; then extra=(--set 'rollout.server_args=["--tensor-parallel-size", "2"]'); else extra=(--set rollout.servers=3 --set trainer.max_off_policy_steps=1); fi
            started=$(date +%s)
            timeout 400 "${TRAIN[@]}" "${NEXT[@]}" "${DIRECT[@]}" "${extra[@]}" --output-dir "/dev/shm/run_$step" > "$OUT/${step}_train.log" 2>&1
            echo "exit $? after $(( $(date +%s) - started )) s (timeout 400)"
            grep -E "^step|^error|ready|launched|worker\(s\)|Error" "$OUT/${step}_train.log" | cut -c1-300 | tail -12
            summary "/dev/shm/run_$step" "$step"; grep -hE "vlmreg worker|ERROR" /dev/shm/run_$step/vllm*.log | cut -c1-200 | tail -12
            stop_servers "/dev/shm/run_$step"; rm -rf "/dev/shm/run_$step" ;;
    fsdp2a) # issue 25 item 5 where only two GPUs are lent: an FSDP2 trainer on GPUs 0-1 (torchrun) and vLLM attached on GPU 1
            # beside rank 1 (35% of its memory); the weight group is rank 0 (GPU 0) and vLLM's worker (GPU 1), NCCL, direct loads
            KEY=$(python3 -c "import secrets; print(secrets.token_urlsafe(24))")
            sed '/^memory_budget_gib/d' examples/configs/qwen3_vl_2b_gpu.toml > /tmp/fsdp_2b.toml  # the memory budget is for one process only
            CUDA_VISIBLE_DEVICES=1 VLMREG_API_KEY=$KEY python3 benchmarks/attached_vllm.py /tmp/fsdp_2b.toml --host 127.0.0.1 --port 8100 \
              --dir /dev/shm/attached2 --server-args "--gpu-memory-utilization 0.35" > "$OUT/fsdp2a_vllm.log" 2>&1 &
            vllm_pid=$!
            for i in $(seq 1 75); do
              curl -sf -H "Authorization: Bearer $KEY" http://127.0.0.1:8100/health > /dev/null && break
              kill -0 "$vllm_pid" 2> /dev/null || { echo "attached vLLM exited before it was ready:"; tail -5 "$OUT/fsdp2a_vllm.log"; break; }
              sleep 4
            done
            echo "attached vLLM ready after $((i * 4)) s"
            started=$(date +%s)
            VLMREG_API_KEY=$KEY VLMREG_STACKS_EVERY=${STACKS:-400} timeout 420 torchrun --standalone --nproc_per_node 2 -m vlmreg train /tmp/fsdp_2b.toml \
              --set trainer.gradient_checkpointing=true --set trainer.steps=${STEPS:-10} --set trainer.save_every=0 --set eval.every=0 \
              --set trainer.compile=false --set rollout.engine=openai --set rollout.server=vllm --set rollout.url=http://127.0.0.1:8100 \
              --set broadcast.transport=nccl --set broadcast.vllm_load=direct ${FSDP_SETS:-} --output-dir /dev/shm/run_fsdp2a \
              > "$OUT/fsdp2a_train.log" 2>&1; echo "exit $? after $(( $(date +%s) - started )) s (timeout 420)"
            grep -E "^step|^error|worker\(s\)|Error" "$OUT/fsdp2a_train.log" | cut -c1-300 | tail -14
            summary /dev/shm/run_fsdp2a fsdp2a; grep -E "vlmreg worker|ERROR" "$OUT/fsdp2a_vllm.log" | cut -c1-200 | tail -6
            nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader
            stop_servers /dev/shm/attached2; rm -rf /dev/shm/run_fsdp2a /dev/shm/attached2 ;;
    think) # issue 26 item 7 through vLLM: the family run that `vllm_families.sh both qwen3_5` left in /tmp/engine/qwen3_5, again with
           # rollout.thinking_budget = 4 (vLLM's thinking_token_budget and --reasoning-config), 2 steps; each completion's thinking
           # ended by vLLM (a hit: the end marker exactly 4 thinking tokens in, drawn with logprob 0 in the answer vLLM returned)
           timeout 400 vlmreg train /tmp/engine/qwen3_5/train.toml --set rollout.thinking_budget=4 --set rollout.max_tokens=24 \
             --set trainer.steps=2 --output-dir /dev/shm/run_think --overwrite > "$OUT/think_train.log" 2>&1
           echo "exit $?"; grep -E "^step|^error|Error" "$OUT/think_train.log" | cut -c1-300 | tail -6
           python3 -c "
import json, sys
for r in map(json.loads, open('/dev/shm/run_think/metrics.jsonl')):
    print({k: r.get(k) for k in ('step', 'samples', 'thinking_budget_hits', 'mismatch_kl', 'response_length')})" 2>&1
           grep -E "reasoning|thinking" /dev/shm/run_think/vllm.log | head -3 | cut -c1-300; cp /dev/shm/run_think/vllm.log "$OUT/think_vllm.log" 2>/dev/null
           stop_servers /dev/shm/run_think ;;
    twonode) # issue 25 item 6 on one host: two torchrun agents as two "nodes" (c10d rendezvous on the host's address, one GPU each)
             # and a vLLM attached on GPU 2, the weight group's address given explicitly (not loopback)
             IP=$(hostname -I | awk '{print $1}'); KEY=$(python3 -c "import secrets; print(secrets.token_urlsafe(24))"); echo "host address $IP"
             sed '/^memory_budget_gib/d' examples/configs/qwen3_vl_2b_gpu.toml > /tmp/fsdp_2b.toml  # the memory budget is for one process only: every layer recomputes instead
             CUDA_VISIBLE_DEVICES=2 VLMREG_API_KEY=$KEY python3 benchmarks/attached_vllm.py /tmp/fsdp_2b.toml --host 0.0.0.0 --port 8100 \
               --dir /dev/shm/attached > "$OUT/twonode_vllm.log" 2>&1 &
             for i in $(seq 1 60); do curl -sf -H "Authorization: Bearer $KEY" "http://$IP:8100/health" > /dev/null && break; sleep 4; done
             echo "attached vLLM ready after $((i * 4)) s"
             RUN=(-m vlmreg train /tmp/fsdp_2b.toml --set trainer.gradient_checkpointing=true --set trainer.steps=3 --set trainer.save_every=0 --set eval.every=0 --set trainer.compile=false
                  --set rollout.engine=openai --set rollout.server=vllm --set rollout.url=http://$IP:8100 --set broadcast.transport=nccl
                  --set broadcast.host=$IP --set broadcast.port=29555 --set broadcast.vllm_load=direct --output-dir /dev/shm/run_twonode)
             AGENT=(torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "$IP:29400" --rdzv-id twonode)
             started=$(date +%s)
             CUDA_VISIBLE_DEVICES=1 VLMREG_API_KEY=$KEY timeout 300 "${AGENT[@]}" --node-rank 1 --rdzv-conf is_host=false "${RUN[@]}" > "$OUT/twonode_node1.log" 2>&1 &
             CUDA_VISIBLE_DEVICES=0 VLMREG_API_KEY=$KEY timeout 300 "${AGENT[@]}" --node-rank 0 --rdzv-conf is_host=true "${RUN[@]}" > "$OUT/twonode_node0.log" 2>&1
             echo "node 0: exit $? after $(( $(date +%s) - started )) s"; wait %2 2>/dev/null; echo "node 1: exit $?"
             grep -hE "^step|^error|worker\(s\)|Error" "$OUT"/twonode_node*.log | cut -c1-300 | tail -10
             summary /dev/shm/run_twonode twonode; grep -E "vlmreg worker|ERROR" "$OUT/twonode_vllm.log" | cut -c1-200 | tail -4
             stop_servers /dev/shm/attached; rm -rf /dev/shm/run_twonode /dev/shm/attached ;;
    budget48) # the shipped 2B config with vLLM on the same GPU (30% of it) and trainer.memory_budget_gib = 48 beside it
              timeout 500 "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" --set trainer.memory_budget_gib=48 ${BUDGET_SETS:-} \
                --output-dir /dev/shm/run_budget48 > "$OUT/budget48_train.log" 2>&1
              grep -E "^step|^error|ready|memory budget" "$OUT/budget48_train.log" | tail -10
              python3 -c "import json; [print({k: round(r[k], 3) if isinstance(r.get(k), float) else r.get(k) for k in ('step', 'step_s', 'update_s', 'sync_s', 'mismatch_kl', 'update_peak_gib', 'predicted_peak_gib', 'recompute_layers', 'recompute_vision_blocks')}) for r in map(json.loads, open('/dev/shm/run_budget48/metrics.jsonl'))]"
              nvidia-smi --query-gpu=memory.used,memory.total --format=csv
              stop_servers /dev/shm/run_budget48; rm -rf /dev/shm/run_budget48 ;;
    embedded-fast) timeout 400 "${TRAIN[@]}" "${FAST[@]}" --output-dir /dev/shm/run_embedded_fast > "$OUT/embedded_fast_train.log" 2>&1
                   grep -E "^step|^error" "$OUT/embedded_fast_train.log" | tail -8
                   summary /dev/shm/run_embedded_fast embedded_fast; rm -rf /dev/shm/run_embedded_fast ;;
    peers) timeout 560 python3 benchmarks/policy_update.py --size 2b --device cuda --attn varlen --image-size 448 --min-completion 64 \
             --max-completion 768 --samples 64 --warmup 1 --iters 3 --budget 16384 --compile --modes vlmreg-packed,hf-frozen,hf-liger-frozen \
             > "$OUT/peers.json" 2> "$OUT/peers.err"; head -40 "$OUT/peers.json"; tail -5 "$OUT/peers.err" ;;
    onefile) python3 -m pip install -q --no-deps --no-build-isolation -e examples/plugins/vlmreg-example-extras >> "$OUT/install.log" 2>&1 || echo "install failed"
             rm -f /tmp/extras_trace.txt
             VLMREG_EXTRAS_TRACE=/tmp/extras_trace.txt timeout 500 vlmreg train examples/configs/qwen3_vl_2b_gpu.toml --set trainer.steps=3 --set trainer.save_every=0 \
               --set eval.every=0 "${VLLM[@]}" --set broadcast.transport=one_file --set 'rollout.server_args=["--enforce-eager"]' \
               --output-dir /dev/shm/run_onefile > "$OUT/onefile_train.log" 2>&1
             grep -E "^step|^error|ready|joining" "$OUT/onefile_train.log" | tail -8; summary /dev/shm/run_onefile onefile
             sort /tmp/extras_trace.txt | uniq -c; cp /dev/shm/run_onefile/vllm.log "$OUT/onefile_server.log" 2>/dev/null
             stop_servers /dev/shm/run_onefile; rm -rf /dev/shm/run_onefile ;;
    update15) env -u PYTHONPATH bash benchmarks/gpu_session.sh update15 ;;  # the policy update of issue 15 (no vLLM needed)
    profile) timeout 400 python3 benchmarks/policy_update.py --size 2b --device cuda --attn varlen --image-size 448 --min-completion 64 \
               --max-completion 768 --samples 64 --warmup 2 --iters 5 --budget 16384 --compile --modes vlmreg-packed --profile \
               > "$OUT/profile.json" 2> "$OUT/profile.err"; head -9 "$OUT/profile.json"; grep -A12 "== profile" "$OUT/profile.err" | cut -c1-150 ;;
    embedded) timeout 400 "${TRAIN[@]}" --output-dir /tmp/run_embedded 2>&1 | tee "$OUT/embedded_train.log" | grep -E "^step|^error" | tail -8
              summary /tmp/run_embedded embedded_2b ;;
    moe) timeout 400 vlmreg train examples/configs/qwen3_vl_moe_tiny.toml --set model.size=small --set model.dtype=bfloat16 \
           --set model.attn_implementation=sdpa --set trainer.device=cuda --set trainer.steps=3 --set eval.every=0 "${VLLM[@]}" \
           --set rollout.server_args='["--enforce-eager"]' --output-dir /tmp/run_moe 2>&1 | tee "$OUT/moe_train.log" | grep -E "^step|^error|ready" | tail -6
         summary /tmp/run_moe moe_small; cp /tmp/run_moe/vllm.log "$OUT/moe_server.log" 2>/dev/null ;;
  esac
done
