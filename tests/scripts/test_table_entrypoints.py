"""One entry point per paper table (``scripts/reproduce_table.py --table N``, ``make reproduce-tableN``): every
table id dispatches (launchers monkeypatched, nothing trains), the ``scale`` config group composes the CPU proxy
that the old command-line overrides made, FID references of another image size are refused, and ``make help``
lists every target."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess

from scripts import eval_fid
import numpy as np
import pytest
from scripts import reproduce_table as rt
from scripts.tables import benchmark, config, registry, runner, writers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_FID = runner.sample_fid  # the real one (Launcher replaces it)

METRICS = {"classification": {"top1": 0.9, "top5": 0.99}, "generation": {"loss": 0.1, "mse": 0.05},
           "sana": {"loss": 2.0}}


class Launcher:
    """Stands in for train.py (run_training), the FID sampler, the benchmark, the delegates and the export."""

    def __init__(self, monkeypatch, gpus=8):
        self.runs, self.fids, self.delegated, self.exports, self.benches = [], [], [], [], []
        monkeypatch.setattr(runner, "run_training", self.train)
        monkeypatch.setattr(runner, "gpu_count", lambda: gpus)
        monkeypatch.setattr(runner, "sample_fid", self.fid)
        monkeypatch.setattr(runner, "delegate", self.delegate)
        monkeypatch.setattr(runner, "export_pretrained", self.export)
        monkeypatch.setattr(benchmark, "bench_across_m", self.bench)

    def train(self, overrides, threads=None, launcher=None):
        self.runs.append({"overrides": overrides, "launcher": launcher})
        kind = ("sana" if "table4/" in overrides[0] else
                "generation" if re.search(r"table(3|3b|7b|12)/|table3/", overrides[0]) else "classification")
        seed = next((int(o.split("=")[1]) for o in overrides if o.startswith("seed=")), 0)
        metrics = {k: v + 0.01 * seed for k, v in METRICS[kind].items()}
        return {"command": "python train.py " + " ".join(overrides), "seconds": 1.0, "metrics": metrics,
                "params_M": 1.0}

    def fid(self, spec, cell, run_dir, n, image_size, cfg_scale, args):
        self.fids.append((cell.name, image_size, cfg_scale))
        return {"fid": 50.0 + cfg_scale, "sfid": 5.0}

    def delegate(self, module, argv):
        self.delegated.append((module, argv))
        return 0

    def export(self, overrides, run_dir):
        self.exports.append(overrides)
        return {"command": "export", "seconds": 1.0, "metrics": {}, "params_M": 675.0}

    def bench(self, table, scale, device, batch=None, repeats=None):
        self.benches.append((table, scale, device))
        ms = registry.BENCH[table][scale][1]
        rows = [{"M": m, "blocks": [1, m], "tokens_per_block": 1024 // m, "n_tokens": 1024, "ms": 10.0 + m,
                 "p25_ms": 9.0, "p75_ms": 11.0, "images_per_s": 100.0 - m} for m in ms]
        header = {"res": registry.BENCH[table][scale][0], "n_tokens": 1024, "cpe_gate": False, "batch": 1,
                  "precision": "fp32", "repeats": 1, "cpu": "test"}
        return {"header": header, "time_method": "fake", "rows": rows}


def _first(table, n=2):
    return [c.name for c in registry.table_cells(table)[:n]]


def inputs_for(table, root) -> list[str]:
    """Runner arguments that give a table's full-scale cells their declared inputs (stand-ins under ``root``):
    ``--fid-ref`` per resolution, then ``--`` and the overrides of the first cell's ``key`` inputs (the cells of
    one table share them)."""
    from helpers.inputs import fake_fid_refs, fake_inputs  # noqa: PLC0415

    cell = registry.table_cells(table)[0]
    cfg, _ = config.compose(cell.overrides)
    refs = [f"{k}={v}" for k, v in fake_fid_refs(root).items()]
    return ["--fid-ref", *refs, "--", *fake_inputs(cfg, root)]


CELL_TABLES = [t for t, s in registry.TABLES.items() if s.kind == "cells"]


@pytest.mark.parametrize("table", [*registry.TABLES, "3"])
def test_every_table_id_dispatches(table, monkeypatch, tmp_path, capsys):
    fake = Launcher(monkeypatch)
    spec = registry.table_spec(table)
    argv = ["--table", table, "--results-dir", str(tmp_path)]
    if spec.kind == "delegate":
        assert rt.main([*argv, "--", "--some-option", "x"]) == 0
        ((module, cmd),) = fake.delegated
        driver, lead = registry.DELEGATES[spec.id]
        assert module == driver and module.startswith("scripts.tables.") and cmd[:len(lead)] == lead
        assert cmd[-2:] == ["--some-option", "x"] and not fake.runs
        return
    if spec.kind == "bench":
        assert rt.main(argv) == 0
        assert fake.benches == [(spec.bench, "full", "cuda")]
        md = (tmp_path / f"table{spec.id}.md").read_text()
        assert "| 1024 |" in md and "| 219 |" in md  # the paper's latency at M = 1024 beside ours
        return
    try:
        names = _first(spec.id, 3 if spec.id == "7b" else 2)
    except registry.NoCells:  # a table whose cells are not written: said so, nothing run, nothing written
        assert rt.main(argv) == 2
        assert "no cells yet" in capsys.readouterr().err and not fake.runs and not list(tmp_path.iterdir())
        return
    given = inputs_for(spec.id, tmp_path)  # the cells' declared inputs: without them nothing starts
    extra = given[given.index("--") + 1:]
    assert rt.main([*argv, "--only", *names, *given]) == 0
    md = (tmp_path / f"{spec.results_stem('full')}.md").read_text()
    rows = json.loads((tmp_path / f"{spec.results_stem('full')}.json").read_text())["rows"]
    assert [r["cell"] for r in rows] == names
    trained = [c for c in registry.table_cells(spec.id) if c.name in names and not c.eval_only]
    assert len(fake.runs) == len(trained) * len(spec.seeds or [None])
    for run in fake.runs:  # torchrun on the GPUs, the cell's overrides first, the extra overrides last
        assert run["launcher"] == ["torchrun", "--nproc_per_node=8"]
        assert run["overrides"][0].startswith("experiment=") and any(o.startswith("hydra.run.dir=") for o in
                                                                     run["overrides"])
        assert not extra or run["overrides"][-len(extra):] == extra
    for cell in registry.table_cells(spec.id):
        if cell.name in names:  # the paper's numbers beside ours
            key = next(k for k in cell.paper if k not in ("table", "row"))
            value = writers.paper_value(cell.paper, key)  # with the paper's spread where it gives one
            assert f"| {cell.name} | {cell.paper.get('row', '')} | {value} |" in md
    if spec.id in ("3a", "7b", "12", "3b"):
        assert fake.fids and all(size in (256, 512) for _, size, _ in fake.fids)
    if spec.id == "7b":  # throughput across M measured with the table, merged by M
        assert fake.benches == [("7b", "full", "cuda")] and "## Throughput across M" in md
        assert "| dit_s2_512_mhla_m4 | DiT-S/2 512 MHLA M = 4 | 79.56 | 435 |" in md


def test_table_3b_adds_the_self_attention_baseline(monkeypatch, tmp_path, capsys):
    fake = Launcher(monkeypatch)
    cells = {c.name: c for c in registry.table_cells("3b")}
    base = cells["dit_xl2_256_softmax_pretrained"]
    assert base.eval_only and base.paper["fid"] == 9.62 and base.paper["fid_cfg"] == 2.27
    given = inputs_for("3b", tmp_path)
    weights = next(o for o in given if o.startswith("model.pretrained="))
    # without the released weights nothing starts: the fine-tune would silently train from scratch
    assert rt.main(["--table", "3b", "--results-dir", str(tmp_path), *[o for o in given if o != weights]]) == 2
    err = capsys.readouterr().err
    assert not fake.runs and not fake.exports and not (tmp_path / "table3b.md").exists()
    assert "model.pretrained=/models/DiT-XL-2-256x256.pt" in err and "dl.fbaipublicfiles.com/DiT" in err
    assert "(cells: dit_xl2_256_mhla_finetune, dit_xl2_256_softmax_pretrained)" in err
    assert rt.main(["--table", "3b", "--results-dir", str(tmp_path), *given]) == 0
    (export,) = fake.exports
    assert "attn=softmax" in export and weights in export
    assert len(fake.runs) == len(cells) - 1  # the baseline trains nothing
    # FID without and with guidance (cfg 1.5) for every cell, at 256 px
    assert sorted(f for f in fake.fids if f[0] == base.name) == [(base.name, 256, 1.0), (base.name, 256, 1.5)]
    md = (tmp_path / "table3b.md").read_text()
    assert "| paper FID | paper FID (cfg 1.5) |" in md and "| 9.62 | 2.27 |" in md and "51.00" in md
    assert rt.main(["--table", "3b", "--scale", "mini", "--results-dir", str(tmp_path)]) == 2
    assert "no CPU proxy" in capsys.readouterr().err


@pytest.mark.parametrize("table, cell, option", [
    ("3", "dit_s2_512_mhla", "mini/dit_s_512"), ("3a", "dit_xl2_256_softmax", "mini/dit_xl"),
    ("3a", "dig_s2_512_gla", "mini/dig_s2_512"), ("12", "dit_s2_mhla", "mini/dit_s"),
    ("13", "deit_t_384_mhla", "mini/deit_t"), ("2", "deit_s_mhla", "mini/deit_s"), ("2", "vlt_t_mhla", "mini/vlt_t"),
    ("4", "sana_600m_mhla", "mini/sana_600m"), ("7a", "deit_t_mhla_locality_frozen", "mini/deit_t"),
    ("7b", "dit_s2_512_mhla_m64", "mini/dit_s_512")])
def test_mini_cells_compose_the_scale_group(table, cell, option, monkeypatch):
    fake = Launcher(monkeypatch, gpus=0)
    args = argparse.Namespace(scale="mini", extra=["data.limit=8"], gpus=0, seeds=None)
    rec = runner.run_cell(table, cell, args, seed=3)
    assert "metrics" in rec, rec
    (run,) = fake.runs
    over = run["overrides"]
    assert run["launcher"] is None and f"scale={option}" in over and "seed=3" in over and over[-1] == "data.limit=8"
    assert not any(o.startswith(("task=", "model=", "trainer.")) for o in over)  # all of it is in configs/scale


# The CPU proxy as command-line overrides (what reproduce_table passed before configs/scale/ existed)
OLD_MINI = {
    "deit_t": ["task=mnist", "model=vit_mini", "trainer.max_epochs=1", "trainer.device=cpu", "logger=none",
               "trainer.progress_bar=false", "trainer.count_flops=false", "data.batch_size=128"],
    "dit_s_512": ["task=mnist_gen", "model=dit_mnist", "model.depth=4", "model.hidden_size=64", "data.image_size=32",
                  "task.prediction=eps", "trainer.max_steps=100", "sched.warmup_steps=20", "trainer.device=cpu",
                  "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "data.batch_size=32",
                  "data.eval_limit=256", "trainer.eval_every_steps=null", "task.sample.grid=false",
                  "model.input_size=32", "model.patch_size=2", "model.token_blocks=16"],
    "dig_s2": ["task=mnist_gen", "model=dig_mnist", "data.image_size=32", "task.prediction=eps",
               "trainer.max_steps=100", "sched.warmup_steps=20", "trainer.device=cpu", "logger=none",
               "trainer.progress_bar=false", "trainer.count_flops=false", "data.batch_size=32", "data.eval_limit=256",
               "trainer.eval_every_steps=null", "task.sample.grid=false", "model.input_size=32", "model.patch_size=4"],
}


@pytest.mark.parametrize("experiment, option, old", [
    ("table2/deit_t_mhla", "mini/deit_t", "deit_t"), ("table13/deit_t_512_softmax", "mini/deit_t", "deit_t"),
    ("table3/dit_s2_512_linear", "mini/dit_s_512", "dit_s_512"), ("table3/dig_s2_256_mhla", "mini/dig_s2", "dig_s2")])
def test_scale_group_composes_what_the_old_overrides_did(experiment, option, old):
    from omegaconf import OmegaConf

    new, choices = config.compose([f"experiment={experiment}", f"scale={option}"])
    before, _ = config.compose([f"experiment={experiment}", *OLD_MINI[old]])
    assert OmegaConf.to_container(new) == OmegaConf.to_container(before)
    assert choices["scale"] == option and new.trainer.device == "cpu" and choices["logger"] == "none"
    full, full_choices = config.compose([f"experiment={experiment}"])
    explicit, _ = config.compose([f"experiment={experiment}", "scale=full"])
    assert full_choices["scale"] == "full" and OmegaConf.to_container(full) == OmegaConf.to_container(explicit)


def test_every_mini_cell_has_a_scale_option():
    for table in ("2", "3a", "4", "7a", "7b", "12", "13"):
        for cell in registry.table_cells(table):
            option = config.mini_option(config.cell_info(cell))
            assert os.path.isfile(os.path.join(config.SCALE_DIR, option + ".yaml")), (table, cell.name)
    with pytest.raises(ValueError, match="configs/scale/mini/lm_340m.yaml"):
        config.mini_option({"model": "lm_340m", "image_size": None})


def test_seeds_give_mean_and_std(monkeypatch, tmp_path):
    fake = Launcher(monkeypatch, gpus=0)
    argv = ["--table", "13", "--scale", "mini", "--seeds", "0", "1", "2", "--only", "deit_t_384_mhla",
            "--results-dir", str(tmp_path)]
    assert rt.main(argv) == 0
    assert sorted(o for r in fake.runs for o in r["overrides"] if o.startswith("seed=")) == ["seed=0", "seed=1",
                                                                                          "seed=2"]
    row = json.loads((tmp_path / "table13_mini.json").read_text())["rows"][0]
    assert row["n"] == 3 and len(row["runs"]) == 3 and row["metrics"]["top1"] == pytest.approx(0.91)
    assert row["metrics_std"]["top1"] == pytest.approx(0.01)
    md = (tmp_path / "table13_mini.md").read_text()
    assert "| deit_t_384_mhla | DeiT-T 384px MHLA | 77.5 | 91.00 ± 1.00 |" in md and "| n |" in md


def test_table11_runs_three_seeds_by_default(monkeypatch, tmp_path):
    fake = Launcher(monkeypatch, gpus=0)
    cell = registry.Cell("deit_t_mhla", ["experiment=table2/deit_t_mhla"],
                         {"table": "11", "row": "MHLA", "top1": 75.8}, "configs/experiment/table11/deit_t_mhla.yaml")
    monkeypatch.setattr(registry, "table_cells", lambda table: [cell])
    assert rt.main(["--table", "11", "--scale", "mini", "--results-dir", str(tmp_path)]) == 0
    assert len(fake.runs) == 3 and "91.00 ± 1.00" in (tmp_path / "table11_mini.md").read_text()


def test_missing_cells_are_reported_not_crashed(monkeypatch, tmp_path, capsys):
    fake = Launcher(monkeypatch)
    monkeypatch.setattr(registry, "EXPERIMENTS", str(tmp_path / "none"))
    for table in ("12", "11"):
        assert rt.main(["--table", table, "--results-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"Table {table}" in err and "no cells yet" in err and "Nothing was run" in err
    assert len(registry.table_cells("7a")) == 3  # 7a / 7b fall back to their sweeps
    assert not fake.runs and not list(tmp_path.glob("*.md"))


def test_delegates_pass_scale_and_refuse_a_missing_proxy(monkeypatch, tmp_path, capsys):
    fake = Launcher(monkeypatch)
    assert rt.main(["--table", "mqar", "--scale", "mini", "--seeds", "0", "1", "--", "--epochs", "1"]) == 0
    assert fake.delegated[-1] == ("scripts.tables.mqar", ["--scale", "mini", "--seeds", "0", "1", "--epochs", "1"])
    assert rt.main(["--table", "6", "--", "--ckpt-dir", "/c"]) == 0
    assert fake.delegated[-1] == ("scripts.tables.lm_tables", ["table6", "--ckpt-dir", "/c"])
    for table in ("6", "8"):
        assert rt.main(["--table", table, "--scale", "mini"]) == 2
        assert "no CPU proxy" in capsys.readouterr().err
    assert len(fake.delegated) == 2
    # Table 5's CPU proxy is its own entry point (the video_mini model), the full scale the Wan2.1 one
    assert rt.main(["--table", "5", "--scale", "mini", "--seeds", "0", "1"]) == 0
    assert fake.delegated[-1] == ("scripts.tables.table5_mini", ["--seeds", "0", "1"])
    assert rt.main(["--table", "5", "--", "--wan", "/w"]) == 0
    assert fake.delegated[-1] == ("scripts.tables.table5", ["--wan", "/w"])
    # --plot-only reaches the drivers that redraw; Tables 6 / 8 have nothing to redraw
    assert rt.main(["--table", "5", "--scale", "mini", "--plot-only"]) == 0
    assert fake.delegated[-1] == ("scripts.tables.table5_mini", ["--plot-only"])
    assert rt.main(["--table", "mqar", "--plot-only"]) == 0
    assert fake.delegated[-1] == ("scripts.tables.mqar", ["--scale", "full", "--plot-only"])
    assert rt.main(["--table", "6", "--plot-only"]) == 2


def test_table14_benchmark_runs_for_real(monkeypatch, tmp_path):
    """A tiny case through bench_models' timing: DiT-S/2 at 64 px (N = 16 tokens), M = 1 and 4; the load around
    it is recorded, and a busy machine's timing is refused unless --allow-busy (then marked BUSY)."""
    from tasks.common import records  # noqa: PLC0415

    monkeypatch.setitem(registry.BENCH, "14", {**registry.BENCH["14"], "mini": (64, (1, 4))})
    monkeypatch.setattr(records, "load_average", lambda: [0.1, 0.1, 0.1])  # an idle machine
    monkeypatch.setattr(records, "busy_cpu_s", lambda: None)  # (other processes' CPU share: not read here)
    assert rt.main(["--table", "14", "--scale", "mini", "--bench-repeats", "1", "--results-dir", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "table14_mini.json").read_text())
    data = saved["bench"]
    assert [r["M"] for r in data["rows"]] == [1, 4] and all(r["ms"] > 0 for r in data["rows"])
    assert data["rows"][1]["blocks"] == [2, 2] and data["rows"][1]["tokens_per_block"] == 4
    m = saved["measurement"]
    assert m["load_before"] == m["load_after"] == [0.1, 0.1, 0.1] and m["busy"] is False and len(m["commit"]) == 40
    md = (tmp_path / "table14_mini.md").read_text()
    assert "on this CPU" in md and "| 4 | 2x2 | 4 | yes | 147 |" in md  # the paper's latency at M = 4
    assert "Load: 1-minute load average 0.10 before, 0.10 after" in md and "**BUSY**" not in md

    monkeypatch.setattr(records, "load_average", lambda: [5.0, 5.0, 5.0])  # another job on a 2-core machine
    monkeypatch.setattr(records.os, "cpu_count", lambda: 2)
    busy = tmp_path / "busy"
    assert rt.main(["--table", "14", "--scale", "mini", "--bench-repeats", "1", "--results-dir", str(busy)]) == 2
    assert not busy.exists() or not list(busy.iterdir())  # refused: nothing written
    assert rt.main(["--table", "14", "--scale", "mini", "--bench-repeats", "1", "--results-dir", str(busy),
                    "--allow-busy"]) == 0
    md = (busy / "table14_mini.md").read_text()
    assert md.splitlines()[0].endswith(" - BUSY") and "**BUSY**: measured while the machine was busy" in md
    assert json.loads((busy / "table14_mini.json").read_text())["measurement"]["busy"] is True


