# The two commands of the README: `make compare` (the main job) and `make test` (the test suite).
# Both create .venv and install everything on first use. `make lint` (ruff, mypy), `make docs` and `make dist`
# are what CI adds.
PYTHON ?= python3
VENV ?= .venv
# The torch that .venv gets, installed before the package (whose `torch>=2.9.1` it then satisfies). Which build
# `torch==2.13.0` is depends on where pip finds it: PyPI's Linux x86_64 wheel is the CUDA build (several GB); a
# local CPU wheel that pip is pointed at (--find-links, as on the project's CI machines) is the CPU build; on other
# machines a CPU-only wheel needs PyTorch's CPU index: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Changing either value (`make test TORCH_SPEC=torch==2.11.0`) reinstalls torch on the next make.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
CPU_INDEX_URL := https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lightning_mp-installed
# holds the torch request the venv was built with; rewritten only when TORCH_SPEC or TORCH_INDEX_URL changes
TORCH_STAMP := $(VENV)/.torch-spec
TORCH_REQUEST := $(TORCH_SPEC)$(if $(TORCH_INDEX_URL), --index-url $(TORCH_INDEX_URL))
# LitGPT for tests/test_fabric_litgpt.py (a Fabric program of others), installed without its dependencies, so that
# .venv keeps the newest jsonargparse (LitGPT pins <=4.41; `make pip-check` resolves the two together, `make test-min`
# tests our floor) and none of its hub and tokenizer packages; the two packages that litgpt.model and litgpt.pretrain
# import beyond ours come with it
LITGPT_SPEC ?= litgpt==0.5.13
LITGPT_SPECS ?= $(LITGPT_SPEC) safetensors>=0.4.3 psutil==7.2.2

.PHONY: setup compare demo test test-fast test-min test-gpu test-differential lint docs docs-serve docs-browser dist pip-check clean FORCE

setup: $(STAMP)

$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH_REQUEST)" ]; then echo "$(TORCH_REQUEST)" > $@; fi

# pip shows what it downloads, with a progress bar on a terminal; each step says first what it fetches
$(STAMP): pyproject.toml $(TORCH_STAMP)
	@echo "make: setting up $(VENV)/ (first use, or pyproject.toml or the torch request changed)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make: 1/3 torch: $(TORCH_SPEC) $(if $(TORCH_INDEX_URL),from $(TORCH_INDEX_URL),-- from PyPI on Linux x86_64 the CUDA \
	build: several GB with NVIDIA's libraries (a CPU-only build, about 190 MB: make ... TORCH_INDEX_URL=$(CPU_INDEX_URL)))"
	$(PY) -m pip install --progress-bar on "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	@echo "make: 2/3 the package, editable, with its test and docs extras (Lightning, ruff, mypy, mkdocs, ...)"
	$(PY) -m pip install --progress-bar on -e ".[test,docs]"
	@echo "make: 3/3 LitGPT for one test, without its dependencies: $(LITGPT_SPECS)"
	$(PY) -m pip install --progress-bar on --no-deps $(foreach s,$(LITGPT_SPECS),"$(s)")
	touch $(STAMP)
	@echo "make: $(VENV)/ is ready"

compare: $(STAMP)
	$(PY) -m lightning_mp compare

demo: $(STAMP)
	$(PY) -m lightning_mp demo

# pytest exits 5 when it collected no tests: a run that tests nothing fails here. LIGHTNING_MP_SUITE_BUDGET=1: the
# whole suite held to README.md's time for this kind of CPU (tests/conftest.py): a quarter over it is reported, twice
# it fails, except on a machine busy with other work.
test: $(STAMP)
	@LIGHTNING_MP_SUITE_BUDGET=1 $(PY) -m pytest -q tests; status=$$?; \
	if [ $$status -eq 5 ]; then \
		echo "pytest collected no tests (exit 5): failing, a run that tests nothing is no pass"; fi; \
	exit $$status

