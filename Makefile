# One entry point per job. Every target depends on `setup`, so a fresh clone needs no manual step.
#   make demo                                   the whole pipeline on the built-in tiny default (on the GPU if there is one)
#   make test                                   lint (ruff) and the test suite
#   make format                                 apply ruff's fixes and formatting
#   make test-gpu [part=NAME]                   only the GPU tier (pytest -m gpu): the CUDA paths, on a GPU host
#   make extract [CONFIG=configs/x.toml] [key=value ...]
#   make train   [CONFIG=configs/x.toml] [RUN=name] [key=value ...]
#   make tiers   [CONFIG=configs/x.toml] [key=value ...]   compare storage tiers (python -m recipes.compare_tiers)
#   make regenerate [CONFIG=configs/x.toml] [key=value ...]   the target's own answers for a corpus
#   make smollm2                                 fetch, check and convert the real target SmolLM2-135M-Instruct, write its prompts
#   make demo target=smollm2                     the demo on that real target (the default on a CUDA host)
#   make bench-gpu suite=NAME [key=value ...]    one GPU benchmark suite (benchmarks/suites: real, real-data, tiers-real,
#                                                shape27b, s3): one bare H200, at most 9 min, wheels carried in WHEELS
#   make bench-render [ARGS=--check]             docs/benchmarks.md's "Today" and the README's results table from benchmarks/results
#   make drafter target=DIR prompts=FILE [heldout=FILE] [out=DIR] [server=URL] [scale=smoke] [STAGE.key=value ...]
#                                                a checked, exported drafter for your own target (docs/own-target.md)
# key=value words on the make command line are passed through to the stage's config loader, each as one argument
# (a value may hold spaces, quotes, `&` or `;`: `make extract 'out_dir=s3://b/p?endpoint_override=h:9000&scheme=http'`).
# CONFIG, CKPT, DATA, OUT, suite and a training's RUN are one argument each; ARGS and a report's RUN are split into
# words as a shell would (ARGS="--max-anchors 4", RUN="runs/a runs/b").

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.toml
RUN ?=
# The variables this Makefile itself reads; every other NAME=value of the command line is an override.
OWN_VARS := CONFIG RUN PYTHON PY VENV CKPT DATA OUT ARGS suite WHEELS
# One shell word holding $(1) exactly: single quotes, a ' inside written '\''.
quote = '$(subst ','\'',$(1))'
# The same, or nothing for an empty value.
maybe = $(if $(1),$(call quote,$(1)))
# Each override as one quoted word NAME=value, its value as typed (`$(value)`: make expands nothing in it), by name.
COMMAND_LINE_VARS := $(sort $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
OVERRIDES := $(foreach v,$(filter-out $(OWN_VARS),$(COMMAND_LINE_VARS)),$(call quote,$(v)=$(value $(v))))
# They reach the commands as arguments only: exporting them would expand their values as make text.
unexport $(filter-out $(OWN_VARS),$(COMMAND_LINE_VARS))
# CONFIG for the commands whose config file is optional: passed only when given on the command line.
GIVEN_CONFIG := $(if $(filter command line,$(origin CONFIG)),$(call quote,$(CONFIG)))
# Whether CONFIG is the built-in tiny default, whose set-up the tiny-target and tiny-shards rules make.
IS_TINY = $(filter configs/tiny.toml,$(CONFIG))
export PYTHONUNBUFFERED := 1
# torch's busy-waiting OpenMP threads starve everything else on a small shared CPU machine.
export OMP_WAIT_POLICY := PASSIVE

.PHONY: setup test lint format test-gpu demo drafter extract regenerate train eval export specdecode report tiny tiny-target tiny-shards smollm2 tiers bench-shards bench-tiers bench-extract bench-regenerate bench-train bench-gpu bench-render reliability clean

setup: $(VENV)/.installed

# On a machine without an NVIDIA driver, pin the CPU wheel of torch first: a looser spec pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	# z-lab's reference model code, the DFlash2 export tests' reference; --no-deps: its metadata pins
	# datasets/tqdm/requests versions that would fight ours, and it needs only torch and transformers.
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	touch $@

# Lint first (seconds): `ruff format --check`, `ruff check` (pyproject.toml [tool.ruff]; `make format` fixes what it
# can) and mypy on common/ and shards/ (pyproject.toml [tool.mypy]).
test: setup lint
	$(PY) -m pytest -q -n 2 $(ARGS)

lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# Four workers: most of the tier's time is torch.compile / Triton compilation, which is CPU-bound. part=NAME runs
# one part of it (tests/gpu_tier.py: kernels, extraction, training, decoding; default all) and writes its counts.
test-gpu: setup
	$(PY) -m tests.gpu_tier $(or $(part),all) --wheels $(WHEELS) $(ARGS)

demo: setup
	$(PY) -m recipes.demo $(GIVEN_CONFIG) $(OVERRIDES)

drafter: setup
	$(PY) -m recipes.drafter $(GIVEN_CONFIG) $(OVERRIDES)

tiny: setup
	$(PY) -m recipes.tiny $(GIVEN_CONFIG) $(OVERRIDES)

smollm2: setup
	$(PY) -m recipes.smollm2 $(GIVEN_CONFIG) $(OVERRIDES)

# The tiny default's set-up, for the commands that read it when CONFIG is the tiny default (nothing otherwise):
# its target and corpus (extract, regenerate), and its shards unless they are there (train, tiers, bench-train).
tiny-target: setup
	$(if $(IS_TINY),$(PY) -m recipes.tiny)

tiny-shards: setup
	$(if $(IS_TINY),test -f artifacts/tiny/shards/train/manifest.json || ($(PY) -m recipes.tiny && $(PY) -m extract configs/tiny.toml))

extract: setup tiny-target
	$(PY) -m extract $(call quote,$(CONFIG)) $(OVERRIDES)

regenerate: setup tiny-target
	$(PY) -m extract.regenerate $(call quote,$(CONFIG)) $(OVERRIDES)

train: setup tiny-shards
	$(PY) -m train $(call quote,$(CONFIG)) $(if $(RUN),$(call quote,run_name=$(RUN))) $(OVERRIDES)

eval: setup
	$(PY) -m train.eval $(call maybe,$(CKPT)) $(if $(DATA),--data $(call quote,$(DATA))) $(OVERRIDES) $(ARGS)

export: setup
	$(PY) -m train.serve.export $(call maybe,$(CKPT)) $(call maybe,$(OUT)) $(OVERRIDES) $(ARGS)

specdecode: setup
	$(PY) -m train.serve.specdecode $(OVERRIDES) $(ARGS)

report: setup
	$(PY) -m train.report $(foreach r,$(RUN),$(call quote,$(r))) $(OVERRIDES) $(ARGS)

bench-shards: setup
	$(PY) -m benchmarks.shards $(ARGS) $(OVERRIDES)

bench-tiers: setup
	$(PY) -m benchmarks.shard_tiers $(ARGS) $(OVERRIDES)

# Storage tiers side by side: transcode, train (two seeds each), evaluate against lossless, decode online.
tiers: setup tiny-shards
	$(PY) -m recipes.compare_tiers $(call quote,$(CONFIG)) $(OVERRIDES)

bench-extract: setup
	$(PY) -m benchmarks.extract $(ARGS) $(OVERRIDES)

bench-regenerate: setup
	$(PY) -m benchmarks.regenerate $(ARGS) $(OVERRIDES)

bench-train: setup tiny-shards
	$(PY) -m benchmarks.train $(ARGS) $(OVERRIDES)

# No `setup`: a device host has no network for pip. Its python3 holds torch; the carried wheels in WHEELS are
# installed by the suite itself (benchmarks/suites/__main__.py). Here the venv's python runs it where there is one.
WHEELS ?= .whl
bench-gpu:
	$(if $(wildcard $(PY)),$(PY),python3) -m benchmarks.suites $(call maybe,$(suite)) --wheels $(call quote,$(WHEELS)) $(ARGS) $(OVERRIDES)

bench-render: setup
	$(PY) -m benchmarks.render $(ARGS) $(OVERRIDES)

reliability: setup
	$(PY) -m tests.reliability $(ARGS) $(OVERRIDES)

clean:
	rm -rf $(VENV) artifacts runs .pytest_cache
