#!/usr/bin/env bash
# GPU checks: generation and PPO-update tokens/s and MFU in bf16 on the tiny default
# config and a ~100M-parameter GPT-2 config, one PPO iteration's memory and time with LoRA, and
# DDP against FSDP per-rank memory on machines with 2 or more GPUs, and the vLLM engine against
# the sampling loop where vllm is installed.
# Needs a CUDA build of torch in .venv (make setup TORCH_SPEC=torch on a CUDA machine). Writes
# bench/results/gpu_throughput*.json, bench/results/memory_scaling_gpu.json and
# bench/results/engine_gpu_*.json.
#
#   bash bench/gpu/gpu.sh [options of the first gpu_throughput.py run]
#   bash bench/gpu/gpu.sh --smoke [--device cpu] [--options-only]
#
# --smoke runs every step below with the same options plus its script's --smoke (the smallest
# sizes, outputs to a temporary folder), so that a renamed option fails here too; with
# --device cpu it runs without a GPU (FSDP, which needs 2 GPUs, is left out then).
# --options-only runs each step only until it has parsed its options (bench/_options.py):
# seconds, where the whole smoke takes minutes on 2 CPU cores (`make test` runs this one, `make
# soak` the whole smoke).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SMOKE=()
DEVICE=cuda
OPTIONS_ONLY=0
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) SMOKE=(--smoke); shift ;;
        --device) DEVICE=$2; shift 2 ;;
        --options-only) OPTIONS_ONLY=1; shift ;;
        *) break ;;
    esac
done
if [ "$OPTIONS_ONLY" = 1 ]; then RUN=(-m bench._options); else RUN=(-m); fi
if [ "$DEVICE" = cuda ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
    "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
elif [ ${#SMOKE[@]} -eq 0 ]; then
    echo "--device $DEVICE: only with --smoke (this script measures GPUs)" >&2
    exit 2
fi
"$PY" "${RUN[@]}" bench.gpu.gpu_throughput --device "$DEVICE" --precision bf16 --configs tiny gpt2-100m \
    --batch 128 --micro 32 --prompt-length 64 --response-length 128 --steps 5 "${SMOKE[@]}" "$@"
# the same in fp32, for the bf16 gain
"$PY" "${RUN[@]}" bench.gpu.gpu_throughput --device "$DEVICE" --precision fp32 --configs gpt2-100m \
    --batch 128 --micro 32 --steps 3 --out bench/results/gpu_throughput_fp32.json "${SMOKE[@]}"
# Memory and time of one PPO iteration on the GPU in bf16: full fine-tuning, LoRA and LoRA with
# gradient checkpointing at ~350M, and a Qwen2-0.5B-shaped model with LoRA + checkpointing
# (random weights; GPU peak = torch.cuda.max_memory_allocated)
"$PY" "${RUN[@]}" bench.speed.memory_scaling --device "$DEVICE" --precision bf16 --sizes 350M \
    --out bench/results/memory_scaling_gpu.json "${SMOKE[@]}"
# The vLLM engine against the sampling loop (tokens/s) at the recipe's 32 rows and at 128, 64 new
# tokens, random weights of SmolLM2-135M's, GPT-2 small's and Qwen2-0.5B's shapes (the GGUF file
# is not on a lent GPU); needs a Python that imports vllm: VLLM_PY, by default $PY on CUDA (an
# environment with `pip install vllm`) and .venv-vllm's on a CPU
if [ "$DEVICE" = cuda ]; then ENGINE_PRECISION=bf16; else ENGINE_PRECISION=fp32; fi
VLLM_PY=$(command -v "${VLLM_PY:-$([ "$DEVICE" = cuda ] && echo "$PY" || echo .venv-vllm/bin/python)}" || true)
# (the smoke takes one shape: the options are the same for each, and each start of the engine
# costs a minute on 2 CPU cores)
SHAPES=(smollm2 gpt2-124m qwen2-0.5b)
if [ ${#SMOKE[@]} -gt 0 ] && [ "$OPTIONS_ONLY" = 0 ]; then SHAPES=(smollm2); fi
if [ -n "$VLLM_PY" ] && "$VLLM_PY" -c "import vllm" 2>/dev/null; then
    for SHAPE in "${SHAPES[@]}"; do
        "$PY" "${RUN[@]}" bench.speed.engine --device "$DEVICE" --precision "$ENGINE_PRECISION" \
            --shape "$SHAPE" --rows 32 128 --vllm-python "$VLLM_PY" \
            --out "bench/results/engine_gpu_$SHAPE.json" "${SMOKE[@]}"
    done
else
    echo "bench/speed/engine.py skipped: no Python that imports vllm (set VLLM_PY)"
fi
# DDP against FSDP (bf16 mixed precision, NCCL), one rank per GPU: needs 2 or more GPUs
if [ "$DEVICE" = cuda ]; then
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
else
    GPUS=0
fi
if [ "$GPUS" -ge 2 ] || [ "$OPTIONS_ONLY" = 1 ]; then  # options are read without GPUs
    "$PY" "${RUN[@]}" bench.speed.sharding --device cuda --precision bf16 --ranks 1 "$GPUS" "${SMOKE[@]}"
else
    echo "bench/speed/sharding.py skipped: FSDP needs 2 or more GPUs, this machine has $GPUS"
fi