# ----------------------------------------------------------------------------------------- FID references
def _npz(path, size, n=2, **extra):
    np.savez(path, arr_0=np.zeros((n, size, size, 3), np.uint8), **extra)
    return str(path)


def test_fid_reference_of_another_size_is_refused(tmp_path):
    ref256 = _npz(tmp_path / "ref_a.npz", 16)  # stands for a 256 px ADM batch
    ref512 = _npz(tmp_path / "ref_b.npz", 32)
    samples512 = _npz(tmp_path / "samples.npz", 32)
    assert eval_fid.reference_image_size(ref256) == 16
    assert eval_fid.parse_fid_refs([f"16={ref256}", f"32={ref512}"]) == {16: ref256, 32: ref512}
    assert eval_fid.parse_fid_refs([ref512]) == {32: ref512}  # a bare path is keyed by its images' size
    with pytest.raises(eval_fid.ReferenceMismatch, match="holds 16x16 images but the samples are 32x32"):
        eval_fid.parse_fid_refs([f"32={ref256}"])
    with pytest.raises(eval_fid.ReferenceMismatch, match="16x16"):
        eval_fid.evaluate(samples512, ref256)
    with pytest.raises(SystemExit) as e:  # the CLI refuses with exit 2
        eval_fid.main([samples512, ref256, "--no-write"])
    assert e.value.code == 2
    # stats files: the recorded size, else the size their name states, else the key given
    stats = tmp_path / "VIRTUAL_imagenet256_labeled.npz"
    np.savez(stats, mu=np.zeros(4), sigma=np.eye(4))
    assert eval_fid.reference_image_size(str(stats)) is None
    assert eval_fid.parse_fid_refs([str(stats)]) == {256: str(stats)}
    with pytest.raises(eval_fid.ReferenceMismatch, match="its name says 256 px"):
        eval_fid.parse_fid_refs([f"512={stats}"])
    recorded = tmp_path / "stats.npz"
    np.savez(recorded, mu=np.zeros(4), sigma=np.eye(4), image_size=np.array(512))
    with pytest.raises(eval_fid.ReferenceMismatch, match="512x512 images but the samples are 256x256"):
        eval_fid.check_reference(str(recorded), 256)
    unnamed = tmp_path / "stats_only.npz"
    np.savez(unnamed, mu=np.zeros(4), sigma=np.eye(4))
    with pytest.raises(ValueError, match="give its resolution"):
        eval_fid.parse_fid_refs([str(unnamed)])
    assert "as declared" in eval_fid.check_reference(str(unnamed), 512)
    with pytest.raises(eval_fid.ReferenceMismatch, match="declared 16 px"):
        eval_fid.evaluate(samples512, str(unnamed), ref_size=16)


