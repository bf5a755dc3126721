# Two commands for a fresh machine: `make demo` (set up + the default GRPO job on 2 local CPU ranks)
# and `make test` (set up + lint + the test suite). Everything installs into ./.venv.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel pinned for the set-up; GPU users: make TORCH_SPEC="torch" (or install torch first).
TORCH_SPEC ?= torch==2.13.0
BIN = $(VENV)/bin
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: demo test lint install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/syncwise train

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
