# The two commands a new user runs: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp
CONFIG ?= configs/quickstart.yaml

.PHONY: help install browser postgres train data test test-slow test-all test-gpu lint bench tta tensorboard clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install flowers with its dev tools

browser:  ## Debian's chromium and chromedriver for the page's browser test (apt, as root or with sudo -n)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then echo "chromium and chromedriver are installed"; \
	elif ! command -v apt-get >/dev/null; then echo "no apt-get: install chromium and chromedriver yourself, or the browser test skips"; \
	else sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y --no-install-recommends chromium chromium-driver \
	  || { $$sudo apt-get update && $$sudo apt-get install -y --no-install-recommends chromium chromium-driver; } \
	  || echo "could not install chromium with apt: the browser test will skip"; fi

postgres:  ## Debian's PostgreSQL for the test of a sweep shared by two machines (the test starts its own server)
	@if command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then echo "postgresql is installed"; \
	elif ! command -v apt-get >/dev/null; then echo "no apt-get: install PostgreSQL yourself, or that test skips"; \
	else sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y --no-install-recommends postgresql \
	  || { $$sudo apt-get update && $$sudo apt-get install -y --no-install-recommends postgresql; } \
	  || echo "could not install postgresql with apt: that test will skip"; fi

train: $(STAMP)  ## train the quickstart (synthetic flowers, CPU, 3 to 5 minutes)
	$(BIN)/flowers fit --config $(CONFIG)

data: $(STAMP)  ## download the real flower photos (~220 MB) into data/flower_photos, once
	$(BIN)/flowers download

test: $(STAMP)  ## run the default test suite (5 to 9 minutes on 2 cores)
	$(BIN)/python -m pytest -n auto --dist loadfile

test-slow: $(STAMP)  ## run only the slow tests (real photos, longer runs; 12 to 22 minutes on 2 cores)
	$(BIN)/python -m pytest -m slow -n auto --dist loadfile

test-all: $(STAMP)  ## run every test
	$(BIN)/python -m pytest -m ''

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check flowers tests benchmarks

test-gpu: $(STAMP)  ## the GPU checks (tests/gpu; they skip without CUDA); every GPU figure: benchmarks/gpu/run_all.sh
	$(BIN)/python -m pytest -m gpu tests/gpu

TTA_ARGS ?= --recipe configs/speedrun.yaml --budgets 0.65,2 --targets 0.80,0.85
tta: $(STAMP)  ## accuracy at a budget: speedrun.yaml at 0.65 and 2 x the tutorial loop's time, 3 seeds (needs `make data`)
	$(BIN)/python benchmarks/bench.py --tta $(TTA_ARGS)

bench: $(STAMP)  ## time an epoch: plain PyTorch vs Lightning vs configs/fast.yaml (needs `make data`)
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

tensorboard: $(STAMP)  ## serve the logs under runs/ on http://127.0.0.1:6006
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1 --port 6006

clean:  ## remove runs, generated data and caches (keeps .venv)
	rm -rf runs lightning_logs data .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
