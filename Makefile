# fa2-gpt: a GPT training recipe with its own FlashAttention-2 kernel.
# On a fresh machine `make train` and `make test` do all the set-up (a .venv of their own).
# On a host whose python already has torch + CUDA (e.g. an offline GPU box): `make PYTHON=python3 <target>`.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
ARGS ?=
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
# What `make train` and `make data` run on this machine (recipe/default_run.py): attention=flash on a GPU with
# the built kernel, attention=sdpa on a GPU without it, experiment=cpu_tiny without a GPU. Expanded when a
# recipe runs, after install.
RUN_ARGS = $(shell $(PYTHON) -m recipe.default_run)

.DEFAULT_GOAL := help
.PHONY: help install build data train sample test test-gpu sanitize bench-kernel bench-e2e baseline clean distclean

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-13s %s\n", $$1, $$2}'

ifeq ($(PYTHON),$(VENV)/bin/python)
install: $(STAMP) ## create .venv with torch, lightning, hydra, datasets, tokenizers, wandb
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	# torch first and pinned, so no dependency range pulls a second (multi-GB) build
	$(PYTHON) -m pip install -q torch==$(TORCH_VERSION)
	$(PYTHON) -m pip install -q -e ".[dev]"
	touch $@
else
install:  # PYTHON given: check that interpreter has what the project needs
	@$(PYTHON) -c "import torch, lightning, hydra, omegaconf, datasets, tokenizers, wandb, numpy, pytest" \
	  || { echo "make install: $(PYTHON) lacks a dependency above; install them (offline GPU hosts: pip install --no-index --find-links .whl ...)"; exit 1; }
endif

build: install ## compile the flash_kernel CUDA extension in place (skips, saying why, without CUDA)
	$(PYTHON) -m flash_kernel.build

data: install ## prepare the data `make train` will use (corpus -> BPE tokenizer -> uint16 shards) under .cache/
	@run_args="$(RUN_ARGS)"; echo "make data: $(PYTHON) -m recipe.prepare_data $$run_args $(ARGS)"; \
	$(PYTHON) -m recipe.prepare_data $$run_args $(ARGS)

train: install build ## prepare data and train: GPU -> attention=flash (sdpa if the kernel is unavailable); CPU -> experiment=cpu_tiny
	@run_args="$(RUN_ARGS)"; echo "make train: $(PYTHON) train.py $$run_args $(ARGS)"; \
	$(PYTHON) train.py $$run_args $(ARGS)

sample: install build ## generate text from the last checkpoint of `make train` (ARGS='prompt="def main(" temperature=0')
	@ckpt=$$(ls -td outputs/*/*/checkpoints/last.ckpt 2>/dev/null | head -n 1); \
	[ -n "$$ckpt" ] || { echo "make sample: no outputs/*/*/checkpoints/last.ckpt yet; run make train first"; exit 1; }; \
	echo "make sample: $(PYTHON) sample.py ckpt_path=$$ckpt $(ARGS)"; \
	$(PYTHON) sample.py ckpt_path=$$ckpt $(ARGS)

# make test leaves nothing in the tree: no bytecode, no .pytest_cache (the tests write runs under tmp)
# where pytest-xdist is installed (the dev extra), -n auto spreads whole test files over the worker processes that
# tests/conftest.py asks for: one per core up to 4 without a GPU, none (this process) with one. XDIST expands when
# the recipe runs, after `install`.
XDIST = $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "-n auto --dist loadfile")
test: install build ## run the test suite (CPU tests always; GPU tests when a GPU and the built kernel are present)
	PYTHONDONTWRITEBYTECODE=1 $(PYTHON) -m pytest -q -p no:cacheprovider $(XDIST) $(ARGS)

test-gpu: install build ## only the GPU tests (kernel correctness), failing if they would skip
	$(PYTHON) -c "import torch, flash_kernel as fk, sys; sys.exit(0 if torch.cuda.is_available() and fk.is_available() else 'test-gpu: ' + str(fk.unavailable_reason()))"
	$(PYTHON) -m pytest -q -m gpu $(ARGS)

sanitize: install build ## compute-sanitizer memcheck + racecheck on a small kernel case (0 errors expected)
	@command -v compute-sanitizer >/dev/null || { echo "make sanitize: compute-sanitizer is not on PATH; it ships with the CUDA toolkit (e.g. /usr/local/cuda/bin): add that to PATH, on a machine with a GPU"; exit 1; }
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PYTHON) -m flash_kernel.sanitize
	compute-sanitizer --tool racecheck --error-exitcode 1 $(PYTHON) -m flash_kernel.sanitize

bench-kernel: install build ## FA2 Figure-5 style kernel TFLOP/s vs SDPA backends (ARGS="--hdims 128 ..." to filter)
	$(PYTHON) bench/kernel.py $(ARGS)

bench-e2e: install build ## end-to-end GPT throughput/MFU through the real pipeline (ARGS to filter)
	$(PYTHON) bench/e2e.py $(ARGS)

BASELINE_DIR ?= .baseline
baseline: ## REV=<commit>: that commit's flash_kernel/ in .baseline/, a build to time against (bench/device_run.sh)
	@test -n "$(REV)" || { echo "make baseline: name the commit, e.g. make baseline REV=HEAD~1"; exit 1; }
	rm -rf $(BASELINE_DIR) && mkdir -p $(BASELINE_DIR)
	git archive $(REV) flash_kernel | tar -x -C $(BASELINE_DIR)
	@echo "make baseline: $(BASELINE_DIR)/flash_kernel is $$(git rev-parse --short $(REV))'s"

clean: ## remove build outputs (keeps .venv and the data cache)
	rm -rf flash_kernel/_build flash_kernel/_candidate flash_kernel/_C*.so build *.egg-info .pytest_cache .baseline
	find . -path ./$(VENV) -prune -o -name __pycache__ -prune -exec rm -rf {} +

distclean: clean ## also remove .venv, data caches and run directories
	rm -rf $(VENV) .cache outputs multirun lightning_logs wandb
