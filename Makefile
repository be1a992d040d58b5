# h3train: `make demo` and `make test` do all set-up on a fresh machine.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
# On a machine without CUDA the CPU build of torch is installed first, so that resolving the
# package's own `torch>=2.8` never pulls a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0
# The second test environment: the Docker image's versions (docker/versions.txt), on the CPU.
# PyPI's torch 2.8.0 is a CUDA build (about 6.5 GB) that runs on the CPU too; flash-attn, which
# has no CPU wheel, is the image's only package it lacks.
IMAGE_VENV     := .venv-image
IMAGE_VERSIONS := docker/versions.txt
IMAGE_STAMP    := $(IMAGE_VENV)/.installed

.PHONY: install install-image demo test test-fast lint docker clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install --quiet "$(CPU_TORCH)"; fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install-image: $(IMAGE_STAMP)

$(IMAGE_STAMP): pyproject.toml $(IMAGE_VERSIONS)
	test -x $(IMAGE_VENV)/bin/python || $(PY) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(IMAGE_VENV)/bin/python -m pip install --quiet --constraint $(IMAGE_VERSIONS) torch torchaudio torchao
	$(IMAGE_VENV)/bin/python -m pip install --quiet --constraint $(IMAGE_VERSIONS) -e ".[dev]"
	touch $(IMAGE_STAMP)

demo: install
	$(BIN)/python scripts/demo.py

# Two workers (one per core of the CI machine); each takes whole test files, so the runs a file's
# tests share are trained once. The suite runs in both environments: today's (.venv) and the
# image's (.venv-image, H3TRAIN_TEST_LANE=image), which leaves out the tests marked `one_lane`: what
# no version of torch, diffusers or peft changes (tests/README.md).
TEST_WORKERS ?= 2
PYTEST_ARGS  := -q -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider tests
LANE_VERSIONS := -c "import sys, torch, torchao, diffusers, peft; \
print(f'lane {sys.argv[1]}: torch {torch.__version__}, torchao {torchao.__version__}, diffusers {diffusers.__version__}, peft {peft.__version__}', flush=True)"

test: install install-image
	$(BIN)/ruff check .
	$(BIN)/python $(LANE_VERSIONS) main 2>/dev/null
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(IMAGE_VENV)/bin/python $(LANE_VERSIONS) image 2>/dev/null
	H3TRAIN_TEST_LANE=image $(IMAGE_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The inner loop: lint and the tests not marked slow (no multi-rank launches), in .venv only.
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docker:
	docker build -f docker/Dockerfile -t h3train:latest .

clean:
	rm -rf $(VENV) $(IMAGE_VENV) runs demo_out
