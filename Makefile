# The README's commands. Each creates or reuses .venv and installs the pinned dependencies.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# glibc's heap on transparent huge pages: XLA:CPU's per-step buffers then fault in 2 MiB at a time
# (src/moelab/_alloc.py; the moelab command sets this itself)
HUGEPAGES := GLIBC_TUNABLES=glibc.malloc.hugetlb=1
# the default run skips what is marked slow; -n is not used: 2 cores, JAX already uses both
PYTEST := $(HUGEPAGES) $(PY) -m pytest -q

.PHONY: demo test test-newest test-all test-ragged lint format bench docs clean

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.lock -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moelab demo

test: $(STAMP)
	$(PYTEST) -m "not slow"

# the export to transformers and the lm-eval bridge against the newest transformers the extras allow (their
# upper bound), in a second venv: `make test` runs them at the lock's version, the range's lower bound
TRANSFORMERS_NEWEST := 5.25.0
NEWEST := .venv-newest
$(NEWEST)/.installed: pyproject.toml
	@test -x $(NEWEST)/bin/python || $(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q -e ".[harness]" "transformers==$(TRANSFORMERS_NEWEST)" "pytest==9.2.0"
	@touch $@

test-newest: $(NEWEST)/.installed
	$(NEWEST)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(HUGEPAGES) $(NEWEST)/bin/python -m pytest -q -p no:cacheprovider tests/test_export.py tests/test_harness.py \
		tests/test_use.py tests/test_tokenizer.py tests/test_tasks.py

# the slow tests include the Ray backend and the export to transformers, so this also installs the
# ray and bench extras; then the model and training tests again with the MoE through ragged_dot
# (the GPU and TPU default)
test-all: $(STAMP)
	$(PY) -m pip install -q -c requirements.lock -e ".[dev,ray,bench]"
	$(PYTEST)
	$(MAKE) test-ragged

# the model, MoE and training tests with model.moe_impl=ragged (tests/conftest.py: MOE_IMPL)
test-ragged: $(STAMP)
	MOELAB_TEST_MOE_IMPL=ragged $(PYTEST) tests/test_model.py tests/test_moe.py tests/test_train.py

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks experiments
	$(PY) -m ruff format --check src tests benchmarks experiments

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

# vs_transformers.py needs the bench extra (PyTorch CPU, transformers)
bench: $(STAMP)
	$(PY) -m pip install -q -c requirements.lock -e ".[dev,bench]"
	$(HUGEPAGES) $(PY) benchmarks/run_all.py

# the manual: the generated pages (the config and CLI references from the code, the measured results from
# benchmarks/results/), then a strict build into site/ (a broken link or a missing page fails)
docs: $(STAMP)
	$(PY) -m moelab.docgen
	$(PY) benchmarks/results_pages.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache site
