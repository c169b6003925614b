#!/usr/bin/env bash
# The GPU session behind the vLLM figures in BENCHMARKS.md (one H100, torch 2.11, transformers 5.17, Python 3.12).
# The machine has no network and takes at most 64 MiB per transfer, so vLLM comes from ../shared/vllm-bundle in
# three parts, each copied into a git-ignored folder of the checkout and carried by its own command:
#   cp ../shared/vllm-bundle/*part-00 .gl/p0/; cp ../shared/vllm-bundle/*part-01 .gl/p1/
#   cp ../shared/vllm-bundle/{*part-02,SHA256SUMS,install.sh} .gl/p2/
#   run: bash benchmarks/vllm_session.sh part0      (carry .gl/p0)
#   run: bash benchmarks/vllm_session.sh part1      (carry .gl/p1)
#   run: bash benchmarks/vllm_session.sh part2 install ipc probe vllm  (carry .gl/p2 and .whl)
# A call carries at most 64 MiB, the .git folder included: once the checkout and a 60 MiB part no longer fit, carry the
# bundle as three 48 MiB chunks instead (made here once: cat ../shared/vllm-bundle/*part-0? | split -b 50331648 -d -a 1
# - all. and all.N moved into .gl/cN/, SHA256SUMS and install.sh into .gl/c2/):
#   run: bash benchmarks/vllm_session.sh chunk0   (carry .gl/c0), chunk1 (carry .gl/c1), then chunk2 install ... (carry
#   .gl/c2; chunk2 cuts the joined chunks into the bundle's parts in /tmp/parts, checked by install against SHA256SUMS).
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
# raw figure with where the time went (sync_ready/send/ack, the workers' receive/copy/tail), also in $OUT/syncratio.jsonl,
# the logs in $OUT/syncratio-logs.tgz. syncratio-raw, syncratio-tp1 and syncratio-tp2 are its parts (a run's part needs
# its raw part first, in the same command). SYNC_MAX_TOKENS (default 256) shortens the runs' completions: the syncs do
# not depend on them, and eager vLLM's 256-token rollouts take 9-11 s a step.
# Issue 29, LoRA syncs: lora-PRESET-RANK-HOW, PRESET language or all (the all-linear preset, vision tower trained), RANK 16
# or 64, HOW adapters (only the LoRA factors travel, vLLM serves them with --enable-lora: one live adapter rewritten in
# place each sync) or merged (broadcast.lora_sync = "merged": whole merged weights); the 2B config with vLLM on the
# trainer's GPU, CUDA IPC, direct loads, vLLM with CUDA graphs (LORA_EAGER=1: --enforce-eager, as the first run had),
# trainer not compiled, memory budget LORA_BUDGET GiB (44: room for vLLM's 30% on an 80 GB card), lr 1e-4, printing per
# step sync_s and its parts (sync_transfer_s: the sender and the request; sync_request_s: the request, the workers'
# receive and load included; sync_adapter_config_s / sync_adapter_load_s: the adapter's config file and the
# /v1/load_lora_adapter of the first version, 0 for later live ones), rollout_s, mismatch_kl, sync_bytes.
# On four GPUs (nvidia-h100-x4 / h200-x4), after part0 part1 part2 install, all eight in one call, four at a time:
#   run: UNTIL=$(( $(date +%s) + 580 )) bash benchmarks/vllm_session.sh lora-par-language lora-par-all
# lora-par-language: language 16/64 x adapters/merged side by side on GPUs 0-3 (CUDA_VISIBLE_DEVICES per run);
# lora-par-all: the same for all-linear. Each run's table goes to stdout and $OUT/lora.jsonl (one line a step, with its
# run), the logs to $OUT/lora-logs.tgz (the $OUT file limit is 8). One run on GPU 0 (LORA_GPU=N: GPU N), e.g. in a lane of
# benchmarks/lanes.sh: bash ... lora-language-16-adapters
# Issue 30, the Qwen3-VL-30B-A3B shape on 4 GPUs (nvidia-h200-x4), no vLLM needed, one command (carry .whl):
#   run: bash benchmarks/vllm_session.sh moe30
# moe30 = moe30-setup moe30-update moe30-peer moe30-sync moe30-compile moe30-summary, each with its own timeout, within
# MOE_BUDGET seconds (570):
# moe30-setup: the small wheels and three editable installs (vlmreg, vlmreg-qwen-common, vlmreg-qwen3-vl-moe);
# moe30-update: torchrun x4, FSDP2, benchmarks/policy_update.py vlmreg-packed on the 30b-a3b shape (random init), the
# family's grouped experts, then transformers' grouped_mm experts on the same model; moe30-peer: transformers' own
# forward+backward (hf-frozen: vision frozen, sdpa, padded batches of 4, labels loss, AdamW) on the same shape and
# GPUs; moe30-sync: vlmreg bench broadcast --size 30b-a3b --backend nccl (GPU 0 -> GPU 1). A full-depth update that
# fails is run again with MOE_FALLBACK_LAYERS (24) decoder layers, the peer then at that depth too; a full-depth sync
# that fails likewise. moe30-compile (only with 200 s left): the update with its decoder layers compiled. The summary
# (moe30_summary.json) prints seconds/step, tokens/s, MFU (active parameters), peak GiB and the sync ratio.
# moe30-onebatch (run after moe30-setup, within MOE_BUDGET): the update with each rank's tokens in one micro-batch of
# MOE_ONE_BUDGET (24576) tokens and every decoder layer recomputing (then two micro-batches of 12288): FSDP2 gathers the
# weights per micro-batch, which the figures of 2026-11-27 point to as where the time goes (BENCHMARKS.md).
#   run: bash benchmarks/vllm_session.sh moe30-setup moe30-onebatch     (carry .whl; on a lease without the vLLM bundle)
# MOE_EXTRA: more policy_update.py options for every moe30 update run (e.g. --prefetch 2).
# moe30-same (after moe30-setup): the 25.6% options of the second lease beside transformers' own MoE forward and backward in
# the same process; moe30-shardsync: the whole model's sync from an FSDP2 trainer of MOE_SHARDS (3) ranks to a receiver
# on the next GPU (`vlmreg bench broadcast --shards`), against a raw broadcast of the same bytes (MOE_SYNC_RUNS="2:2048
# 3:2048 2:0": trainer ranks and MiB gathered ahead, per run; MOE_SYNC_OPTS=--profile: one more sync profiled on rank 0,
# how long its GPU broadcast, gathered and copied, and how much of the broadcasting a gather ran beside). One call (carry .whl):
#   run: export MOE_DEADLINE=$(( $(date +%s) + 560 )); bash benchmarks/vllm_session.sh moe30-setup moe30-shardsync moe30-same
# moe30-profile (after moe30-setup): one profiled step of the moe30-update run; rank 0 prints the top CUDA ops and how
# much of the GPU's busy time is NCCL collectives, to tell gathers from matmuls before choosing the next lever.
# moe-e2e (after part0 part1 part2 install; GPUs 0-2, e.g. in a lane): the same shape with MOE_E2E_LAYERS (24) decoder
# layers trained by FSDP2 on GPUs 0-1 beside a vLLM it launches on GPU 2, NCCL syncs, STEPS (4) steps: step, rollout,
# update and sync times and mismatch_kl per step in $OUT/moe_e2e.jsonl (half depth to keep the call within the device's
# time: the first sync, vLLM's start and the checkpoint it loads grow with the depth). Full depth on 4 x H200:
# MOE_E2E_LAYERS=48 MOE_E2E_TRAINERS=3 MOE_E2E_GPUS=0,1,2,3 (3 trainer ranks, vLLM on GPU 3 at the share vllm_room
# leaves it beside a staged 61 GB sync, about 0.57). The run's final checkpoint (every rank's optimizer state) comes
# after the last step's metrics; a run stopped by MOE_E2E_S during it has still measured every step.
# Issue 28 item 4, video through vLLM (one GPU, after part0 part1 part2 install): `video` runs (1) `vlmreg check --engine vllm
# --tiny qwen3_vl --no-sync`, whose video case sends a 5-frame 90x70 clip as the trainer sends it (PNG frames resized by
# engine_video in vLLM's data:video/jpeg form, the timing in media_io_kwargs) and compares vLLM's prompt ids with the
# processor's own and vlmreg's, and its logprobs with a plain fp32 forward; (2) the missing_colour video task
# (examples/configs/qwen3_vl_video_tiny.toml) on the 2B shape in bf16, vLLM launched on the same GPU (eager, CUDA IPC,
# direct loads), 3 synced steps, mismatch_kl per step (each step's video prompts must come back from vLLM as the trainer
# encodes them, or the run stops naming the token): about 5 minutes.
#   run: bash benchmarks/vllm_session.sh video
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
LORA_LOGS=/tmp/lora-logs
lora_run() {  # lora_run PRESET RANK HOW [GPU]: one LoRA run of issue 29 (see the header), quiet; lora_report prints it
  local preset=$1 rank=$2 how=$3 gpu=${4:-${LORA_GPU:-0}} name="lora-$1-$2-$3" targets=language frozen=true eager=()
  if [ "$preset" = all ]; then targets=all-linear; frozen=false; fi
  if [ "${LORA_EAGER:-0}" = 1 ]; then eager=(--set 'rollout.server_args=["--enforce-eager"]'); fi
  mkdir -p "$LORA_LOGS"
  CUDA_VISIBLE_DEVICES=$gpu timeout "${LORA_TIMEOUT:-290}" "${TRAIN[@]}" "${VLLM[@]}" "${DIRECT[@]}" "${eager[@]}" \
    --set model.lora.targets="$targets" --set model.lora.r="$rank" --set model.lora.alpha="$((2 * rank))" \
    --set model.vlm.freeze_vision_encoder="$frozen" --set trainer.learning_rate=1e-4 --set broadcast.lora_sync="$how" \
    --set trainer.compile=false --set trainer.memory_budget_gib="${LORA_BUDGET:-44}" \
    --output-dir "/dev/shm/run_$name" > "$LORA_LOGS/${name}_train.log" 2>&1
  echo "exit $?" >> "$LORA_LOGS/${name}_train.log"
  cp "/dev/shm/run_$name/vllm.log" "$LORA_LOGS/${name}_vllm.log" 2>/dev/null
  cp "/dev/shm/run_$name/metrics.jsonl" "$LORA_LOGS/${name}_metrics.jsonl" 2>/dev/null
  stop_servers "/dev/shm/run_$name"; rm -rf "/dev/shm/run_$name"
}
SYNC_LOGS=/tmp/syncratio-logs  # the syncratio steps' logs and raw figures, archived to $OUT/syncratio-logs.tgz
sync_raw() {  # sync_raw R: the 2B shape's step sync broadcast GPU 0 -> GPUs 1..R by vlmreg's Sender and as one flat buffer
  local r=$1 gpus=0,1
  if [ "$r" = 2 ]; then gpus=0,1,2; fi
  mkdir -p "$SYNC_LOGS"
  CUDA_VISIBLE_DEVICES=$gpus timeout 110 vlmreg bench broadcast --family qwen3_vl --size 2b --backend nccl --receivers "$r" \
    --iters 10 > "$SYNC_LOGS/raw$r.json" 2> "$SYNC_LOGS/raw$r.err"; echo "raw broadcast to $r receiver(s): exit $?"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('receivers', 'bytes', 'seconds', 'raw_seconds', 'ratio', 'verified')})" \
    "$SYNC_LOGS/raw$r.json" || tail -3 "$SYNC_LOGS/raw$r.err"
  tar czf "$OUT/syncratio-logs.tgz" -C "$SYNC_LOGS" . 2>/dev/null
}
sync_run() {  # sync_run TP: the 6-step run with vLLM TP 1 (GPU 1) or TP 2 (GPUs 1-2), its syncs against the raw broadcast
  local tp=$1 gpus=0,1 args='["--enforce-eager"]' dir=/dev/shm/run_sync$1 started
  if [ "$tp" = 2 ]; then gpus=0,1,2; args='["--enforce-eager", "--tensor-parallel-size", "2"]'; fi
  started=$(date +%s)
  mkdir -p "$SYNC_LOGS"
  CUDA_VISIBLE_DEVICES=$gpus timeout "${SYNC_RUN_S:-225}" "${TRAIN[@]}" "${NEXT[@]}" "${DIRECT[@]}" --set trainer.max_off_policy_steps=0 \
    --set "rollout.server_args=$args" --set rollout.max_tokens="${SYNC_MAX_TOKENS:-256}" --output-dir "$dir" > "$SYNC_LOGS/tp${tp}_train.log" 2>&1
  echo "TP $tp: exit $? after $(( $(date +%s) - started )) s (timeout ${SYNC_RUN_S:-225})"
  grep -E "^error|Error|ready after" "$SYNC_LOGS/tp${tp}_train.log" | cut -c1-300 | tail -4
  grep -h "vlmreg worker" "$dir"/vllm*.log 2>/dev/null | cut -c1-300 | tail -8
  python3 benchmarks/sync_ratio.py --raw "$SYNC_LOGS/raw$tp.json" --metrics "$dir/metrics.jsonl" --label "TP $tp" \
    | tee -a "$OUT/syncratio.jsonl"
  cp "$dir/vllm.log" "$SYNC_LOGS/tp${tp}_vllm.log" 2>/dev/null; cp "$dir/metrics.jsonl" "$SYNC_LOGS/tp${tp}_metrics.jsonl" 2>/dev/null
  tar czf "$OUT/syncratio-logs.tgz" -C "$SYNC_LOGS" . 2>/dev/null
  stop_servers "$dir"; rm -rf "$dir"
}
lora_report() {  # lora_report NAME: what the run printed, its vLLM worker's sync lines, and its per-step table
  local name=$1
  echo "-- $name: $(tail -1 "$LORA_LOGS/${name}_train.log")"
  grep -E "^step|^error|Error|LoRA syncs|LoRA adapter|ready after" "$LORA_LOGS/${name}_train.log" | cut -c1-300 | tail -10
  grep -E "vlmreg worker|ERROR|Traceback" "$LORA_LOGS/${name}_vllm.log" 2>/dev/null | cut -c1-240 | tail -10
  [ -f "$LORA_LOGS/${name}_metrics.jsonl" ] || return 0
  python3 -c "
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    row = {'run': sys.argv[2]}
    row.update({k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in ('step', 'step_s', 'rollout_s', 'update_s', 'sync_s', 'sync_transfer_s', 'sync_request_s', 'sync_adapter_config_s', 'sync_adapter_load_s', 'sync_bytes', 'mismatch_kl', 'tis_weight_mean')})
    print(json.dumps(row))
" "$LORA_LOGS/${name}_metrics.jsonl" "$name" | tee -a "$OUT/lora.jsonl"
}
lora_parallel() {  # lora_parallel PRESET: ranks 16 and 64, adapters and merged, side by side on GPUs 0-3
  local gpu=0 names=()
  for rank in 16 64; do for how in adapters merged; do
    lora_run "$1" "$rank" "$how" "$gpu" & gpu=$((gpu + 1)); names+=("lora-$1-$rank-$how")
  done; done
  wait
  for name in "${names[@]}"; do lora_report "$name"; done
  tar czf "$OUT/lora-logs.tgz" -C "$LORA_LOGS" . 2>/dev/null
}
MOE=(--family qwen3_vl_moe --size 30b-a3b --device cuda --attn varlen --image-size 448 --samples ${MOE_SAMPLES:-32}
     --min-completion 64 --max-completion 768 --warmup 1 --iters ${MOE_ITERS:-2})
