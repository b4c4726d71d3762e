# Ultra-Scale Lab. The README's two commands: `make course` and `make test`.
#
#   make course            create .venv if needed and open JupyterLab on the course
#   make course NO_BROWSER=1 PORT=8899   ... without opening a browser (prints the URL)
#   make test              create/refresh .venv and run everything (lint, unit, multi-rank, notebooks, site, browser)
#   make test-fast         everything except the notebooks, the browser lane and the slow tests (inductor
#                          builds; second passes such as the secret-seed grading; sweeps; the GPU lane on a CPU)
#   make test-browser      only the real-browser lane (needs /usr/bin/chromium)
#   make test-jax          only the JAX track (tests/test_jaxtrack_*.py, in processes of their own)
#   make site              the course as web pages in site/ (open site/index.html), from the chapters `make test` ran
#   make site-serve        make site, then serve it at http://127.0.0.1:8000/ (SITE_PORT=N): the live calculators
#   make doctor            what this machine can run
#   make kernels-compile   every Triton kernel of lab.kernels compiled for an H100 (sm_90a) without a GPU: registers,
#                          local-memory spills and shared memory per launch config (~2 min of one core cold,
#                          ~5 s from Triton's cache)
#   make bench-gpu         on NVIDIA GPUs: parity tests under CUDA/NCCL, MFU, bandwidth, every benchmark's GPU column
#                          (JSON records under benchmarks/results/); one clear line and exit 2 without a GPU
#   make bench-gpu-36      on NVIDIA GPUs: issue 36's measurements (kernels, MFU, decode, FP8) in 8 minutes
#                          (gpu_lane.py bench --plan issue36; benchmarks/results/README.md says how on a lent GPU)
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

.PHONY: venv course test test-fast test-jax test-notebooks test-browser site site-serve lint doctor kernels-compile bench-gpu bench-gpu-36 record-gpu clean

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

# Lint, the JAX lane, the main suite (its notebook tests save the executed chapters under build/executed/), the site
# built from those, then the browser lane (JupyterLab, and the site's pages). The JAX track's tests get their own
# processes: the main suite's workers fork ranks, which is unsafe once JAX has started. A failing main suite or site
# still lets the lanes after it run, and fails `make test` at the end, where the main suite's summary is printed again.
test: lint
	$(MAKE) --no-print-directory test-jax
	@mkdir -p build; \
	{ $(PY) -m pytest -n 2 --dist worksteal -m "not browser and not jax" $(PYTEST_ARGS); echo $$? > build/main-suite.rc; } \
		| tee build/main-suite.log; \
	status=$$(cat build/main-suite.rc); \
	$(MAKE) --no-print-directory site || status=1; \
	if [ -x /usr/bin/chromium ]; then $(MAKE) --no-print-directory test-browser || status=1; \
	else echo "SKIPPED the browser lane: /usr/bin/chromium not found (apt-get install chromium)"; fi; \
	echo "main suite (-m 'not browser and not jax'), exit status $$(cat build/main-suite.rc):"; \
	grep -E '^=+ .* in [0-9.]+s' build/main-suite.log | tail -n 1; \
	exit $$status

test-fast: lint test-jax
	$(PY) -m pytest -n 2 --dist worksteal -m "not browser and not notebooks and not jax and not slow" $(PYTEST_ARGS)

test-jax: venv
	$(PY) -m pytest -n 2 -m jax $(PYTEST_ARGS)

test-browser: venv
	$(PY) -m pytest -m browser -p no:xdist $(PYTEST_ARGS)

# site/ from build/executed/chapters/ (lab/site.py says in one line what is missing). The widgets' renderer
# (@jupyter-widgets/html-manager), MathJax and the live calculators' Python (Pyodide's core: the WebAssembly
# interpreter, its standard library and loader; no packages) come from the npm registry, unpacked once into
# build/site-vendor/, so that the pages load nothing from a CDN.
HTML_MANAGER := @jupyter-widgets/html-manager@1.0.15
MATHJAX := mathjax@3.2.2
PYODIDE := pyodide@314.0.7
SITE_VENDOR := build/site-vendor
SITE_PORT ?= 8000

site: venv $(SITE_VENDOR)/.installed
	$(PY) -m lab site

site-serve: site
	$(PY) -m lab site --serve --port $(SITE_PORT)

$(SITE_VENDOR)/.installed: Makefile
	@command -v npm >/dev/null || { echo "make site: npm not found (apt-get install npm): it fetches $(HTML_MANAGER), $(MATHJAX) and $(PYODIDE)"; exit 2; }
	rm -rf $(SITE_VENDOR) && mkdir -p $(SITE_VENDOR)/html-manager $(SITE_VENDOR)/mathjax $(SITE_VENDOR)/pyodide
	cd $(SITE_VENDOR) && npm pack --silent $(HTML_MANAGER) $(MATHJAX) $(PYODIDE) >/dev/null
	tar xzf $(SITE_VENDOR)/jupyter-widgets-html-manager-*.tgz -C $(SITE_VENDOR)/html-manager --strip-components=2 \
		--exclude='*.map' --exclude='*amd*' package/dist
	tar xzf $(SITE_VENDOR)/mathjax-*.tgz -C $(SITE_VENDOR)/mathjax --strip-components=2 package/es5/tex-svg-full.js
	tar xzf $(SITE_VENDOR)/pyodide-*.tgz -C $(SITE_VENDOR)/pyodide --strip-components=1 \
		package/pyodide.mjs package/pyodide.asm.mjs package/pyodide.asm.wasm \
		package/python_stdlib.zip package/pyodide-lock.json
	rm $(SITE_VENDOR)/*.tgz
	touch $@

doctor: venv
	$(PY) -m lab doctor

# No GPU needed: what only a GPU compile refuses (tl.dot under 16, shared memory over budget) and register spills,
# found before GPU time is spent. KERNELS_ARCH=sm_80 for an A100. Exit status 1 when a kernel fails to compile.
KERNELS_ARCH ?= sm_90a
kernels-compile: venv
	@mkdir -p build
	$(PY) -m lab.kernels.cross_compile --arch $(KERNELS_ARCH) --json build/kernels-compile-$(KERNELS_ARCH).json

bench-gpu: venv
	@$(PY) benchmarks/gpu_lane.py bench $(GPU_ARGS)

bench-gpu-36: venv
	@$(PY) benchmarks/gpu_lane.py bench --plan issue36 $(GPU_ARGS)

record-gpu: venv
	@$(PY) benchmarks/gpu_lane.py record $(GPU_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache tests/browser/artifacts
