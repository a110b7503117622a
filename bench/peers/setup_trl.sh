#!/usr/bin/env bash
# Builds the virtual environment of the TRL side of bench/peers/ppo_vs_trl.py in bench/.trl-venv.
# TRL 1.12.0 is the last release with PPOTrainer (trl.experimental.ppo); it runs beside the same
# torch, transformers and peft (the LoRA runs) versions as the project's own .venv, so both sides run the same kernels.
# requests (GRPOTrainer imports it) and math-verify (the project's pin) score bench/peers/grpo_vs_trl.py's TRL side with the project's verifier.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3.11}
VENV=bench/.trl-venv
TRANSFORMERS_VERSION=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
PEFT_VERSION=$(.venv/bin/python -c "import peft; print(peft.__version__)")
MATH_VERIFY=$(grep -E '^(math-verify|latex2sympy2_extended)==' requirements.lock | tr '\n' ' ')
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install --quiet "$TORCH_SPEC"
"$VENV/bin/pip" install --quiet "trl==1.12.0" "transformers==$TRANSFORMERS_VERSION" \
    "peft==$PEFT_VERSION" accelerate datasets requests $MATH_VERIFY
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