MOE_LAYERS=${MOE_LAYERS:-}  # empty: the shape's 48 layers
moe_left() { echo $(( ${MOE_DEADLINE:-$(( $(date +%s) + 600 ))} - $(date +%s) )); }
moe_timeout() {  # moe_timeout WANTED: WANTED seconds, or what is left before MOE_DEADLINE (minus 10), whichever is less
  local left; left=$(( $(moe_left) - 10 )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
moe_update() {  # moe_update NAME MODES EXTRA...: one torchrun of policy_update.py on 4 GPUs, JSON in $OUT/NAME.json
  local name=$1 modes=$2 limit; shift 2; limit=$(moe_timeout ${MOE_RUN_S:-240})
  [ "$limit" -lt 60 ] && { echo "$name skipped: $limit s left"; return 1; }
  rm -f "$OUT/$name.json"; started=$(date +%s)
  timeout -k 10 "$limit" torchrun --standalone --nproc_per_node 4 benchmarks/policy_update.py "${MOE[@]}" \
    ${MOE_SAMPLES:+--samples $MOE_SAMPLES} ${MOE_LAYERS:+--layers $MOE_LAYERS} --modes "$modes" "$@" ${MOE_EXTRA:-} --output "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?; echo "$name: exit $rc after $(( $(date +%s) - started )) s (timeout $limit, layers ${MOE_LAYERS:-48})"
  [ -s "$OUT/$name.json" ] || { grep -E "Error|error|rank [0-9]" "$OUT/$name.log" | cut -c1-300 | tail -6; return 1; }
}
moe_sync() {  # moe_sync LAYERS: the broadcast bench of the shape (empty LAYERS: all 48), JSON in $OUT/moe30_sync.json
  local limit; limit=$(moe_timeout 200); [ "$limit" -lt 60 ] && { echo "moe30-sync skipped: $limit s left"; return 1; }
  started=$(date +%s)
  timeout -k 10 "$limit" python3 -m vlmreg bench broadcast --family qwen3_vl_moe --size 30b-a3b ${1:+--layers $1} --backend nccl \
    --iters 5 > "$OUT/moe30_sync.json" 2> "$OUT/moe30_sync.err"
  local rc=$?; echo "moe30-sync: exit $rc after $(( $(date +%s) - started )) s (timeout $limit, layers ${1:-48})"
  [ "$rc" = 0 ] || { tail -4 "$OUT/moe30_sync.err" | cut -c1-300; return 1; }
}
moe_summary() {  # the figures of issue 30, one JSON object
  python3 - "$OUT" <<'PY'
import json, os, sys
out, summary = sys.argv[1], {}
for name in ("moe30_update", "moe30_peer", "moe30_compile"):
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        summary[name] = "not run or failed"
        continue
    data = json.load(open(path))
    layers = data.get("setup", {}).get("layers") or 48
    for mode, r in data.items():
        if isinstance(r, dict) and "seconds_per_step" in r:
            key = f"{mode} compiled" if name == "moe30_compile" else mode
            summary[key] = {k: r.get(k) for k in ("seconds_per_step", "tokens_per_s", "mfu", "mfu_with_vision",
                                                   "peak_memory_gib", "experts", "world_size")} | {"layers": layers}
path = os.path.join(out, "moe30_sync.json")
try:
    sync = json.load(open(path))
    summary["sync"] = {k: sync.get(k) for k in ("bytes", "seconds", "raw_seconds", "ratio", "gb_per_s", "verified")}
    summary["sync"]["layers"] = sync.get("layers") or 48
except (OSError, ValueError):
    summary["sync"] = "not run or failed"
def ratio(a, b):  # tokens/s of a over b, where both ran at the same depth
    a, b = summary.get(a), summary.get(b)
    if isinstance(a, dict) and isinstance(b, dict) and a["layers"] == b["layers"] and b["tokens_per_s"]:
        return round(a["tokens_per_s"] / b["tokens_per_s"], 2)
    return None
summary["vlmreg_vs_hf_frozen"] = ratio("vlmreg-packed", "hf-frozen")
summary["vlmreg_grouped_vs_grouped_mm_experts"] = ratio("vlmreg-packed", "vlmreg-packed[grouped_mm]")
summary["compiled_vs_not"] = ratio("vlmreg-packed compiled", "vlmreg-packed")
print(json.dumps(summary, indent=1))
json.dump(summary, open(os.path.join(out, "moe30_summary.json"), "w"), indent=1)
PY
}
declare -A NEEDS=([moe30-levers]=400 [moe30-onebatch]=400 [moe30-profile]=200 [moe-e2e]=430 [video]=360 [fsdp2a]=420 [think]=200 [fsdp22]=330 [fsdpemb]=200 [tp2d]=300 [servers3]=330 [twonode]=300 [nccl0d]=300 [nccl1d]=300 [one0]=300 [one1]=300 [rollout-profile]=420 [lora-language]=1600 [lora-all]=1600 [lora-par-language]=300 [lora-par-all]=300 [syncratio]=560 [syncratio-raw]=120 [syncratio-tp1]=230 [syncratio-tp2]=230)
for p in language all; do for r in 16 64; do for h in adapters merged; do NEEDS[lora-$p-$r-$h]=300; done; done; done
steps=(); for step in "$@"; do [ "$step" = moe30 ] && steps+=(moe30-setup moe30-update moe30-peer moe30-sync moe30-compile moe30-summary) || steps+=("$step"); done
for step in "${steps[@]}"; do
  # UNTIL (epoch seconds): a step that would not end before it is skipped, so one command keeps to the device's limit
  if [ -n "${UNTIL:-}" ] && [ $(( $(date +%s) + ${NEEDS[$step]:-60} )) -gt "$UNTIL" ]; then
    echo "== $step skipped: needs about ${NEEDS[$step]:-60} s, $(( UNTIL - $(date +%s) )) s left"; continue
  fi
  echo "== $step $(date +%T)"
  case $step in
    moe30-setup) # the small wheels (cattrs, ...) and the three distributions issue 30 needs, editable; nothing of vLLM
      export MOE_DEADLINE=${MOE_DEADLINE:-$(( $(date +%s) + ${MOE_BUDGET:-570} ))}
      python3 -c "import cattrs" 2> /dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheels failed"
      python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/vlmreg-qwen-common -e plugins/vlmreg-qwen3-vl-moe \
        > "$OUT/moe30_install.log" 2>&1 || { echo "install failed:"; tail -5 "$OUT/moe30_install.log"; }
      python3 -c "import torch, transformers, vlmreg; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name(), vlmreg.get_family('qwen3_vl_moe').shapes.keys())"
      nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader ;;
    moe30-update) # vlmreg's update: the family's grouped experts, then transformers' grouped_mm on the same model
      if ! moe_update moe30_update vlmreg-packed --budget ${MOE_BUDGET_TOKENS:-6144} --experts grouped_mm; then
        if [ -z "$MOE_LAYERS" ] && [ "$(moe_left)" -gt 300 ]; then
          MOE_LAYERS=${MOE_FALLBACK_LAYERS:-24}; echo "moe30-update: again with $MOE_LAYERS layers"
          moe_update moe30_update vlmreg-packed --budget ${MOE_BUDGET_TOKENS:-6144} --experts grouped_mm
        fi
      fi ;;
    moe30-peer) moe_update moe30_peer hf-frozen --plain-batch ${MOE_PLAIN_BATCH:-4} ;;  # transformers' MoE forward+backward
    moe30-sync) if ! moe_sync ""; then [ "$(moe_left)" -gt 90 ] && moe_sync "${MOE_FALLBACK_LAYERS:-24}"; fi ;;
    moe30-same) # the best options of the second lease (64 samples a rank, one micro-batch, prefetch 2, compiled, 8 layers
      # keeping activations) and transformers' own MoE forward and backward (hf-frozen) in the same process, same samples
      # (two processes, one after the other: in one, the peer ran out of memory after vlmreg's compiled run)
      MOE_SAMPLES=64 MOE_RUN_S=${MOE_RUN_S:-200} moe_update moe30_same vlmreg-packed --iters ${MOE_SAME_ITERS:-3} \
        --budget 45056 --checkpointing --prefetch 2 --compile --keep-layers 8
      MOE_SAMPLES=64 MOE_RUN_S=${MOE_RUN_S:-200} moe_update moe30_same_peer hf-frozen --iters ${MOE_SAME_ITERS:-3} \
        --plain-batch ${MOE_PLAIN_BATCH:-4} --prefetch 2
      for f in moe30_same moe30_same_peer; do python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(m, {k: d[m].get(k) for k in ('seconds_per_step', 'seconds_each', 'tokens_per_s', 'mfu', 'mfu_with_vision', 'peak_memory_gib')}) for m in ('vlmreg-packed', 'hf-frozen') if isinstance(d.get(m), dict)]" "$OUT/$f.json"; done ;;
    moe30-shardsync) # the whole model's sync from an FSDP2 trainer (S ranks, GPUs 0..S-1) to a receiver on the next GPU
      # (`vlmreg bench broadcast --shards S`), against one flat NCCL broadcast of the same bytes from rank 0's GPU: the
      # gathers, on their own stream, run up to A MiB ahead of the packing. MOE_SYNC_RUNS: "S:A" each (MOE_SHARDS: S with
      # the sender's default A; "S:A:R": the receiver on GPU R, e.g. "2:2048:1" on two GPUs, beside trainer rank 1)
      runs=${MOE_SYNC_RUNS:-$(for s in ${MOE_SHARDS:-3}; do printf '%s:2048 ' "$s"; done)}
      for run in $runs; do
        IFS=: read -r shards ahead receiver <<< "$run"; tag="${run//:/_}"
        limit=$(moe_timeout 240); [ "$limit" -lt 60 ] && { echo "shardsync $run skipped"; continue; }; started=$(date +%s)
        timeout -k 10 "$limit" python3 -m vlmreg bench broadcast --family qwen3_vl_moe --size 30b-a3b --backend nccl --iters 5 \
          --shards "$shards" --gather-ahead-mb "$ahead" ${receiver:+--receiver-gpu "$receiver"} --timeout-s 300 ${MOE_SYNC_OPTS:-} \
          > "$OUT/moe30_shardsync_$tag.json" 2> "$OUT/moe30_shardsync_$tag.err"
        echo "shardsync $run: exit $? after $(( $(date +%s) - started )) s"; tail -3 "$OUT/moe30_shardsync_$tag.err" | cut -c1-300
        grep -E '"(shards|gather_ahead_mb|seconds|raw_seconds|ratio|gb_per_s|verified|sender_before_gib|sender_peak_gib)"' "$OUT/moe30_shardsync_$tag.json"
        python3 -c "import json, sys; p = json.load(open(sys.argv[1])).get('profile'); p and print('profile', p)" "$OUT/moe30_shardsync_$tag.json"
      done ;;
    moe30-compile) # with the time left: vlmreg's update with its decoder layers compiled (as trainer.compile)
      if [ "$(moe_left)" -gt 200 ]; then moe_update moe30_compile vlmreg-packed --budget ${MOE_BUDGET_TOKENS:-6144} --compile
      else echo "moe30-compile skipped: $(moe_left) s left"; fi ;;
    moe30-onebatch) # fewer FSDP2 gathers: each rank's ~20k tokens in one micro-batch (budget MOE_ONE_BUDGET, 24576), every
      # decoder layer recomputing its activations in backward (--checkpointing), so the weights are gathered twice a step
      # instead of twice a micro-batch; then the same at budget 12288 (two micro-batches). MOE_ONE_BUDGETS: other budgets
      for budget in ${MOE_ONE_BUDGETS:-${MOE_ONE_BUDGET:-24576} 12288}; do
        moe_update "moe30_onebatch_$budget" vlmreg-packed --budget "$budget" --checkpointing || break
        python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['vlmreg-packed']; print({k: r.get(k) for k in ('seconds_per_step', 'tokens_per_s', 'mfu', 'peak_memory_gib')})" \
          "$OUT/moe30_onebatch_$budget.json"
      done ;;
    moe30-levers) # the levers against FSDP2's gathers, 32 samples a rank unless said: one micro-batch (24576, recomputing);
      # the same with explicit prefetching of 2 layers; 64 samples a rank in one micro-batch (45056); a profiled step of
      # the one-micro-batch run. Logs in $OUT/moe30-levers-logs.tgz (the $OUT file limit is 8)
      # MOE_LEVERS: other runs, "TAG|BUDGET|SAMPLES|OPTIONS" each (@ for a space in OPTIONS), a profiled one tagged profile-*
      read -r -a levers <<< "${MOE_LEVERS:-one|24576|32|--checkpointing one-prefetch2|24576|32|--checkpointing@--prefetch@2 one-64|45056|64|--checkpointing profile-one|24576|32|--checkpointing@--iters@1@--profile}"
      for lever in "${levers[@]}"; do
        lever=${lever//@/ }
        IFS='|' read -r tag budget samples extra <<< "$lever"
        MOE_SAMPLES=$samples moe_update "moe30_$tag" vlmreg-packed --budget "$budget" $extra || continue
        python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['vlmreg-packed']; print(sys.argv[2], {k: r.get(k) for k in ('seconds_per_step', 'tokens_per_s', 'mfu', 'peak_memory_gib')})" \
          "$OUT/moe30_$tag.json" "$tag"
      done
      for log in "$OUT"/moe30_profile-*.log; do grep -A36 "== profile" "$log" 2> /dev/null | cut -c1-200 | head -40; done
      (cd "$OUT" && tar czf moe30-levers-logs.tgz moe30_*.log moe30_install.log 2> /dev/null && rm -f moe30_*.log moe30_install.log) ;;
    moe30-profile) # where the MoE step's GPU time goes: one profiled step of the update as moe30-update runs it (rank 0's
      # table: top CUDA ops; busy time split into NCCL collectives and the rest)
      moe_update moe30_profile vlmreg-packed --budget ${MOE_BUDGET_TOKENS:-6144} --iters 1 --profile \
        && grep -A30 "== profile" "$OUT/moe30_profile.log" | cut -c1-220 | head -34 ;;
    moe30-summary) moe_summary ;;
    part0) cp .gl/p0/* /tmp/parts/ && ls -la /tmp/parts ;;
    chunk0|chunk1) mkdir -p /tmp/chunks && cp ".gl/c${step#chunk}"/* /tmp/chunks/ && ls /tmp/chunks ;;
    chunk2) # the last 48 MiB chunk, SHA256SUMS and install.sh: the three chunks joined, cut again into the bundle's 60 MiB parts
      mkdir -p /tmp/chunks && cp .gl/c2/* /tmp/chunks/ && cp /tmp/chunks/SHA256SUMS /tmp/chunks/install.sh /tmp/parts/ \
        && cat /tmp/chunks/all.? | split -b 62914560 -d -a 2 - /tmp/parts/vllm-0.24.0-bundle.tar.xz.part- \
        && rm -rf /tmp/chunks && ls -la /tmp/parts ;;
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
    lora-par-language|lora-par-all) lora_parallel "${step#lora-par-}" ;;
    lora-language|lora-all) for rank in 16 64; do for how in adapters merged; do
                              lora_run "${step#lora-}" "$rank" "$how"; lora_report "lora-${step#lora-}-$rank-$how"; done; done
                            tar czf "$OUT/lora-logs.tgz" -C "$LORA_LOGS" . 2>/dev/null ;;
    lora-*-*-*) IFS=- read -r _ preset rank how <<< "$step"; lora_run "$preset" "$rank" "$how"; lora_report "$step"
                tar czf "$OUT/lora-logs.tgz" -C "$LORA_LOGS" . 2>/dev/null ;;
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
    moe-e2e) # issue 30 item 3: an FSDP2 trainer of the 30B-A3B shape (MOE_E2E_LAYERS decoder layers, 24 unless set) on GPUs
             # 0-1 (torchrun), vLLM launched on GPU 2 (CUDA graphs), NCCL syncs, direct loads, the 2B config's rollouts
             # (64 completions of up to 256 tokens), gradient checkpointing, STEPS (4) steps, stacks every 200 s if stuck
             sed '/^memory_budget_gib/d' examples/configs/qwen3_vl_2b_gpu.toml > /tmp/moe_e2e.toml  # the budget is for one process only
             dir=/dev/shm/run_moe_e2e started=$(date +%s)
             CUDA_VISIBLE_DEVICES=${MOE_E2E_GPUS:-0,1,2} VLMREG_STACKS_EVERY=200 timeout "${MOE_E2E_S:-420}" torchrun --standalone --nproc_per_node "${MOE_E2E_TRAINERS:-2}" \
               -m vlmreg train /tmp/moe_e2e.toml --set model.family=qwen3_vl_moe --set model.size=30b-a3b \
               --set model.layers="${MOE_E2E_LAYERS:-24}" --set trainer.steps="${STEPS:-4}" --set trainer.save_every=0 --set eval.every=0 \
               --set trainer.compile=false --set trainer.gradient_checkpointing=true "${NEXT[@]}" "${DIRECT[@]}" ${MOE_E2E_SETS:-} \
               --output-dir "$dir" > "$OUT/moe_e2e_train.log" 2>&1
             echo "moe-e2e: exit $? after $(( $(date +%s) - started )) s (timeout ${MOE_E2E_S:-420}, layers ${MOE_E2E_LAYERS:-24})"
             grep -E "^step|^error|ready|launched|worker\(s\)|Error|rank [0-9]" "$OUT/moe_e2e_train.log" | cut -c1-300 | tail -14
             summary "$dir" moe_e2e; grep -hE "vlmreg worker|ERROR" "$dir"/vllm*.log 2>/dev/null | cut -c1-240 | tail -8
             cp "$dir/vllm.log" "$OUT/moe_e2e_vllm.log" 2>/dev/null; cp "$dir/metrics.jsonl" "$OUT/moe_e2e_metrics.jsonl" 2>/dev/null
             stop_servers "$dir"; rm -rf "$dir" ;;
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
    video) # issue 28 item 4: see the header; (1) at most 145 s, (2) at most 200 s
           started=$(date +%s)
           timeout -s INT -k 5 140 vlmreg check --engine vllm --tiny qwen3_vl --no-sync --output-dir /dev/shm/video_check \
             > "$OUT/video_check.txt" 2> "$OUT/video_check.err"; echo "check: exit $? after $(( $(date +%s) - started )) s"
           grep -E "video|^(PASS|FAIL) qwen3_vl" "$OUT/video_check.txt" | cut -c1-300
           grep -E "Error|error" "$OUT/video_check.err" | tail -3; cp /dev/shm/video_check/vllm.log "$OUT/video_check_vllm.log" 2>/dev/null
           stop_servers /dev/shm/video_check; rm -rf /dev/shm/video_check
           started=$(date +%s)
           timeout 200 vlmreg train examples/configs/qwen3_vl_video_tiny.toml --set model.size=2b --set model.dtype=bfloat16 \
             --set model.vlm.freeze_vision_encoder=true --set trainer.device=cuda --set trainer.steps=3 \
             --set trainer.format_warmup_steps=0 --set trainer.learning_rate=1e-6 \
             --set trainer.save_every=0 --set eval.every=0 --set logging.rollout_page_every=0 --set rollout.max_tokens=64 \
             "${VLLM[@]}" "${DIRECT[@]}" --set 'rollout.server_args=["--enforce-eager"]' --output-dir /dev/shm/run_video \
             > "$OUT/video_train.log" 2>&1; echo "train: exit $? after $(( $(date +%s) - started )) s (timeout 200)"
           grep -E "^step|^error|ready|Error" "$OUT/video_train.log" | cut -c1-300 | tail -8
           summary /dev/shm/run_video video_2b; cp /dev/shm/run_video/vllm.log "$OUT/video_vllm.log" 2>/dev/null
           stop_servers /dev/shm/run_video; rm -rf /dev/shm/run_video ;;
    embedded) timeout 400 "${TRAIN[@]}" --output-dir /tmp/run_embedded 2>&1 | tee "$OUT/embedded_train.log" | grep -E "^step|^error" | tail -8
              summary /tmp/run_embedded embedded_2b ;;
    moe) timeout 400 vlmreg train examples/configs/qwen3_vl_moe_tiny.toml --set model.size=small --set model.dtype=bfloat16 \
           --set model.attn_implementation=sdpa --set trainer.device=cuda --set trainer.steps=3 --set eval.every=0 "${VLLM[@]}" \
           --set rollout.server_args='["--enforce-eager"]' --output-dir /tmp/run_moe 2>&1 | tee "$OUT/moe_train.log" | grep -E "^step|^error|ready" | tail -6
         summary /tmp/run_moe moe_small; cp /tmp/run_moe/vllm.log "$OUT/moe_server.log" 2>/dev/null ;;
  esac
done