def test_reproduce_table_routes_each_resolution_to_its_reference(monkeypatch, tmp_path, capsys):
    fake = Launcher(monkeypatch)
    ref256 = _npz(tmp_path / "VIRTUAL_imagenet256_labeled.npz", 256, n=1)
    ref512 = _npz(tmp_path / "VIRTUAL_imagenet512.npz", 512, n=1)
    # a 256 px reference given for 512 px is refused before anything runs
    argv = ["--table", "3a", "--only", "dit_s2_512_mhla", "--results-dir", str(tmp_path)]
    assert rt.main([*argv, "--fid-ref", f"512={ref256}"]) == 2
    assert "holds 256x256 images" in capsys.readouterr().err and not fake.runs
    # each cell samples against the reference of its resolution
    real_evaluate, seen = eval_fid.evaluate, []

    class Proc:
        returncode, stderr = 0, ""

        def __init__(self, path):
            self.stdout = f"wrote {path}\n"

    def fake_run(cmd, **kw):
        size = 512 if "512" in cmd[cmd.index("--ckpt") + 1] else 256
        return Proc(_npz(tmp_path / f"s{size}.npz", size, n=1))

    def fake_evaluate(samples, ref, ref_size=None, **kw):
        seen.append((os.path.basename(samples), os.path.basename(ref), ref_size))
        return {"fid": 1.0, "implementation": {}}

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    monkeypatch.setattr(eval_fid, "evaluate", fake_evaluate)
    args = argparse.Namespace(scale="full", fid_refs=eval_fid.parse_fid_refs([f"256={ref256}", f"512={ref512}"]))
    spec = registry.table_spec("3a")
    for name, size in (("dit_s2_512_mhla", 512), ("dit_s2_256_mhla", 256)):
        cell = next(c for c in registry.table_cells("3a") if c.name == name)
        run_dir = str(tmp_path / f"run{size}")
        out = SAMPLE_FID(spec, cell, run_dir, 1, size, 1.0, args)
        assert out == {"fid": 1.0, "samples": os.path.relpath(str(tmp_path), ROOT)}
    assert seen == [("s512.npz", "VIRTUAL_imagenet512.npz", 512), ("s256.npz", "VIRTUAL_imagenet256_labeled.npz", 256)]
    # the samples are checked too: a reference slipped in under the wrong key is refused at scoring time
    monkeypatch.setattr(eval_fid, "evaluate", real_evaluate)
    args.fid_refs = {512: ref256}
    cell = next(c for c in registry.table_cells("3a") if c.name == "dit_s2_512_mhla")
    out = SAMPLE_FID(spec, cell, str(tmp_path / "run512"), 1, 512, 1.0, args)
    assert "fid" not in out and "holds 256x256 images" in out["fid_error"]
    args.fid_refs = {}
    assert SAMPLE_FID(spec, cell, str(tmp_path / "run512"), 1, 512, 1.0, args) == {}
    assert "no --fid-ref for 512 px" in capsys.readouterr().out



