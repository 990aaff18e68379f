#!/usr/bin/env bash
# One stage of a GPU-machine session (see docs/gpu.md). Run from the repo root on the GPU machine after
#   eval "$(bash .carry/gpu-tools/install-on-device.sh)"
# Each stage writes JSON results and one log under $OUT (the device tool returns at most 8 files).
#   stage 1 (kit chunk 1: ray, deepspeed): placement checks, weight-sync IPC/NCCL benches
#   stage 2 (kit chunk 2: vllm):           vLLM engine bench on a tiny model + sleep on a 1.5B model (+ TP 2)
#   stage 3 (kit chunk 3: SmolLM2):        convert SmolLM2, DeepSpeed sleep bench, vLLM model/throughput, IPC→vLLM
#   stage 4 (pytest carried):              every @pytest.mark.gpu test
#   stages 67, 68, 69 (in that order): round 9d (100 GRPO steps of round 9's benchmark configuration)
#   stages 65, 66: round 9c (the final sender, which also deletes the previous start key and bucket messages)
#   stages 61, 62, 63, 64 (in that order): round 9b (the manifest in the start key; wake/sleep sent with the work)
#   stages 57, 58, 59, 60 (in that order): round 9 (fewer control round trips, done while the copies run; GRPO with
#     ZeRO-0 and TF32 in the backward and the reference's forward, 1 and 2 GPUs alone; TRL alone)
#   stages 55, 56: round 8d (bucket 0's message before the start key; into vLLM again)
#   stages 51, 52, 53, 54: round 8c (ZeRO-1 with TF32 in the actor's backward only; TRL in the same chain)
#   stages 47, 48, 49, 50: round 8b (bucket 0 before the manifest; GRPO with TF32 trainers, the engine sleeping,
#     2 GPUs at the same per-GPU batch; TRL fp32 and TF32)
#   stages 45, 46: round 8 (copy-plan replay as a CUDA graph, the plan checked when armed; training profiled)
#   stages 43, 44: round 7d (cached zero-copy messages and planned batches)
#   stages 41, 42: round 7c (no per-tensor detach on the sender, no check round for a repeated manifest)
#   stages 39, 40: round 7b (the phases of each end of a sync, channel alone and into vLLM)
#   stages 35, 36, 37, 38 (in that order): round 7 (armed syncs: the channel alone, into vLLM, the GRPO example on
#     1 and 2 GPUs, TRL again and the GPU tests)
#   stages 33, 34 (after a kit-chunk-1 call): round 6b (cheaper plan check; response-token log-probs); stage 34 ran
#     14 steps then and runs 16 now, like stage 31. To measure what changed after round 6 (the worker's repacked-layer
#     walk once per model, the mismatch gathered without syncs): a gpu1 call, then 33, 34 and 32 (TRL in the chain)
#   stages 29, 30, 31, 32 (in that order): round 6 (one-bucket zero-copy, once-per-update plan check, engine core
#     in process; engine log-probs as the old log-probs; TRL again; ray job submit)
#   stages 28, 25, 26, 27 (in that order): round 5b (load time split out, one micro-batch per optimizer step, TRL)
#   stages 22, 21, 23, 24 (in that order): the fifth round (varlen attention, planned loading into vLLM, TRL again)
#   stages 14-17: the fourth round (zero-copy CUDA IPC, ZeRO-2 with resident trainers, peers again) on nvidia-h200-x2
#   stages 8-12: the third round (hybrid examples end to end, peers, reruns) on nvidia-h200-x2; jobs that need one
#   GPU run two at a time, one per GPU (CUDA_VISIBLE_DEVICES, each its own local Ray). Run folders are packed into
#   $OUT/stageN.tgz (the device tool returns at most 8 files).
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# pytest travels once (.carry/pytest) and is kept in /tmp while the machine stays warm (the 'cuda' image has it too)
if [ -d .carry/pytest ]; then rm -rf /tmp/pytest-site && cp -r .carry/pytest /tmp/pytest-site; fi
RUNS=/tmp/runs
mkdir -p $RUNS
export PYTHONPATH=$PWD/src:/tmp/pytest-site:${PYTHONPATH:-} TORCH_CUDA_ARCH_LIST=9.0 RAY_AUTH_MODE=disabled \
  RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
SMOL=/tmp/smollm2-hf
log=$OUT/stage$stage.log
run() { local limit=$1; shift; echo "=== $(date +%T) $*" | tee -a "$log"; timeout "$limit" "$@" >>"$log" 2>&1;
        echo "=== rc=$? after $SECONDS s" | tee -a "$log"; }
# on GPU $1, with its own log $RUNS/$2.log: on LIMIT CMD...  (background it with &)
on() { local gpu=$1 name=$2 limit=$3; shift 3; echo "=== $(date +%T) [gpu $gpu] $name: $*" | tee -a "$log";
       CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" >"$RUNS/$name.log" 2>&1;
       echo "=== $(date +%T) [gpu $gpu] $name rc=$? after $SECONDS s" | tee -a "$log"; tail -3 "$RUNS/$name.log" >>"$log"; }
tiny() { python -c "from rlhfkit.tiny_models import *; build_tiny_model('/tmp/tiny-hd64', TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512))" >>"$log" 2>&1; }
big() { python -c "import sys; sys.path.insert(0, 'bench'); from ipc_to_vllm import build_random_model; build_random_model(30)" >>"$log" 2>&1; }
pack() { tar czf "$OUT/stage$stage.tgz" -C $RUNS --exclude='*/tiny_model' . 2>>"$log"; }
HYB="--steps 100 --rollout-batch 16 --samples-per-prompt 8 --max-new-tokens 64 --lr 1e-5"
# rounds 6-7: GRPO with everything resident (ZeRO-2, engine level 0), one micro-batch per optimizer step, 16 steps
RESIDENT="${HYB/--steps 100/--steps 16} --zero-stage 2 --offload-trainers false --attn varlen --weight-loading planned --grad-accum 1 --engine-sleep-level 0"
# round 9: the 1.54B bench into vLLM, round 9's GRPO benchmark configuration, and the checks its stages repeat
IPC9="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
R9="${RESIDENT/--zero-stage 2/--zero-stage 0} --old-logprobs engine --sync-mode armed --tf32 backward,reference"
ws_checks() {  # TAG: the weight-sync GPU tests, then the channel alone (CUDA IPC; NCCL GPU 0 -> 1 on two GPUs)
  run 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_weight_sync.py
  on 0 ws_ipc_$1 150 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc_$1.json --deadline-s 140
  if [ "$NGPU" -ge 2 ]; then
    on 0,1 ws_nccl_$1 150 python bench/weight_sync.py --mode nccl --out $RUNS/weight_sync_nccl_$1.json --deadline-s 140
  fi; }
