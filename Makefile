# Two commands for a newcomer (see README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-deps test-fast lint docs bench bench-quick gpu-check gpu-wheels clean

$(BIN)/elastrain: pyproject.toml
	@echo "installing into $(VENV)"
	$(PY) -m venv $(VENV)
	# torch first, pinned: on CPU machines 2.13.0 is a local CPU wheel; any other
	# version would pull gigabytes of CUDA packages. pip byte-compiles as it installs (half
	# the install's time), and must: with PYTHONDONTWRITEBYTECODE=1, as on CI's machines,
	# no .pyc is written at import, so every process would compile torch and ray anew.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,docs]"
	touch $@

# Start the service on the embedded defaults (SQLite, local Ray, checkpoints under
# .elastrain/) and submit a small real GPT job; open http://127.0.0.1:8000 to watch it.
demo: $(BIN)/elastrain
	$(BIN)/elastrain serve --demo

# What the suite needs outside the venv: Debian's Chromium (installed with apt-get when run
# as root or with passwordless sudo) and PostgreSQL at 127.0.0.1:5432 (an installed cluster
# that is down is started). Quiet when both are there; says what is missing and fails if not.
test-deps:
	@.ci/setup-system

# The docs site (mkdocs.yml, MkDocs Material) into site/, in a few seconds. Strict: a broken
# link or anchor, or a page missing from the nav, fails the build; the CLI and REST
# reference pages are generated from the code (docs/hooks/reference.py). `make test` builds
# it first. (NO_MKDOCS_2_WARNING: the theme's banner about MkDocs 2.0, on every build.)
docs: $(BIN)/elastrain
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# The docs (strict, above) first, then lint (ruff, mypy), the whole suite: unit,
# integration (real Ray, real PostgreSQL), chaos, browser; and every bench script in its
# quick mode (bench-quick), so a bench that breaks fails CI too. tests/lanes.py runs them
# in three lanes at once: the tests that start a shared Ray cluster one after another in
# one; the other tests, then bench-quick, in the second; lint in the third. --durations:
# each pytest lists its slowest tests, the ones to look at when CI nears its 40-minute
# budget.
test: test-deps $(BIN)/elastrain docs
	$(BIN)/python -m tests.lanes -q --durations=30

test-fast: $(BIN)/elastrain
	@.ci/setup-system postgresql
	$(BIN)/python -m pytest -q -m "not ray and not chaos and not browser"

lint: $(BIN)/elastrain
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

# Every benchmark under bench/, one after another (~45 minutes): docs/benchmarks.md gets
# the run record and each part's headline table, docs/bench-*.md each part's full report
# (between markers; the notes around them stay). PARTS=scheduler,metrics for some.
bench: $(BIN)/elastrain
	@.ci/setup-system postgresql
	$(BIN)/python bench/all.py $(if $(PARTS),--parts $(PARTS))

# The same scripts on small sizes with few repeats, baselines included (~11 minutes on
# 2 cores): checks that each still runs; reports go to a temp dir, not docs/. `make test`
# runs it beside the Ray tests (tests/lanes.py).
bench-quick: $(BIN)/elastrain
	@.ci/setup-system postgresql
	$(BIN)/python bench/all.py --quick $(if $(PARTS),--parts $(PARTS))

# On a machine with an NVIDIA GPU: bf16 DDP and FSDP2 jobs through the service on warm GPU
# processes (a forced recovery, peer restore, checkpoints) vs the same model under plain
# torchrun -> docs/bench-gpu.md. Needs no .venv: it runs .venv's python when its torch sees
# CUDA, else python3's (a machine image's CUDA torch), and installs what the service needs
# beyond torch into .gpu-site/ (offline: from wheels in $$GPU_WHEELS or .whl/, see
# `gpu-wheels`). GPU_TIME_LIMIT seconds bound all its steps; it writes the report even when
# a step fails. Without a GPU it says so and measures nothing.
GPU_TIME_LIMIT ?= 480
GPU_PY = $(shell if $(BIN)/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
	2>/dev/null; then echo $(BIN)/python; else echo $(PY); fi)
gpu-check:
	PYTHONPATH=$(CURDIR) timeout -k 30 $$(( $(GPU_TIME_LIMIT) + 120 )) \
		$(GPU_PY) bench/gpu_check.py --time-limit $(GPU_TIME_LIMIT) $(GPU_ARGS)

# For a GPU machine without internet: the wheels the service needs beyond torch and numpy
# (CPython 3.12, x86-64 Linux). Any over 40 MiB (ray's) is split into .partNN pieces that
# bench/gpu_check.py joins again; the first pieces go to .whl/a/, the rest to .whl/b/, so
# each folder fits one 64 MiB transfer (docs/bench-gpu.md). Run where pip works.
gpu-wheels:
	rm -rf .whl && mkdir -p .whl/a .whl/b
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl/b \
		"ray==2.60.0" fastapi sqlalchemy alembic pydantic-settings httpx pathspec \
		prometheus-client typer pyyaml
	cd .whl/b && rm -f numpy-*.whl && for f in *.whl; do \
		if [ $$(stat -c %s $$f) -gt 41943040 ]; then \
			split -b 40M -d $$f $$f.part && rm $$f && mv $$f.part00 ../a/; \
		fi; \
	done
	@du -sh .whl/a .whl/b

clean:
	rm -rf $(VENV) .elastrain .pytest_cache .gpu-site site
