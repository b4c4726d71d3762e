# Ultra-Scale Lab. The README's two commands: `make course` and `make test`.
#
#   make course            create .venv if needed and open JupyterLab on the course
#   make course NO_BROWSER=1 PORT=8899   ... without opening a browser (prints the URL)
#   make test              create/refresh .venv and run everything (lint, unit, multi-rank, notebooks, browser)
#   make test-fast         everything except the notebooks and the browser lane
#   make test-browser      only the real-browser lane (needs /usr/bin/chromium)
#   make test-jax          only the JAX track (tests/test_jaxtrack_*.py, in processes of their own)
#   make doctor            what this machine can run
#   make bench-gpu         on NVIDIA GPUs: parity tests under CUDA/NCCL, MFU, bandwidth, every benchmark's GPU column
#                          (JSON records under benchmarks/results/); one clear line and exit 2 without a GPU
#   make record-gpu        on NVIDIA GPUs: the memory snapshot and profiler traces chapters 01-03 show

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8888
NO_BROWSER ?=
PYTEST_ARGS ?=
# Without an NVIDIA GPU take the CPU build of torch (an unpinned `torch` pulls a multi-GB CUDA build);
# with one, any torch >= 2.5 (keep your CUDA build).
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.5' || echo 'torch==2.13.0')
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
BROWSER_FLAG := $(if $(NO_BROWSER),--no-browser)

.PHONY: venv course test test-fast test-jax test-notebooks test-browser lint doctor bench-gpu record-gpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[all]"
	touch $@

course: venv
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --port=$(PORT) $(BROWSER_FLAG) $(ROOT_FLAG) \
		chapters/00_welcome.ipynb

lint: venv
	$(PY) -m ruff check .

# The browser and JAX lanes run first so that the main suite's summary is the last line printed. The JAX track's
# tests get their own processes: the main suite's workers fork ranks, which is unsafe once JAX has started.
test: lint
	@if [ -x /usr/bin/chromium ]; then $(MAKE) --no-print-directory test-browser; \
	else echo "SKIPPED the browser lane: /usr/bin/chromium not found (apt-get install chromium)"; fi
	$(MAKE) --no-print-directory test-jax
	$(PY) -m pytest -n 2 -m "not browser and not jax" $(PYTEST_ARGS)

test-fast: lint test-jax
	$(PY) -m pytest -n 2 -m "not browser and not notebooks and not jax" $(PYTEST_ARGS)

test-jax: venv
	$(PY) -m pytest -n 2 -m jax $(PYTEST_ARGS)

test-browser: venv
	$(PY) -m pytest -m browser -p no:xdist $(PYTEST_ARGS)

doctor: venv
	$(PY) -m lab doctor

bench-gpu: venv
	$(PY) benchmarks/gpu_lane.py bench $(GPU_ARGS)

record-gpu: venv
	$(PY) benchmarks/gpu_lane.py record $(GPU_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache tests/browser/artifacts
