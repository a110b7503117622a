#!/usr/bin/env bash
# Builds the virtual environment of the llama.cpp side of bench/peers/export.py in bench/.llama-venv:
# llama-cpp-python builds llama.cpp itself from source with this machine's C++ compiler (CPU
# only, about 11 minutes on two cores). It is kept out of the project's .venv and its lock: the
# pipeline never imports it; it is the consumer that checks what `ppo export` writes.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3.11}
VENV=bench/.llama-venv
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# CMAKE_ARGS: a portable CPU build without the optional BLAS and OpenMP back ends
CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF"} \
    "$VENV/bin/pip" install --quiet "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