# The lowest versions pyproject.toml declares (its dependencies and the `cli` extra's jsonargparse), installed in their
# own venv (.venv-min) and put through the whole test suite: what is declared is what is tested. Keep MIN_SPECS and
# pyproject.toml's minimums the same (a test checks).
# torch 2.9.1 comes from PyPI as its CUDA build (about 3 GB with its NVIDIA libraries; it runs on the CPU too).
MIN_VENV ?= .venv-min
MIN_SPECS ?= torch==2.9.1 lightning==2.5.0 torchmetrics==1.0.0 jsonargparse[signatures]==4.39.0
MIN_STAMP := $(MIN_VENV)/.lightning_mp-installed

$(MIN_STAMP): pyproject.toml Makefile
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	@echo "make: the lowest versions into $(MIN_VENV)/: $(MIN_SPECS) (torch 2.9.1 from PyPI: its CUDA build, about 3 GB)"
	$(MIN_VENV)/bin/python -m pip install --progress-bar on $(foreach s,$(MIN_SPECS),"$(s)")
	$(MIN_VENV)/bin/python -m pip install --progress-bar on -e ".[test]" $(foreach s,$(MIN_SPECS),"$(s)")
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/python -c "import torch, lightning, torchmetrics, jsonargparse as j; \
	print('minimum versions: torch', torch.__version__, 'lightning', lightning.__version__, \
	'torchmetrics', torchmetrics.__version__, 'jsonargparse', j.__version__)"
	$(MIN_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

# the suite without the tests marked slow (the heaviest: subprocesses, spawned ranks, torch.compile, the docs build,
# long training runs; the whole suite's time is in README's table): a quick check; CI runs everything
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -rs -m gpu tests/gpu

# the differential tests (tests/differential: small Lightning programs drawn by Hypothesis, each against its oracle)
# at ten times the budget `make test` gives them (DIFFERENTIAL_EXAMPLES programs per test, 8 there)
DIFFERENTIAL_EXAMPLES ?= 80
test-differential: $(STAMP)
	DIFFERENTIAL_EXAMPLES=$(DIFFERENTIAL_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/differential

# ruff with pyproject.toml's [tool.ruff] settings (line length 120, as setup.cfg's flake8 section), then mypy with
# its [tool.mypy] settings (the package, lightning_mp/)
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# the documentation site (mkdocs.yml, docs/) in site/, built strictly: a broken link, anchor, included file or API
# reference fails; no network or GPU needed (NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2.0, not a warning)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# the site served to read it, at http://127.0.0.1:8000 (search works and pages reload as docs/ changes; site/index.html
# opened from disk shows folder listings for the pages' links and has no search)
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# the wheel and the sdist in dist/; then the unpacked sdist must collect exactly the tests this tree collects
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	tar -xzf dist/*.tar.gz -C "$$tmp"; \
	cd "$$tmp"/*/; \
	$(abspath $(PY)) -c 'import lightning_mp, os, sys; sys.exit(not lightning_mp.__file__.startswith(os.getcwd()))'; \
	there=$$($(abspath $(PY)) -m pytest --collect-only -q -p no:cacheprovider tests | tail -n 1 | sed 's/ in .*//'); \
	cd $(CURDIR); \
	here=$$($(PY) -m pytest --collect-only -q -p no:cacheprovider tests | tail -n 1 | sed 's/ in .*//'); \
	echo "the repository: $$here; the unpacked sdist (its own lightning_mp): $$there"; \
	if [ "$$here" != "$$there" ]; then echo "the sdist does not collect the same tests"; exit 1; fi

# the built site rendered headless in Chromium (installed from the system's package manager if missing; Playwright
# from pip) at 1280 px and at a phone's 390 px: fails on code blocks or tables wider than the content column, images
# that do not load, lists run on in a paragraph, and on the phone on table names or chart text out of view
docs-browser: $(STAMP)
	PY=$(PY) bash .ci/docs-browser

# this package with its `cli` extra, LitGPT ($(LITGPT_SPEC)) and Lightning's pytorch-extra resolved together in a
# fresh venv of their own (removed after), then `pip check`; torch as above (TORCH_SPEC, TORCH_INDEX_URL)
pip-check:
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX_URL="$(TORCH_INDEX_URL)" LITGPT_SPEC="$(LITGPT_SPEC)" \
		bash .ci/pip-check

clean:
	rm -rf $(VENV) $(MIN_VENV) lightning_logs .pytest_cache build dist site