armed_into_vllm() {  # GPU TAG: the 1.54B sync into vLLM, the engine armed
  on $1 ipc_vllm_armed_$2 180 python bench/ipc_to_vllm.py $IPC9 --armed --out $RUNS/ipc_vllm_armed_$2.json; }
tiny_check() {  # GPU TAG: the tiny fp32 greedy check through armed replayed syncs
  on $1 ipc_vllm_tiny_$2 150 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --zero-copy --keep-mapped \
    --loading planned --bucket-mb 0 --armed --out $RUNS/ipc_vllm_tiny_$2.json; }
grpo_r9() {  # TAG: the benchmark configuration on one GPU alone, then on two with twice the prompts (same per GPU)
  on 0 ${1}_1gpu 300 python examples/grpo_hybrid.py --model $SMOL $R9 --out $RUNS/${1}_1gpu
  if [ "$NGPU" -ge 2 ]; then
    on 0,1 ${1}_2gpu 260 python examples/grpo_hybrid.py --model $SMOL ${R9/--steps 16/--steps 12} --rollout-batch 32 \
      --num-gpus 2 --out $RUNS/${1}_2gpu
  fi; }
trl_alone() {  # TAG [--tf32]: TRL's GRPOTrainer on the same workload, alone on GPU 0
  on 0 trl_$1 200 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 \
    --gpu-memory-utilization 0.15 ${2:-} --out $RUNS/peer_trl_$1.json; }
nvidia-smi -L | tee -a "$log"
NGPU=$(nvidia-smi -L | wc -l)
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >>"$log" 2>&1
case $stage in
1)
  run 240 python tests/gpu_placement_check.py --out "$OUT/placement.json"
  run 240 python bench/weight_sync.py --mode ipc --out "$OUT/weight_sync_ipc.json"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then run 150 python bench/weight_sync.py --mode nccl --out "$OUT/weight_sync_nccl.json"; fi
  ;;
2)
  python -c "from rlhfkit.tiny_models import *; build_tiny_model('/tmp/tiny-hd64', TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512))" >>"$log" 2>&1
  run 540 python bench/vllm_engine.py --model /tmp/tiny-hd64 --large --only tiny sleep tp2 --out "$OUT/vllm_engine_a.json"
  ;;
3)
  run 120 python examples/convert_smollm2.py --out $SMOL
  run 300 python bench/deepspeed_sleep.py --model $SMOL --out "$OUT/deepspeed_sleep.json" --budget-s 200
  run 150 python bench/ipc_to_vllm.py --model $SMOL --out "$OUT/ipc_to_vllm.json"
  ;;
4)
  run 240 python bench/vllm_engine.py --model $SMOL --only model throughput --out "$OUT/vllm_engine_b.json"
  run 300 python -m pytest -q -p no:cacheprovider -m gpu -x --timeout 240 tests
  ;;
5)  # second round, kit chunk 1 + pytest: the fixed weight-sync paths and the DeepSpeed GPU test
  run 100 python bench/weight_sync.py --mode ipc --out "$OUT/weight_sync_ipc.json" --deadline-s 90
  run 100 python bench/weight_sync.py --mode nccl --out "$OUT/weight_sync_nccl.json" --deadline-s 90
  run 240 python -m pytest -q -p no:cacheprovider -m gpu --timeout 200 tests/test_deepspeed_engine.py \
      tests/test_weight_sync.py tests/test_engines_hf.py tests/test_losses.py tests/test_advantages.py
  ;;
6)  # second round, kit chunk 2: vLLM sleep on a 1.5B model, IPC into vLLM, vLLM GPU tests
  python -c "from rlhfkit.tiny_models import *; build_tiny_model('/tmp/tiny-hd64', TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512))" >>"$log" 2>&1
  run 150 python bench/vllm_engine.py --model /tmp/tiny-hd64 --large --only sleep --out "$OUT/vllm_engine_sleep.json"
  run 100 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --out "$OUT/ipc_to_vllm_tiny.json"
  ;;
7)  # second round, kit chunk 3: SmolLM2 through vLLM (log-probs vs HF, throughput vs raw vLLM, killed engine)
  run 90 python examples/convert_smollm2.py --out $SMOL
  run 200 python bench/vllm_engine.py --model $SMOL --repeats 5 --only model throughput --out "$OUT/vllm_engine_smol.json"
  ;;
8)  # round 3, kit chunk 1 (ray, deepspeed): nothing to run without vLLM yet; what the image has
  python -m pip list 2>/dev/null | grep -i -E "^(accelerate|datasets|trl|pandas|pyarrow|pytest|peft|nvidia-ml-py) " >>"$log"
  ;;
9)  # round 3, kit chunk 2 (vllm): the hybrid examples on a tiny model, one per GPU
  tiny
  on 0 smoke_grpo 300 python examples/grpo_hybrid.py --model /tmp/tiny-hd64 --tiny --enforce-eager --out $RUNS/smoke_grpo &
  on 1 smoke_ppo 300 python examples/ppo_hybrid.py --model /tmp/tiny-hd64 --tiny --enforce-eager --out $RUNS/smoke_ppo &
  wait; pack
  ;;
