"""analyze_attention.py input loading (--qk files) and the MHLA rank bound."""

import json
import os
import sys

from scripts import analyze_attention
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_load_qk_file_roundtrip_and_errors(tmp_path):
    q, k = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    good = tmp_path / "qk.pt"
    torch.save({"q": q, "k": k}, good)
    q2, k2, source = analyze_attention.load_qk(str(good))
    assert torch.equal(q2, q) and torch.equal(k2, k) and source.startswith("file:")
    bad = tmp_path / "bad.pt"
    torch.save({"q": q}, bad)
    with pytest.raises(ValueError, match="'q' and 'k'"):
        analyze_attention.load_qk(str(bad))
    torch.save({"q": q, "k": k[:, :8]}, bad)
    with pytest.raises(ValueError, match=r"\[B, N, H, d\]"):
        analyze_attention.load_qk(str(bad))
    with pytest.raises(FileNotFoundError):
        analyze_attention.load_qk(str(tmp_path / "missing.pt"))


def test_mhla_rank_bounded_by_blocks_times_d():
    # 64 tokens on an 8 x 8 grid, M = 4 blocks of 16 tokens, d = 2: rank <= sum_b min(16, d) = 8 (SPEC 1.6),
    # while linear attention stays <= d.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 64, 1, 2, generator=g), torch.randn(1, 64, 1, 2, generator=g)
    mats = analyze_attention.attention_matrices(q, k, num_blocks=4)
    r_lin, _ = analyze_attention.rank_and_entropy(mats["linear"])
    r_mh, _ = analyze_attention.rank_and_entropy(mats["mhla"])
    assert r_lin <= 2
    assert 2 < r_mh <= 8


# ------------------------------------------------------------------------------ --ckpt: trained models
def _layers():
    from mhla.layers import LinearAttention, MultiHeadLinearAttention, SoftmaxAttention

    torch.manual_seed(0)
    mh = MultiHeadLinearAttention(32, 2, grid=(8, 8), num_blocks=4, qk_norm=True)
    with torch.no_grad():  # a "learned" mixing matrix, far from the init
        mh.mixing.raw.copy_(torch.rand(4, 4))
    causal = MultiHeadLinearAttention(32, 2, causal=True, block_size=8, normalize=True, mixing_init="uniform")
    with torch.no_grad():
        causal.mixing.raw.copy_(torch.rand_like(causal.mixing.raw))
    return [SoftmaxAttention(32, 2), LinearAttention(32, 2, qk_norm=True), mh, causal,
            LinearAttention(32, 2, causal=True)]


@pytest.mark.parametrize("index", range(5))
def test_own_attention_matrix_reproduces_the_layer_output(index):
    """A @ v equals the layer's attention output: the analysed matrix is the one the model uses (learned
    mixing and block layout included), not a re-initialised stand-in."""
    layer = _layers()[index].double().eval()
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    (_, q, k), = analyze_attention.capture_qk(layer, x)
    kind, A = analyze_attention.own_attention_matrix(layer, q, k)
    assert kind == ("softmax" if index == 0 else "mhla" if index in (2, 3) else "linear")
    layout = layer._token_layout(layer._grid_for(64, None))  # MHLA works in its block-major order
    xb = layout.raster_to_block_major(x) if layout is not None else x
    q2, k2, v = layer._project(xb)
    o = (layer.attend(q2, k2, v, grid=layer._grid_for(64, None), x=xb) if layout is None
         else layer._attend_blocked(q2, k2, v, layout))     # [B, N, H, Dv]
    torch.testing.assert_close(torch.einsum("bhts,bshd->bthd", A, v), o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(A.sum(-1), torch.ones_like(A.sum(-1)))


def test_ckpt_mode_on_trained_runs(tmp_path):
    """--ckpt on three short train.py runs: per-layer rank and entropy of each model's own attention."""
    import subprocess

    runs = []
    for attn in ("softmax", "linear", "mhla"):
        run = tmp_path / attn
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "task=mnist", f"attn={attn}", "data.limit=64",
               "data.batch_size=32",
               "data.eval_limit=16", "trainer.max_steps=1", "logger=none", "trainer.progress_bar=false",
               "trainer.device=cpu", "trainer.count_flops=false", f"hydra.run.dir={run}"]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        runs.append(str(run))
    out = tmp_path / "out"
    assert analyze_attention.main(["--ckpt", *runs, "--batch", "4", "--out-dir", str(out), "--name", "t"]) == 0
    data = json.loads((out / "t.json").read_text())
    by = {m["attention"]: m for m in data["models"]}
    assert set(by) == {"softmax", "linear", "mhla"}
    head_dim = 16  # vit_mnist: width 64, 4 heads
    assert all(lay["rank"] <= head_dim for lay in by["linear"]["layers"])  # linear attention: rank <= d
    assert by["mhla"]["rank"] > by["linear"]["rank"]
    assert len(by["mhla"]["layers"]) == 4 and by["mhla"]["N"] == 64
    # the record names the code, the machine's load and each model's resolved config and run commit
    assert data["commit"] and data["load_before"] is not None and data["load_after"] is not None
    assert all(by[a]["config"]["attn"]["name"] == a and by[a]["run_commit"] for a in by)
    assert (out / "t.png").stat().st_size > 1000
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        analyze_attention.analyze_checkpoint(str(tmp_path), batch=2, rtol=1e-3)


