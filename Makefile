# The two commands of the README: `make compare` (the main job) and `make test` (the test suite).
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; set TORCH_SPEC to your CUDA build's pin on a GPU machine.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lightning_mp-installed

.PHONY: setup compare demo test test-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

compare: $(STAMP)
	$(PY) -m lightning_mp compare

demo: $(STAMP)
	$(PY) -m lightning_mp demo

# pytest exits 5 when it collected no tests: a run that tests nothing fails here.
test: $(STAMP)
	@$(PY) -m pytest -q tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests (exit 5): failing, a run that tests nothing is no pass"; fi; \
	exit $$status

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