10) # round 3, kit chunk 3 (SmolLM2): the 100-step GRPO run on GPU 0; DeepSpeed and vLLM reruns on GPU 1
  run 120 python examples/convert_smollm2.py --out $SMOL
  on 0 grpo100 520 python examples/grpo_hybrid.py --model $SMOL $HYB --out $RUNS/grpo100 &
  ( on 1 ds_smol 110 python bench/deepspeed_sleep.py --model $SMOL --skip-large --out $RUNS/deepspeed_sleep_smol.json --budget-s 40
    on 1 ds_large 180 python bench/deepspeed_sleep.py --out $RUNS/deepspeed_sleep_large.json --large-cycles 40 --budget-s 55
    on 1 vllm_smol 210 python bench/vllm_engine.py --model $SMOL --repeats 4 --only throughput model lp_fp32 --out $RUNS/vllm_engine_smol.json ) &
  wait; pack
  ;;
11) # round 3, .carry/peers: TRL then OpenRLHF on GPU 0, PPO on GPU 1 (same workload as grpo100)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  ( on 0 trl 250 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --gpu-memory-utilization 0.15 --out $RUNS/peer_trl.json
    on 0 openrlhf 220 python bench/peer_openrlhf.py --model $SMOL ${HYB/--steps 100/--steps 10} --timeout 200 --out $RUNS/peer_openrlhf.json ) &
  on 1 ppo 300 python examples/ppo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 20} --out $RUNS/ppo &
  wait; pack
  ;;
12) # round 3, 2 GPUs: scaling (same global batch as grpo100) and the engine on its own GPU (NCCL)
  on 0,1 grpo_2gpu 180 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 10} --num-gpus 2 --out $RUNS/grpo_2gpu
  on 0,1 grpo_separate 180 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 10} --num-gpus 2 --colocate false --out $RUNS/grpo_separate
  pack
  ;;
13) # round 3, a fresh machine, kit chunk 1 only: DeepSpeed sleep with the cuBLAS workspaces released (1.5B actor,
    # GPU 1) and where the actor's training time goes (bench/train_step.py, GPU 0)
  on 1 ds_large2 200 python bench/deepspeed_sleep.py --skip-reference --out $RUNS/deepspeed_sleep_large2.json --large-cycles 20 --budget-s 45 &
  on 0 train_step 230 python bench/train_step.py --out $RUNS/train_step.json --config-timeout-s 70 &
  wait; pack
  ;;
14) # round 4, kit chunk 1: weight-sync GPU tests (zero-copy IPC) on GPU 0 while the IPC bench runs on GPU 1
  on 0 pytest_ws 200 python -m pytest -q -p no:cacheprovider -m gpu --timeout 150 tests/test_weight_sync.py -k "not nccl" &
  on 1 ws_ipc 230 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc.json --deadline-s 210 &
  wait; pack
  ;;
15) # round 4, kit chunk 2 (vllm): zero-copy sync in the hybrid example (GPU test, ZeRO-2 resident), and a 1.54B
    # random Llama synced into a vLLM engine, zero-copy then bucketed (GPU 1)
  tiny
  on 0 pytest_hybrid 330 python -m pytest -q -p no:cacheprovider -m gpu --timeout 300 tests/test_hybrid_examples.py -k zero2 &
  ( on 1 ipc_vllm_big_zc 240 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --zero-copy --no-greedy --out $RUNS/ipc_vllm_big_zc.json
    on 1 ipc_vllm_big_buckets 150 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --no-greedy --out $RUNS/ipc_vllm_big_buckets.json ) &
  wait; pack
  ;;
16) # round 4, kit chunk 3 (SmolLM2): ZeRO-2 GRPO with resident trainers (GPU 0) and with offloading (GPU 1), then
    # zero-copy sync into vLLM with greedy check (GPU 0) and PPO with ZeRO-2 resident (GPU 1)
  run 120 python examples/convert_smollm2.py --out $SMOL
  on 0 z2_resident 300 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 20} --zero-stage 2 --offload-trainers false --out $RUNS/z2_resident &
  on 1 z2_offload 300 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 20} --zero-stage 2 --out $RUNS/z2_offload &
  wait
  on 0 ipc_vllm_smol_zc 150 python bench/ipc_to_vllm.py --model $SMOL --zero-copy --out $RUNS/ipc_vllm_smol_zc.json &
  on 1 ppo_z2 240 python examples/ppo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 12} --zero-stage 2 --offload-trainers false --out $RUNS/ppo_z2 &
  wait; pack
  ;;
17) # round 4, .carry/peers: TRL (GPU 0) and OpenRLHF with the rotary stub (GPU 1), then 2-GPU ZeRO-2 scaling
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  on 0 trl 250 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --gpu-memory-utilization 0.15 --out $RUNS/peer_trl.json &
  on 1 openrlhf 250 python bench/peer_openrlhf.py --model $SMOL ${HYB/--steps 100/--steps 10} --timeout 230 --out $RUNS/peer_openrlhf.json &
  wait
  on 0,1 z2_2gpu 230 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 12} --num-gpus 2 --zero-stage 2 --offload-trainers false --out $RUNS/z2_2gpu
  pack
  ;;
18) # round 4b, kit chunk 1: IPC bench with keep-mapped zero-copy (GPU 1), zero-copy GPU tests (GPU 0)
  on 0 pytest_ws2 150 python -m pytest -q -p no:cacheprovider -m gpu --timeout 120 tests/test_weight_sync.py -k zero_copy &
  on 1 ws_ipc2 200 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc2.json --deadline-s 180 &
  wait; pack
  ;;
19) # round 4b, kit chunk 2: into vLLM with direct loading + keep-mapped zero-copy: tiny fp32 greedy check (GPU 0),
    # the 1.54B random Llama (GPU 1)
  tiny
  on 0 ipc_vllm_tiny 150 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --zero-copy --keep-mapped --out $RUNS/ipc_vllm_tiny_direct.json &
  on 1 ipc_vllm_big_direct 230 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --out $RUNS/ipc_vllm_big_direct.json &
  wait; pack
  ;;