# ------------------------------------------------------------------------- compare_predictions.py
def test_compare_predictions_on_trained_runs(tmp_path):
    """Two short train.py runs: the per-example errors reproduce each run's recorded top-1, and each pair's
    counts partition the eval split."""
    import subprocess

    from scripts import compare_predictions

    runs = {}
    for attn in ("softmax", "mhla"):
        run = tmp_path / attn
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "task=mnist", f"attn={attn}", "data.limit=64",
               "data.batch_size=32", "data.eval_limit=40", "trainer.max_steps=2", "logger=none",
               "trainer.progress_bar=false", "trainer.device=cpu", "trainer.count_flops=false",
               f"hydra.run.dir={run}"]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        runs[attn] = run
    out = tmp_path / "cmp"
    args = [f"{k}={v}" for k, v in runs.items()] + ["--out", str(out)]
    assert compare_predictions.main(args) == 0
    rec = json.loads((tmp_path / "cmp.json").read_text())
    assert rec["n"] == 40 and list(rec["runs"]) == ["softmax", "mhla"]
    for name, r in rec["runs"].items():
        recorded = json.loads((runs[name] / "run.json").read_text())["metrics"]["top1"]
        assert r["top1"] == pytest.approx(recorded, abs=1e-6)          # the same model, the same split
        assert len(r["errors"]) == round((1 - r["top1"]) * 40) and r["config"]["attn"]["name"] == name
    (p,) = rec["pairs"]
    assert (p["a"], p["b"]) == ("softmax", "mhla")
    assert p["only_a_right"] + p["only_b_right"] + p["both_right"] + p["both_wrong"] == 40
    ea, eb = set(rec["runs"]["softmax"]["errors"]), set(rec["runs"]["mhla"]["errors"])
    assert p["both_wrong"] == len(ea & eb) == rec["wrong_in_all"] and rec["wrong_in_any"] == len(ea | eb)
    md = (tmp_path / "cmp.md").read_text()
    assert "McNemar p" in md and "## Reading" not in md
    (tmp_path / "reading.md").write_text("Both models are untrained.")
    assert compare_predictions.main(args + ["--notes", f"@{tmp_path / 'reading.md'}"]) == 0
    assert (tmp_path / "cmp.md").read_text().endswith("## Reading\n\nBoth models are untrained.\n")
    with pytest.raises(SystemExit, match="names a run not given"):
        compare_predictions.main(args + ["--pairs", "softmax:linear"])
    # --split train: the 64 training examples, with the mean cross-entropy a plain pass recomputes
    assert compare_predictions.main(args + ["--split", "train"]) == 0
    rec = json.loads((tmp_path / "cmp.json").read_text())
    assert rec["split"] == "train" and rec["n"] == 64
    from tasks.common.evaluation import eval_loader, load_run
    cfg, task, model, info = load_run(str(runs["mhla"] / "checkpoints" / "last.pt"))
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x), y, reduction="sum") for x, y in
                  eval_loader(cfg, task, info, "train")]
    assert rec["runs"]["mhla"]["loss"] == pytest.approx(float(sum(losses)) / 64, rel=1e-5)
    assert all(r["top1_recorded"] is None for r in rec["runs"].values())  # run.json holds the eval top-1
    recorded = json.loads((runs["mhla"] / "run.json").read_text())["metrics"]["loss"]
    assert rec["runs"]["mhla"]["generalization_gap"] == pytest.approx(recorded - rec["runs"]["mhla"]["loss"])
    assert "eval - train" in (tmp_path / "cmp.md").read_text()
    assert "train split" in (tmp_path / "cmp.md").read_text()
    assert compare_predictions.main(args + ["--split", "train", "--limit", "50"]) == 0  # cuts inside batch 2
    rec50 = json.loads((tmp_path / "cmp.json").read_text())
    assert rec50["n"] == 50 and rec50["limit"] == 50 and "first 50 examples" in (tmp_path / "cmp.md").read_text()
    assert set(rec50["runs"]["mhla"]["errors"]) == {i for i in rec["runs"]["mhla"]["errors"] if i < 50}
    with pytest.raises(ValueError, match="split must be"):
        eval_loader(cfg, task, info, "val")


