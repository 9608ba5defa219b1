# The two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck unit bench clean chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[sim,cli]'
	touch $@

# torch==2.13.0 first: the CPU build this machine keeps on disk; '.[torch]' (torch>=2.5) then
# installs nothing more (a bare torch requirement would fetch a CUDA build of several GB)
$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,torch]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/spmdkit plan --model llama-7b --mesh dp=2,tp=4 --strategy megatron --verify

# mypy (one core, ~40 s) beside the suite rather than before it; either failing fails the target
test: $(VENV)/.installed-test lint
	$(MAKE) --no-print-directory -j2 typecheck unit

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests benchmarks

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

unit: $(VENV)/.installed-test chromium
	$(BIN)/python -m pytest -n 2 --durations=25 tests

# headless Chromium for the browser checks of tests/test_html.py: Debian's package, installed
# where missing when root and apt-get is there; never fails (the tests skip, saying why)
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
	      echo "make chromium: apt-get could not install chromium; tests/test_html.py skips its browser checks"; \
	    else echo "make chromium: no chromium (not root or no apt-get); tests/test_html.py skips its browser checks"; fi; }

bench: $(VENV)/.installed-demo
	$(BIN)/python benchmarks/bench_rules.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