20) # kit chunk 3: SmolLM2 GRPO, ZeRO-2 resident, direct loading + keep-mapped zero-copy (GPU 0); the same with the
    # engine resident too (--engine-sleep-level 0), then SmolLM2 zero-copy into vLLM with the greedy check (GPU 1)
  run 120 python examples/convert_smollm2.py --out $SMOL
  on 0 z2_fast 250 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 15} --zero-stage 2 --offload-trainers false --out $RUNS/z2_fast &
  ( on 1 z2_all_resident 250 python examples/grpo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 15} --zero-stage 2 --offload-trainers false --engine-sleep-level 0 --out $RUNS/z2_all_resident
    on 1 ipc_vllm_smol2 150 python bench/ipc_to_vllm.py --model $SMOL --zero-copy --keep-mapped --out $RUNS/ipc_vllm_smol_direct.json ) &
  wait; pack
  ;;
21) # round 5, kit chunk 2 (after stage 22): the recorded copy plan into vLLM (weight_loading="planned"): tiny fp32
    # greedy check, then the 1.54B random Llama with direct loading for the same-run comparison (GPU 0); the 1.54B
    # random Llama with the plan (GPU 1)
  tiny
  ( on 0 ipc_vllm_tiny_planned 150 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --zero-copy --keep-mapped --loading planned --out $RUNS/ipc_vllm_tiny_planned.json
    on 0 ipc_vllm_big_direct 200 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading direct --out $RUNS/ipc_vllm_big_direct.json ) &
  on 1 ipc_vllm_big_planned 230 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --out $RUNS/ipc_vllm_big_planned.json &
  wait; pack
  ;;
22) # round 5, kit chunk 1 (ray, deepspeed): the packed-attention fix measured in bench/train_step.py (GPU 0); the
    # zero-copy IPC channel again (GPU 1)
  on 0 train_step 330 python bench/train_step.py --out $RUNS/train_step.json --config-timeout-s 110 --configs \
      torch_fp32_sdpa torch_fp32_varlen torch_fp32_padded zero2_fp32_sdpa zero2_fp32_varlen &
  on 1 ws_ipc3 230 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc3.json --deadline-s 200 &
  wait; pack
  ;;
23) # round 5, kit chunk 3 (SmolLM2; after stage 21): GRPO ZeRO-2 resident with varlen attention and the loading
    # stage 21 validated, engine sleeping (GPU 0) and resident (GPU 1, then the GPU tests of the packed attention);
    # then the same on 2 GPUs
  run 120 python examples/convert_smollm2.py --out $SMOL
  load=auto
  if python -c "import json,sys; t=json.load(open('$RUNS/ipc_vllm_tiny_planned.json')); b=json.load(open('$RUNS/ipc_vllm_big_planned.json')); sys.exit(0 if t.get('greedy_equal_after_sync') and b.get('median_s') else 1)" 2>>"$log"; then load=planned; fi
  echo "weight loading: $load" | tee -a "$log"; echo $load > $RUNS/weight_loading
  R5="${HYB/--steps 100/--steps 16} --zero-stage 2 --offload-trainers false --attn varlen --weight-loading $load"
  on 0 r5_sleep 280 python examples/grpo_hybrid.py --model $SMOL $R5 --out $RUNS/r5_sleep &
  ( on 1 r5_resident 280 python examples/grpo_hybrid.py --model $SMOL $R5 --engine-sleep-level 0 --out $RUNS/r5_resident
    on 1 pytest_attn 100 python -m pytest -q -p no:cacheprovider -m gpu --timeout 80 tests/test_packing.py tests/test_losses.py ) &
  wait
  on 0,1 r5_2gpu 230 python examples/grpo_hybrid.py --model $SMOL ${R5/--steps 16/--steps 12} --num-gpus 2 --out $RUNS/r5_2gpu
  pack
  ;;
24) # round 5, .carry/peers (after stage 23): TRL again in the same chain (GPU 0); PPO ZeRO-2 resident, varlen (GPU 1)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  load=$(cat $RUNS/weight_loading 2>/dev/null)
  on 0 trl 260 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --gpu-memory-utilization 0.15 --out $RUNS/peer_trl.json &
  on 1 r5_ppo 260 python examples/ppo_hybrid.py --model $SMOL ${HYB/--steps 100/--steps 12} --zero-stage 2 --offload-trainers false --attn varlen --weight-loading ${load:-auto} --out $RUNS/r5_ppo &
  wait; pack
  ;;
25) # round 5b, kit chunk 2 (after stage 28): into vLLM with the worker's load time split out, planned (GPU 1) and
    # direct (GPU 0)
  on 0 ipc_vllm_big_direct2 200 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading direct --out $RUNS/ipc_vllm_big_direct2.json &
  on 1 ipc_vllm_big_planned2 200 python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --out $RUNS/ipc_vllm_big_planned2.json &
  wait; pack
  ;;
26) # round 5b, kit chunk 3 (SmolLM2): GRPO ZeRO-2 resident, varlen, planned, one micro-batch per optimizer step
    # (--grad-accum 1): engine resident (GPU 0) and sleeping at level 2 (GPU 1)
  run 120 python examples/convert_smollm2.py --out $SMOL
  R6="${HYB/--steps 100/--steps 16} --zero-stage 2 --offload-trainers false --attn varlen --weight-loading planned --grad-accum 1"
  on 0 r6_resident 280 python examples/grpo_hybrid.py --model $SMOL $R6 --engine-sleep-level 0 --out $RUNS/r6_resident &
  on 1 r6_sleep 280 python examples/grpo_hybrid.py --model $SMOL $R6 --out $RUNS/r6_sleep &
  wait; pack
  ;;