# ------------------------------------------------------------------------------------ mixing_profile.py
def test_mixing_profile_on_trained_runs(tmp_path):
    """A learnable and a frozen MHLA run: the frozen matrix reads back its init, the record keeps each run's
    config; a model without MHLA is refused."""
    import subprocess

    from scripts import mixing_profile

    runs = {}
    for name, extra in (("mhla_s0", []), ("mhla_frozen_s0", ["attn.mixing_learnable=false"]),
                        ("softmax_s0", ["attn=softmax"])):
        run = tmp_path / name
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "task=mnist", "attn=mhla", *extra, "data.limit=64",
               "data.batch_size=32", "data.eval_limit=16", "trainer.max_steps=2", "logger=none",
               "trainer.progress_bar=false", "trainer.device=cpu", "trainer.count_flops=false",
               "optim.lr=0.05", f"hydra.run.dir={run}"]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        runs[name] = str(run)
    out = tmp_path / "mix"
    assert mixing_profile.main(["--ckpt", runs["mhla_s0"], runs["mhla_frozen_s0"], "--out", str(out)]) == 0
    rec = json.loads((tmp_path / "mix.json").read_text())
    learned, frozen = rec["runs"]
    assert (learned["run"], frozen["run"]) == ("mhla_s0", "mhla_frozen_s0") and rec["commit"]
    assert learned["learnable"] and not frozen["learnable"] and len(frozen["layers"]) == 4
    assert frozen["mean"]["tv_from_init"] == 0 and learned["mean"]["tv_from_init"] > 0  # two steps moved it
    assert frozen["config"]["attn"]["mixing_learnable"] is False and learned["run_commit"]
    assert frozen["attention"]["mixing_learnable"] is False and learned["attention"]["name"] == "mhla"  # as it ran
    assert frozen["mean"]["self_share"] == pytest.approx(frozen["mean"]["self_share_init"])
    # both started from the locality init and the frozen one stayed there: their distance is the learned one's
    # distance from its init
    tv = rec["pairwise_tv"]["mhla_s0|mhla_frozen_s0"]
    assert tv == pytest.approx(learned["mean"]["tv_from_init"], abs=1e-4)
    rows = learned["layers"][0]["rows"]  # the MNIST ViT's 8 x 8 grid in 2 x 2 blocks: M = 4
    assert len(rows) == 4 and sum(rows[3]) == pytest.approx(1, abs=1e-4)
    md = (tmp_path / "mix.md").read_text()
    assert "| mhla_frozen_s0 | locality | no |" in md and "TV from init" in md and "Between runs" in md
    (tmp_path / "reading.md").write_text("Two steps.")
    assert mixing_profile.main(["--ckpt", runs["mhla_s0"], "--out", str(out), "--notes", f"@{tmp_path / 'reading.md'}"]) == 0
    assert (tmp_path / "mix.md").read_text().endswith("## Reading\n\nTwo steps.\n")
    with pytest.raises(SystemExit, match="no MHLA mixing matrix"):
        mixing_profile.main(["--ckpt", runs["softmax_s0"], "--out", str(tmp_path / "none")])
