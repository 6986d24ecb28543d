"""Two cells never write to the same place: run folders (``outputs/<table>/<cell>/<settings>``), FID sample folders
(``samples/<table>/<cell>/<sampler run name>``) and result records name the settings that tell cells apart
(model, resolution, attention, M, seed, schedule); the sampler's own folder name does too, so a manual
``tasks.image_gen.sample --out samples`` of two different cells cannot collide either."""

from __future__ import annotations

import argparse
import os

import pytest
from helpers.inputs import fake_fid_refs, fake_inputs
from omegaconf import OmegaConf
from scripts.tables import config, registry, runner

from tasks.common.config import model_attention, run_settings, settings_tag
from tasks.image_gen.sample import run_name


def runs(tmp_path):
    """``(table, cell, seed, composed config)`` of every cell run (full scale, inputs given: Table 3b's weights
    make its cells fine-tunes) with the seeds its table runs by default."""
    out = []
    for spec in registry.TABLES.values():
        if spec.kind != "cells":
            continue
        for cell in registry.table_cells(spec.id):
            base, _ = config.compose(cell.overrides)
            given = fake_inputs(base, tmp_path)
            for seed in spec.seeds or (None,):
                extra = [f"seed={seed}"] if seed is not None else []
                out.append((spec, cell, seed, config.compose([*cell.overrides, *given, *extra])[0]))
    return out


@pytest.fixture(scope="module")
def every_run(tmp_path_factory):
    return runs(tmp_path_factory.mktemp("inputs"))


def test_run_folders_are_unique_and_name_the_settings(every_run):
    args = argparse.Namespace(scale="full")
    folders = {}
    for spec, cell, seed, cfg in every_run:
        s = run_settings(cfg)
        folder = runner.run_dir_for(spec, cell, args, settings_tag(s))
        assert folder not in folders, (folder, folders.get(folder), cell.name)
        folders[folder] = cell.name
        tag = os.path.basename(folder)
        assert s["attention"] in tag and f"seed{cfg.seed}" in tag and s["schedule"] in tag
        if cfg.model.kind in ("dit", "dig"):
            assert f"{cfg.data.image_size}px" in tag
        if s["M"]:
            assert f"M{s['M']}" in tag


def test_sampler_folder_tells_every_generation_cell_apart(every_run):
    """Two generation runs get the same sample folder name only when they are the same experiment (the same cell
    in two tables, e.g. Table 3a's DiT-S/2 256 MHLA and Table 12's CPE + gate row)."""
    args = argparse.Namespace(cfg_scale=1.0, method="ddpm", steps=250, seed=0)
    seen = {}
    for spec, cell, seed, cfg in every_run:
        if cfg.model.kind not in ("dit", "dig"):
            continue
        name = run_name(cfg, 400000, args)
        what = OmegaConf.to_container(OmegaConf.create({k: cfg[k] for k in ("model", "seed")}), resolve=True)
        what["attn"] = model_attention(cfg)  # the attention as built (an explicit default = the default)
        what["data"] = cfg.data.image_size
        if name in seen:
            assert seen[name][1] == what, (name, seen[name][0], f"{spec.id}/{cell.name}")
        seen[name] = (f"{spec.id}/{cell.name}", what)
    names = {n.split("-step")[0] for n in seen}
    # the collisions of the issue: 256 / 512 px, M = 4 / 16 / 64, DiG GLA / MHLA, Table 11's seeds
    assert {"dit_s_2-256px-mhla+cpe+gate-M16-seed0-400000steps", "dit_s_2-512px-mhla+cpe+gate-M16-seed0-400000steps",
            "dit_s_2-512px-mhla+cpe+gate-M4-seed0-400000steps", "dit_s_2-512px-mhla+cpe+gate-M64-seed0-400000steps",
            "dig_s_2-256px-gla-seed0-400000steps", "dig_s_2-256px-mhla-M16-seed0-400000steps",
            "dig_s_2-512px-gla-seed0-400000steps", "dit_xl_2-256px-mhla+cpe+gate-M16-seed1-400000steps",
            "dit_xl_2-256px-mhla+cpe+gate-M16-seed2-400000steps", "dit_xl_2-ft-256px-mhla-M16-seed0-400000steps",
            "dit_xl_2-ft-256px-softmax-seed0-400000steps"} <= names


def test_result_records_carry_the_settings(monkeypatch, tmp_path):
    """A cell's record (the .json row) holds its settings, its run folder and its samples folder."""
    monkeypatch.setattr(runner, "gpu_count", lambda: 8)
    monkeypatch.setattr(runner, "run_training", lambda overrides, threads=None, launcher=None: {
        "command": "train", "seconds": 1.0, "metrics": {"loss": 0.1}})
    monkeypatch.setattr(runner, "sample_fid", lambda *a: {"fid": 1.0, "samples": "samples/table3/x/y"})
    args = argparse.Namespace(scale="full", extra=[], gpus=8, fid_refs={}, no_fid=False)
    cell = next(c for c in registry.table_cells("3a") if c.name == "dit_s2_512_mhla")
    base, _ = config.compose(cell.overrides)
    args.extra, args.fid_refs = fake_inputs(base, tmp_path), fake_fid_refs(tmp_path, (512,))
    rec = runner.run_cell("3a", cell, args)
    assert rec["settings"] == {"model": "dit_s_2", "resolution": "512", "attention": "mhla+cpe+gate", "M": "16",
                               "seed": 0, "schedule": "400000steps"}
    assert rec["run_dir"] == os.path.join("outputs", "table3", "dit_s2_512_mhla",
                                          "dit_s_2-512px-mhla+cpe+gate-M16-seed0-400000steps")
    assert rec["samples"] == ["samples/table3/x/y"] and rec["metrics"]["fid"] == 1.0