27) # round 5b, .carry/peers (after stage 26): TRL with one micro-batch per optimizer step (GPU 0) and with two (GPU 1)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  on 0 trl_ga1 260 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --out $RUNS/peer_trl_ga1.json &
  on 1 trl_ga2 260 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --gpu-memory-utilization 0.15 --out $RUNS/peer_trl_ga2.json &
  wait; pack
  ;;
28) # round 5b, kit chunk 1: the actor's optimizer step on 128 sequences in 4 micro-batches (GPU 0) and in 1 (GPU 1)
  on 0 train_step_m4 150 python bench/train_step.py --out $RUNS/train_step_m4.json --micro 4 --config-timeout-s 70 --configs torch_fp32_varlen zero2_fp32_varlen &
  on 1 train_step_m1 150 python bench/train_step.py --out $RUNS/train_step_m1.json --micro 1 --config-timeout-s 70 --configs torch_fp32_varlen zero2_fp32_varlen &
  wait; pack
  ;;
29) # round 6, kit chunk 1: the channel alone again, CUDA IPC on one GPU, then NCCL from GPU 0 to GPU 1
  on 0 ws_ipc4 150 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc4.json --deadline-s 140
  on 0,1 ws_nccl2 150 python bench/weight_sync.py --mode nccl --out $RUNS/weight_sync_nccl2.json --deadline-s 140
  pack
  ;;
30) # round 6, kit chunk 2 (after 29): into vLLM with the plan checked once per update and the prefix-cache reset
    # deferred to the next generation: 256 MiB buckets (stage 25's setting), one bucket, one bucket with the engine
    # core in the actor's process; direct loading, one bucket; a tiny fp32 greedy check of the fastest setting
  tiny
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy"
  big
  ( on 0 ipc_vllm_tiny_r6 150 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --zero-copy --keep-mapped --loading planned --bucket-mb 0 --in-process --out $RUNS/ipc_vllm_tiny_r6.json
    on 0 ipc_vllm_planned_1b 200 python bench/ipc_to_vllm.py $IPC --loading planned --bucket-mb 0 --out $RUNS/ipc_vllm_planned_1b.json
    on 0 ipc_vllm_planned_1b_inproc 200 python bench/ipc_to_vllm.py $IPC --loading planned --bucket-mb 0 --in-process --out $RUNS/ipc_vllm_planned_1b_inproc.json ) &
  ( on 1 ipc_vllm_planned3 200 python bench/ipc_to_vllm.py $IPC --loading planned --out $RUNS/ipc_vllm_planned3.json
    on 1 ipc_vllm_direct_1b 200 python bench/ipc_to_vllm.py $IPC --loading direct --bucket-mb 0 --out $RUNS/ipc_vllm_direct_1b.json ) &
  wait; pack
  ;;
31) # round 6, kit chunk 3 (SmolLM2): GRPO with everything resident (ZeRO-2, engine level 0), one micro-batch per
    # optimizer step, one-bucket sync, no cache emptying: the engine's log-probs as the old log-probs (GPU 0) and
    # the actor's forward (GPU 1); then engine log-probs on 2 GPUs
  run 120 python examples/convert_smollm2.py --out $SMOL
  R7="$RESIDENT"
  on 0 r7_engine_old 280 python examples/grpo_hybrid.py --model $SMOL $R7 --old-logprobs engine --out $RUNS/r7_engine_old &
  on 1 r7_trainer_old 280 python examples/grpo_hybrid.py --model $SMOL $R7 --out $RUNS/r7_trainer_old &
  wait
  on 0,1 r7_2gpu 230 python examples/grpo_hybrid.py --model $SMOL ${R7/--steps 16/--steps 12} --old-logprobs engine --num-gpus 2 --out $RUNS/r7_2gpu
  pack
  ;;
32) # round 6, .carry/peers + .carry/raydash (after 31): TRL in the same chain (GPU 0); a short GRPO run through
    # `ray job submit` against a head started with `ray start` (GPU 1), then the hybrid examples' GPU tests (GPU 1)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  on 0 trl_ga1_r6 260 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --out $RUNS/peer_trl_r6.json &
  ( eval "$(bash bench/peers/install-ray-dashboard.sh 2>>"$log")"
    JOBENV='{"py_modules": ["src/rlhfkit"], "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_SAMPLER": "0", "TORCH_CUDA_ARCH_LIST": "9.0", "HF_HUB_OFFLINE": "1"}, "excludes": [".git", ".venv", ".carry", ".whl", "**/__pycache__", "*.egg-info", "runs", "bench/results"]}'
    # the kit drops Ray's dashboard UI build (ray/dashboard/client/build), without which the dashboard head (the
    # job server) refuses to start: a placeholder page is enough for the job API
    build=$(python -c "import os, ray; print(os.path.dirname(ray.__file__))")/dashboard/client/build
    [ -f "$build/index.html" ] || { mkdir -p "$build/static" && echo '<html>UI not packed</html>' > "$build/index.html"; }
    CUDA_VISIBLE_DEVICES=1 timeout 90 ray start --head --num-gpus 1 --num-cpus 8 --dashboard-host 127.0.0.1 --disable-usage-stats >"$RUNS/ray_start.log" 2>&1
    echo "ray start rc=$?" | tee -a "$log"
    for _ in $(seq 30); do curl -sf -o /dev/null http://127.0.0.1:8265/api/version && break; sleep 1; done
    on 1 job_submit 240 ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env-json "$JOBENV" -- python examples/grpo_hybrid.py --model $SMOL --steps 4 --rollout-batch 16 --samples-per-prompt 8 --max-new-tokens 64 --zero-stage 2 --offload-trainers false --no-plot --out $RUNS/job_grpo
    timeout 60 ray stop --force >>"$RUNS/ray_start.log" 2>&1
    tiny
    on 1 pytest_hybrid_r6 300 python -m pytest -q -p no:cacheprovider -m gpu --timeout 280 tests/test_hybrid_examples.py -k "all-resident or engine-old-logprobs" ) &
  wait; pack
  ;;