# ------------------------------------------------------------------------------------------------ Makefile
def _makefile_targets():
    text = open(os.path.join(ROOT, "Makefile")).read().replace("\\\n", " ")
    targets = {m.group(1) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9_.-]*):(?!=)", text, re.MULTILINE)}
    phony = {t for line in re.findall(r"^\.PHONY:(.*)$", text, re.MULTILINE) for t in line.split()}
    return targets, phony, text


def test_make_help_lists_every_target():
    """Every explicit target is in ``make help`` and ``.PHONY``; every table's target (run by the one
    ``reproduce-%`` rule) is in ``make help`` through the registry's lines (``registry.make_help``)."""
    targets, phony, text = _makefile_targets()
    assert "reproduce-%" in re.findall(r"^(\S+):", text, re.MULTILINE)
    tables = {registry.make_target(spec).split()[-1] for spec in registry.TABLES.values()}
    if shutil.which("make"):
        help_text = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout
    else:  # the echo lines of the help target, and the tables' lines it prints
        help_text = "\n".join(re.findall(r'^\t@echo "(.*)"$', text, re.MULTILINE)) + "\n" + registry.make_help()
    words = set(re.findall(r"[A-Za-z0-9][A-Za-z0-9_.-]*", help_text))
    missing_help = sorted(t for t in targets | tables if t not in words)
    assert not missing_help, f"targets not in make help: {missing_help}"
    missing_phony = sorted(t for t in targets if t not in phony)
    assert not missing_phony, f"targets not in .PHONY: {missing_phony}"


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_targets_call_the_table_runner_with_scale():
    for spec in registry.TABLES.values():
        target = registry.make_target(spec).split()[-1]
        out = subprocess.run(["make", "-n", target, "SCALE=mini", "SEEDS=0 1"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        line = next(line for line in out.splitlines() if "reproduce_table.py" in line)
        assert f"--table {spec.id} " in line and "--scale mini" in line, line
        if spec.kind == "cells":
            assert "--seeds 0 1" in line
    out = subprocess.run(["make", "-n", "reproduce-table3", "REF=256=a.npz 512=b.npz"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "--table 3 --scale full --fid-ref 256=a.npz 512=b.npz --" in out  # 3 = 3a (registry.ALIASES)
    assert registry.table_spec("3").id == "3a"
