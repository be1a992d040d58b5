# h3train: `make demo` and `make test` do all set-up on a fresh machine.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
# On a machine without CUDA the CPU build of torch is installed first, so that resolving the
# package's own `torch>=2.6` never pulls a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0

.PHONY: install demo test lint docker clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install --quiet "$(CPU_TORCH)"; fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: install
	$(BIN)/python scripts/demo.py

# Two workers (one per core of the CI machine); each takes whole test files, so the runs a file's
# tests share are trained once.
TEST_WORKERS ?= 2

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docker:
	docker build -f docker/Dockerfile -t h3train:latest .

clean:
	rm -rf $(VENV) runs demo_out