33) # round 6b, kit chunk 2 (after a call with kit chunk 1): into vLLM with the cheaper plan check (one bucket), the
    # engine core in the actor's process (GPU 0) and in its own (GPU 1)
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  big
  on 0 ipc_vllm_planned_1b_inproc2 200 python bench/ipc_to_vllm.py $IPC --in-process --out $RUNS/ipc_vllm_planned_1b_inproc2.json &
  on 1 ipc_vllm_planned_1b2 200 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_planned_1b2.json &
  wait; pack
  ;;
34) # round 6b, kit chunk 3 (SmolLM2): stage 31's GRPO runs with log-probs of the response tokens only (the LM head
    # on those rows): engine log-probs as the old log-probs (GPU 0), the actor's forward (GPU 1)
  run 120 python examples/convert_smollm2.py --out $SMOL
  R7="$RESIDENT"
  on 0 r8_engine_old 260 python examples/grpo_hybrid.py --model $SMOL $R7 --old-logprobs engine --out $RUNS/r8_engine_old &
  on 1 r8_trainer_old 260 python examples/grpo_hybrid.py --model $SMOL $R7 --out $RUNS/r8_trainer_old &
  wait; pack
  ;;
35) # round 7, kit chunk 1: the channel alone after the protocol change (manifest by compare-and-set, then a start
    # key: one store write more per sync) on GPU 0; then NCCL (the sender joins the group after publishing)
  on 0 ws_ipc_r7 150 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc_r7.json --deadline-s 140
  on 0,1 ws_nccl_r7 150 python bench/weight_sync.py --mode nccl --out $RUNS/weight_sync_nccl_r7.json --deadline-s 140
  pack
  ;;
36) # round 7, kit chunk 2 (after 35): into vLLM with the engine armed before each sync (the sync is the sender's
    # send alone) against the RPC way, same machine: armed, engine core in its own process and in the actor's (GPU 0);
    # RPC, own process, then a tiny fp32 greedy check through an armed sync (GPU 1)
  tiny
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  big
  ( on 0 ipc_vllm_armed 200 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed.json
    on 0 ipc_vllm_armed_inproc 200 python bench/ipc_to_vllm.py $IPC --armed --in-process --out $RUNS/ipc_vllm_armed_inproc.json ) &
  ( on 1 ipc_vllm_rpc_r7 200 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_r7.json
    on 1 ipc_vllm_tiny_armed 150 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --zero-copy --keep-mapped --loading planned --bucket-mb 0 --armed --out $RUNS/ipc_vllm_tiny_armed.json ) &
  wait; pack
  ;;
37) # round 7, kit chunk 3 (SmolLM2): stage 31's GRPO (everything resident, engine log-probs as the old log-probs)
    # with the engine armed at each wake (GPU 0) and the RPC sync (GPU 1); then the armed run on 2 GPUs
  run 120 python examples/convert_smollm2.py --out $SMOL
  R7="$RESIDENT --old-logprobs engine"
  on 0 r9_armed 280 python examples/grpo_hybrid.py --model $SMOL $R7 --sync-mode armed --out $RUNS/r9_armed &
  on 1 r9_rpc 280 python examples/grpo_hybrid.py --model $SMOL $R7 --out $RUNS/r9_rpc &
  wait
  on 0,1 r9_2gpu 230 python examples/grpo_hybrid.py --model $SMOL ${R7/--steps 16/--steps 12} --sync-mode armed --num-gpus 2 --out $RUNS/r9_2gpu
  pack
  ;;
38) # round 7, .carry/peers (after 37): TRL in the same chain (GPU 0); the hybrid examples' GPU tests with armed
    # syncs, ZeRO-2 resident and ZeRO-3 with the engine at sleep level 2 (GPU 1)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  on 0 trl_r7 260 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --out $RUNS/peer_trl_r7.json &
  ( tiny
    on 1 pytest_hybrid_r7 300 python -m pytest -q -p no:cacheprovider -m gpu --timeout 280 tests/test_hybrid_examples.py -k "armed" ) &
  wait; pack
  ;;
39) # round 7b, kit chunk 1: the channel alone again, now with each end's phases (SyncReport.phases)
  on 0 ws_ipc_r7b 150 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc_r7b.json --deadline-s 140
  pack
  ;;
40) # round 7b, kit chunk 2 (after 39): into vLLM, armed and RPC, with the phases of both ends: armed in the engine
    # core's own process, then in the actor's (GPU 0); RPC (GPU 1)
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  big
  ( on 0 ipc_vllm_armed_b 200 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed_b.json
    on 0 ipc_vllm_armed_inproc_b 200 python bench/ipc_to_vllm.py $IPC --armed --in-process --out $RUNS/ipc_vllm_armed_inproc_b.json ) &
  on 1 ipc_vllm_rpc_b 200 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_b.json &
  wait; pack
  ;;
41) # round 7c, kit chunk 1: the channel alone after dropping the per-tensor detach and the check round of a
    # repeated manifest
  on 0 ws_ipc_r7c 150 python bench/weight_sync.py --mode ipc --out $RUNS/weight_sync_ipc_r7c.json --deadline-s 140
  pack
  ;;
42) # round 7c, kit chunk 2 (after 41): into vLLM, armed (GPU 0) and RPC (GPU 1), same changes
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  big
  on 0 ipc_vllm_armed_c 200 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed_c.json &
  on 1 ipc_vllm_rpc_c 200 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_c.json &
  wait; pack
  ;;
43) # round 7d, kit chunk 1: only build the 1.54B random model for stage 44 (a short call)
  big
  ;;
44) # round 7d, kit chunk 2 (after 43): into vLLM, armed (GPU 0) and RPC (GPU 1), after caching the sender's bucket
    # message, the receiver's decoding of it and the worker's whole planned batch (one foreach copy per sync)
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  on 0 ipc_vllm_armed_d 180 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed_d.json &
  on 1 ipc_vllm_rpc_d 180 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_d.json &
  wait; pack
  ;;
45) # round 8, kit chunk 1: the copy-plan replay ways against one device copy (GPU 0) and the GPU test of the CUDA-graph
    # replay; the actor's optimizer step profiled in fp32, TF32 and bf16 (ZeRO-2, varlen, 64 sequences in one
    # micro-batch: one of the example's two optimizer steps) (GPU 1); the 1.54B model for stage 46
  ( on 0 copy_replay 120 python bench/copy_replay.py --out $RUNS/copy_replay.json
    on 0 pytest_copy_plan 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_copy_plan.py
    on 0 train_step_bf16 120 python bench/train_step.py --out $RUNS/train_step_bf16.json --seqs 64 --micro 1 --profile --config-timeout-s 110 --configs zero2_bf16_varlen ) &
  on 1 train_step_r8 240 python bench/train_step.py --out $RUNS/train_step_r8.json --seqs 64 --micro 1 --profile --config-timeout-s 110 --configs zero2_fp32_varlen zero2_tf32_varlen &
  big
  wait; pack
  ;;
46) # round 8, kit chunk 2 (after 45): into vLLM with the plan checked when the engine is armed and the replay as one
    # CUDA graph: armed (GPU 0), RPC then the tiny fp32 greedy check through armed replayed syncs (GPU 1)
  tiny
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  on 0 ipc_vllm_armed_r8 180 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed_r8.json &
  ( on 1 ipc_vllm_rpc_r8 180 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_r8.json
    on 1 ipc_vllm_tiny_r8 150 python bench/ipc_to_vllm.py --model /tmp/tiny-hd64 --zero-copy --keep-mapped --loading planned --bucket-mb 0 --armed --out $RUNS/ipc_vllm_tiny_r8.json ) &
  wait; pack
  ;;
47) # round 8b, kit chunk 1: the weight-sync GPU tests (CUDA IPC, zero-copy, NCCL) after bucket 0 moved before the
    # manifest; then the optimizer step with TF32 matmuls at ZeRO-0/1 and in plain torch (GPU 0, GPU 1)
  run 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_weight_sync.py
  on 0 train_step_z01 150 python bench/train_step.py --out $RUNS/train_step_z01.json --seqs 64 --micro 1 --profile --config-timeout-s 70 --configs zero0_tf32_varlen zero1_tf32_varlen &
  on 1 train_step_torch 100 python bench/train_step.py --out $RUNS/train_step_torch.json --seqs 64 --micro 1 --profile --config-timeout-s 90 --configs torch_tf32_varlen &
  big
  wait; pack
  ;;
48) # round 8b, kit chunk 2 (after 47): into vLLM again, armed (GPU 0) and RPC (GPU 1), bucket 0 ready before the
    # manifest goes out
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  on 0 ipc_vllm_armed_r8b 180 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed_r8b.json &
  on 1 ipc_vllm_rpc_r8b 180 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_r8b.json &
  wait; pack
  ;;
49) # round 8b, kit chunk 3 (SmolLM2): GRPO, armed, TF32 trainers: everything resident (GPU 0, training profiled at
    # step 5) and the engine sleeping at level 2 with a KV pool sized to the workload (GPU 1); then 2 GPUs with twice
    # the prompts (the same per-GPU batch as GPU 0's run)
  run 120 python examples/convert_smollm2.py --out $SMOL
  R8="$RESIDENT --old-logprobs engine --sync-mode armed --tf32 all"
  on 0 r10_res 300 python examples/grpo_hybrid.py --model $SMOL $R8 --profile-step 5 --out $RUNS/r10_res &
  on 1 r10_sleep 300 python examples/grpo_hybrid.py --model $SMOL ${R8/--engine-sleep-level 0/--engine-sleep-level 2} --gpu-memory-utilization 0.05 --out $RUNS/r10_sleep &
  wait
  on 0,1 r10_2gpu 260 python examples/grpo_hybrid.py --model $SMOL ${R8/--steps 16/--steps 12} --rollout-batch 32 --num-gpus 2 --out $RUNS/r10_2gpu
  pack
  ;;
50) # round 8b, .carry/peers (after 49): TRL in the same chain, fp32 (GPU 0) and with TF32 training matmuls (GPU 1)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  on 0 trl_r8 280 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --out $RUNS/peer_trl_r8.json &
  on 1 trl_r8_tf32 280 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --tf32 --out $RUNS/peer_trl_r8_tf32.json &
  wait; pack
  ;;
51) # round 8c, kit chunk 1 then 52, kit chunk 2: install only (vLLM needs both before stage 53)
  ;;
52)
  ;;
53) # round 8c, kit chunk 3 (SmolLM2, after 51, 52): GRPO, armed, everything resident: ZeRO-1 with TF32 only in the
    # actor's backward passes (GPU 0) against round 7's ZeRO-2 fp32 (GPU 1); then the first on 2 GPUs with twice the
    # prompts (the same per-GPU batch)
  run 120 python examples/convert_smollm2.py --out $SMOL
  R8="$RESIDENT --old-logprobs engine --sync-mode armed"
  on 0 r11_z1bwd 300 python examples/grpo_hybrid.py --model $SMOL ${R8/--zero-stage 2/--zero-stage 1} --tf32 backward --out $RUNS/r11_z1bwd &
  on 1 r11_z2fp32 300 python examples/grpo_hybrid.py --model $SMOL $R8 --out $RUNS/r11_z2fp32 &
  wait
  on 0,1 r11_2gpu 260 python examples/grpo_hybrid.py --model $SMOL ${R8/--steps 16/--steps 12} --rollout-batch 32 --num-gpus 2 --zero-stage 1 --tf32 backward --out $RUNS/r11_2gpu
  pack
  ;;
54) # round 8c, .carry/peers (after 53): TRL in the same chain, fp32 (GPU 0) and TF32 (GPU 1)
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  on 0 trl_r8c 280 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --out $RUNS/peer_trl_r8c.json &
  on 1 trl_r8c_tf32 280 python bench/peer_trl.py --model $SMOL ${HYB/--steps 100/--steps 15} --grad-accum 1 --gpu-memory-utilization 0.15 --tf32 --out $RUNS/peer_trl_r8c_tf32.json &
  wait; pack
  ;;
55) # round 8d, kit chunk 1: install only (stage 56 needs vLLM)
  ;;
56) # round 8d, kit chunk 2 (after 55): into vLLM, armed (GPU 0) and RPC (GPU 1), bucket 0's message published
    # before the start key when there is no check round (measured no gain, then reverted: this stage now runs
    # stage 48's code); 3 warm-up syncs (the CUDA graph is captured at the third)
  IPC="--random-layers 30 --dtype bfloat16 --zero-copy --keep-mapped --no-greedy --loading planned --bucket-mb 0"
  big
  on 0 ipc_vllm_armed_r8d 180 python bench/ipc_to_vllm.py $IPC --armed --out $RUNS/ipc_vllm_armed_r8d.json &
  on 1 ipc_vllm_rpc_r8d 180 python bench/ipc_to_vllm.py $IPC --out $RUNS/ipc_vllm_rpc_r8d.json &
  wait; pack
  ;;
57) # round 9, kit chunk 1: the weight-sync GPU tests (bucket 0 and the manifest on the start key, done reported
    # while the copies run); the channel alone, CUDA IPC (GPU 0) then NCCL (GPU 0 -> 1); the 1.54B model is built
  big &
  ws_checks r9
  wait; pack
  ;;
58) # round 9, kit chunk 2 (after 57): into vLLM, armed (GPU 0) and RPC (GPU 1), 1.54B bf16; then the tiny fp32 greedy
    # check through armed replayed syncs (GPU 1) and the vLLM GPU tests (GPU 0)
  tiny
  if [ "$NGPU" -ge 2 ]; then
    ( armed_into_vllm 0 r9
      on 0 pytest_vllm_r9 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_copy_plan.py tests/test_engines_vllm.py ) &
    ( on 1 ipc_vllm_rpc_r9 180 python bench/ipc_to_vllm.py $IPC9 --out $RUNS/ipc_vllm_rpc_r9.json
      tiny_check 1 r9 ) &
  else  # one GPU: the armed sync and the greedy check, one after the other
    armed_into_vllm 0 r9
    tiny_check 0 r9
  fi
  wait; pack
  ;;
59) # round 9, kit chunk 3 (SmolLM2; after 57, 58): GRPO, everything resident, armed, engine log-probs, ZeRO-0, TF32
    # in the actor's backward and the reference's forward: one GPU alone, then two GPUs with twice the prompts (the
    # same per-GPU batch), alone
  run 120 python examples/convert_smollm2.py --out $SMOL
  grpo_r9 r12
  pack
  ;;
60) # round 9, .carry/peers (after 59): TRL in the same chain, with TF32 training matmuls, then fp32, each alone
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  trl_alone r9_tf32 --tf32
  trl_alone r9
  pack
  ;;
61) # round 9b, kit chunk 1: stage 57 again after the manifest moved into the start key (claimed with a token, left
    # out when it repeats)
  big &
  ws_checks r9b
  wait; pack
  ;;
62) # round 9b, kit chunk 2 (after 61): into vLLM armed, twice (two processes, one after the other), then the tiny
    # fp32 greedy check (beside them on GPU 1 when there are two GPUs)
  tiny
  if [ "$NGPU" -ge 2 ]; then tiny_check 1 r9b & else tiny_check 0 r9b; fi
  armed_into_vllm 0 r9b
  armed_into_vllm 0 r9c
  wait; pack
  ;;
63) # round 9b, kit chunk 3 (SmolLM2; after 61, 62): stage 59's GRPO with each role's wake and sleep sent along with
    # its work; then the hybrid examples' GPU tests of the changed paths (ZeRO-0 benchmark configuration, PPO)
  run 120 python examples/convert_smollm2.py --out $SMOL
  grpo_r9 r13
  if [ "$NGPU" -ge 2 ]; then
    on 0 pytest_hybrid_r9 200 python -m pytest -q -p no:cacheprovider -m gpu --timeout 190 tests/test_hybrid_examples.py -k "zero0-bench" &
    on 1 pytest_hybrid_r9b 200 python -m pytest -q -p no:cacheprovider -m gpu --timeout 190 tests/test_hybrid_examples.py -k "ppo" &
    wait
  else
    on 0 pytest_hybrid_r9 280 python -m pytest -q -p no:cacheprovider -m gpu --timeout 270 tests/test_hybrid_examples.py -k "zero0-bench or ppo"
  fi
  pack
  ;;
64) # round 9b, .carry/peers (after 63): TRL with TF32 training matmuls, alone
  eval "$(bash bench/peers/install-peers.sh 2>>"$log")"
  trl_alone r9b_tf32 --tf32
  pack
  ;;
65) # round 9c, kit chunk 1: the weight-sync GPU tests and the channel alone, after the previous sync's start key and
    # zero-copy bucket messages are deleted during the next sync (ran on one GPU: no NCCL run)
  big &
  ws_checks r9d
  wait; pack
  ;;
66) # round 9c, kit chunk 2 (after 65): into vLLM armed, then the tiny fp32 greedy check
  tiny
  armed_into_vllm 0 r9d
  tiny_check 0 r9d
  pack
  ;;
67|68) # round 9d, kit chunks 1 and 2: install only (stage 69 needs vLLM)
  ;;
69) # round 9d, kit chunk 3 (SmolLM2; after 67, 68): round 9's benchmark configuration of GRPO for 100 steps, alone
    # (the reward curve, KL and the engine-vs-trainer gap of every step, with the final code)
  run 120 python examples/convert_smollm2.py --out $SMOL
  on 0 r14_100 400 python examples/grpo_hybrid.py --model $SMOL ${R9/--steps 16/--steps 100} --out $RUNS/r14_100
  pack
  ;;
esac
echo "stage $stage done in $SECONDS s" | tee -a "$log"
