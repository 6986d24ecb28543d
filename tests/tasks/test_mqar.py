"""MQAR data generator against its definition (placement, labels, vocab halves, power-law gaps) and the task."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mhla.layouts import auto_block_size
from tasks.language.mqar import mqar_loss_and_correct, multiquery_ar, power_law_probs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("N,K", [(64, 4), (64, 16), (128, 8), (256, 16)])
def test_layout_matches_definition(N, K):
    V = 512
    x, y = multiquery_ar(200, N, V, K, random_non_queries=False, seed=3)
    assert x.shape == y.shape == (200, N) and x.dtype == y.dtype == torch.int64
    ctx = 2 * K
    for i in range(200):
        keys, vals = x[i, 0:ctx:2], x[i, 1:ctx:2]
        assert ((keys >= 1) & (keys < V // 2)).all() and ((vals >= V // 2) & (vals < V)).all()
        assert len(set(keys.tolist())) == K and len(set(vals.tolist())) == K
        assert (y[i, :ctx] == -100).all()                         # no target inside the key-value pairs
        pos = (y[i] != -100).nonzero().flatten()
        assert len(pos) == K                                       # one target per pair
        assert ((pos - ctx) % 2 == 0).all() and (pos >= ctx).all()  # queries at 2K + 2 g
        pair = dict(zip(keys.tolist(), vals.tolist()))
        for p in pos.tolist():
            assert int(x[i, p]) in pair                            # a query repeats a key of the context ...
            assert int(y[i, p]) == pair[int(x[i, p])]              # ... and its label is that key's value
        assert sorted(x[i, pos].tolist()) == sorted(keys.tolist())  # every key is queried exactly once
        rest = torch.ones(N, dtype=torch.bool)
        rest[:ctx] = False
        rest[pos] = False
        assert (x[i, rest] == 0).all()                             # nothing else in the query region


def test_random_non_queries_fill_only_the_empty_slots():
    a, ya = multiquery_ar(50, 64, 512, 8, random_non_queries=False, seed=0)
    b, yb = multiquery_ar(50, 64, 512, 8, random_non_queries=True, seed=0)
    assert torch.equal(ya, yb)
    keep = a != 0
    assert torch.equal(a[keep], b[keep])                           # pairs and queries unchanged
    filled = b[~keep]
    assert filled.min() >= 0 and filled.max() < 512 and len(filled.unique()) > 100   # uniform over [0, V)


def test_gaps_follow_the_power_law():
    N, K, n = 128, 1, 20000
    _, y = multiquery_ar(n, N, 512, K, power_a=0.01, random_non_queries=False, seed=1)
    gaps = ((y != -100).nonzero()[:, 1] - 2 * K) // 2
    space = (N - 2 * K) // 2
    p = power_law_probs(space, 0.01)
    freq = np.bincount(gaps.numpy(), minlength=space) / n
    assert abs(freq[0] - p[0]) < 0.02 and abs(freq[:4].sum() - p[:4].sum()) < 0.02
    assert freq[0] > 5 * freq[space // 2]                          # heavily skewed to short gaps
    _, yu = multiquery_ar(n, N, 512, K, power_a=1.0, random_non_queries=False, seed=1)
    gu = ((yu != -100).nonzero()[:, 1] - 2 * K) // 2
    assert abs(gu.float().mean().item() - (space - 1) / 2) < 1.0   # a = 1: uniform gaps


def test_seeds_and_validation():
    a = multiquery_ar(4, 64, 512, 4, seed=0)
    b = multiquery_ar(4, 64, 512, 4, seed=0)
    c = multiquery_ar(4, 64, 512, 4, seed=1)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="even"):
        multiquery_ar(1, 63, 512, 4)
    with pytest.raises(ValueError, match="vocab_size.*data.long_context=true"):
        multiquery_ar(1, 64, 64, 4)
    # long_context lifts only that rule: keys, values and fillers keep the vocabulary's ranges
    inputs, labels = multiquery_ar(8, 128, 64, 4, seed=0, long_context=True)
    assert inputs.max() < 64 and inputs[:, 0:8:2].max() < 32 and labels[labels != -100].min() >= 32
    with pytest.raises(ValueError, match="4 \\* K"):
        multiquery_ar(1, 64, 512, 17)


def test_task_config_long_context_lifts_the_vocabulary_rule():
    """data.long_context=true lets N = 512 keep N = 256's vocabulary of 512 (configs/grid/mqar_n512.yaml)."""
    from hydra import compose, initialize_config_dir

    from tasks.language.mqar import MQARTask

    def datasets(*extra):
        with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
            cfg = compose("train", overrides=["task=mqar", "data.seq_len=512", "data.num_train=4", "data.num_test=4",
                                              *extra])
        return MQARTask(cfg).build_datasets()

    with pytest.raises(ValueError, match="data.long_context=true"):
        datasets()
    train, test = datasets("data.long_context=true")
    assert train.inputs.shape == (4, 512) and int(train.inputs.max()) < 512 and len(test) == 4


def test_block_size_rule():
    for n in (64, 128, 256, 512, 2048):
        c = auto_block_size(n)
        m = n // c
        assert n % c == 0 and m * m <= n and (c // 2) < n ** 0.5 <= c


def test_mixing_shares_reads_normalised_causal_rows():
    from mhla.mixing import MixingMatrix
    from tasks.language.mqar import mixing_shares

    model = torch.nn.ModuleDict({"a": MixingMatrix(4, init="uniform", causal=True),
                                 "b": MixingMatrix(4, init="uniform", causal=True, num_heads=2)})
    want = np.mean([1 / (i + 1) for i in range(1, 4)])  # uniform causal rows: 1/(i+1) on each visible block
    shares = mixing_shares(model)
    assert set(shares) == {"mix0_first", "mix0_diag", "mix1_first", "mix1_diag"}
    assert all(v == pytest.approx(want) for v in shares.values())
    with torch.no_grad():  # a row's scale cancels in MHLA's normaliser, so it does not change the shares
        model["a"].raw[2] *= 0.5
    assert mixing_shares(model)["mix0_first"] == pytest.approx(want)
    assert mixing_shares(torch.nn.Linear(2, 2)) == {}


def test_loss_and_accuracy_on_hand_logits():
    V = 6
    labels = torch.tensor([[-100, 4, -100, 5]])
    logits = torch.zeros(1, 4, V)
    logits[0, 1, 4] = 10.0   # right
    logits[0, 3, 2] = 10.0   # wrong
    loss, correct, count = mqar_loss_and_correct(logits, labels)
    assert count == 2 and int(correct) == 1
    expected = 0.5 * (torch.log(torch.exp(torch.tensor(10.0)) + 5) - 10 + torch.log(torch.exp(torch.tensor(10.0)) + 5))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_train_py_runs_mqar_for_each_attention(tmp_path):
    pytest.importorskip("models.lm")
    import os

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import train as train_py

    cfg_dir = os.path.join(ROOT, "configs")
    for attn in ("mhla", "linear", "softmax"):
        with initialize_config_dir(config_dir=cfg_dir, version_base="1.3"):
            cfg = compose("train", overrides=[
                "task=mqar", f"attn={attn}", "logger=none", "trainer.max_steps=2", "trainer.progress_bar=false",
                "data.num_train=64", "data.num_test=32", "data.batch_size=16", "data.seq_len=32",
                "data.num_kv_pairs=4"])
        OmegaConf.set_struct(cfg, False)
        metrics = train_py.run(cfg, str(tmp_path / attn))
        assert 0.0 <= metrics["acc"] <= 1.0 and np.isfinite(metrics["loss"])


def test_run_mqar_grid_writes_table_with_seeds_and_convergence_flag(tmp_path):
    """scripts/run_mqar.py: runs every (variant, cell, seed), writes mean ± std, flags unsolved cells."""
    from scripts.tables import mqar as run_mqar

    out = tmp_path / "grid"
    argv = ["--cells", "16x2", "--variants", "softmax", "mhla_clamp", "--seeds", "0", "1", "--epochs", "1",
            "--out", str(out), "--out-dir", str(tmp_path / "runs"), "--jobs", "2",
            "data.num_train=64", "data.num_test=32", "data.batch_size=32", "data.vocab_size=64"]
    assert run_mqar.main(argv) == 0
    data = json.loads((tmp_path / "grid.json").read_text())
    assert sorted((r["variant"], r["seed"]) for r in data["results"]) == [
        ("mhla_clamp", 0), ("mhla_clamp", 1), ("softmax", 0), ("softmax", 1)]
    assert all(r["curve"] and 0 <= r["acc"] <= 1 for r in data["results"])
    md = (tmp_path / "grid.md").read_text()
    assert "(n=2)" in md and "does not count" in md  # 2 steps cannot solve MQAR: the cell is flagged
    assert "attn.mixing_param=clamp" in md
    assert (tmp_path / "grid.png").stat().st_size > 1000 and (tmp_path / "grid_curves.png").stat().st_size > 1000
    # eval.py builds MQARTask (task.target of the stored config) and reproduces the run's final accuracy
    from tasks.common.evaluation import evaluate_checkpoint

    rec = next(r for r in data["results"] if (r["variant"], r["seed"]) == ("mhla_clamp", 0))
    again = evaluate_checkpoint(str(tmp_path / "runs" / "16x2" / "mhla_clamp_s0" / "checkpoints" / "last.pt"))
    assert again["acc"] == pytest.approx(rec["acc"], abs=1e-4) and "mix0_first" in again
    # --resume skips finished runs; --plot-only rewrites from the json
    assert run_mqar.main([*argv, "--resume"]) == 0
    assert len(json.loads((tmp_path / "grid.json").read_text())["results"]) == 4
    with pytest.raises(SystemExit):
        run_mqar.main(["--variants", "bogus", "--out", str(out)])


def test_run_mqar_keeps_stopped_runs_as_eval_curves(tmp_path):
    """A run stopped by a signal (train.py saves last.pt and logs the stop) is an ``interrupted`` record with its
    eval curve, not a failure; the table compares such runs at the eval steps they all reached."""
    import types

    from scripts.tables import mqar as run_mqar

    def fake_run(name, evals, stopped):
        d = tmp_path / name
        d.mkdir()
        lines = [{"step": s, "train/loss": 1.0 / s} for s, _ in evals] + [{"step": s, "eval/acc": a} for s, a in evals]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        (d / "train.log").write_text("step 100 ...\n" + ("SIGTERM received: stopped at step 700/3120\n" if stopped else ""))
        return str(d)

    base = {"seq_len": 256, "num_kv_pairs": 8, "seed": 0, "epochs": 10, "seconds": 1.0}
    lin = run_mqar.finish_record({**base, "variant": "linear_conv", "error": "failed (exit 143)"},
                                 fake_run("lin", [(312, 0.1), (624, 0.3)], stopped=True),
                                 interrupted=run_mqar.was_stopped(str(tmp_path / "lin")))
    assert lin["interrupted"] and "error" not in lin and lin["stopped_at"] == 700  # from train.log
    mh = run_mqar.finish_record({**base, "variant": "mhla_conv", "error": "failed (exit 143)"},
                                fake_run("mh", [(312, 0.2), (624, 0.5), (936, 0.6)], stopped=True),
                                interrupted=True)
    crashed = run_mqar.finish_record({**base, "variant": "softmax_conv", "error": "boom"},
                                     fake_run("sm", [(312, 0.9)], stopped=False), interrupted=False)
    assert "error" in crashed and not crashed.get("interrupted")
    table = run_mqar.matched_steps_table([lin, mh], ["linear_conv", "mhla_conv"], 256, 8)
    assert table[2:] == ["| 312 | 10.0 | 20.0 |", "| 624 | 30.0 | 50.0 |"]  # 936: not reached by every run
    args = types.SimpleNamespace(variants=["linear_conv", "mhla_conv"], title="t", argv=[], extra=[], jobs=1,
                                 threads=1, notes="")
    run_mqar.write_outputs([lin, mh], args, str(tmp_path / "grid"))
    md = (tmp_path / "grid.md").read_text()
    assert "stopped at step 700" in md and "| 624 | 30.0 | 50.0 |" in md
    sm = run_mqar.finish_record({**base, "variant": "softmax_conv", "error": "failed (exit 143)"},
                                fake_run("sm_stopped", [(312, 0.995), (624, 1.0)], stopped=True), interrupted=True)
    args.variants = ["softmax_conv", "linear_conv", "mhla_conv"]
    run_mqar.write_outputs([sm, lin, mh], args, str(tmp_path / "grid"))
    md = (tmp_path / "grid.md").read_text()
    assert "softmax_conv: yes (stopped; last eval at step 624)" in md  # a stopped softmax run at 100% solved it


def test_run_mqar_resume_on_a_subset_keeps_other_records(tmp_path, monkeypatch):
    """``--resume`` with a narrower grid reruns only the failed or stopped runs *of that grid*: a stopped run of
    another seed stays in ``<out>.json`` as it was (it once dropped every interrupted record)."""
    from scripts.tables import mqar as run_mqar

    def rec(variant, seed, **kw):
        return {"variant": variant, "seq_len": 256, "num_kv_pairs": 8, "seed": seed, "epochs": 10,
                "seconds": 1.0, "curve": [[1, 1.0]], **kw}

    old = [rec("softmax_conv", 0, interrupted=True, stopped_at=2238, eval_curve=[[2184, 1.0]]),
           rec("linear_conv", 0, acc=0.73), rec("linear_conv", 1, error="boom")]
    stem = tmp_path / "grid"
    stem.with_suffix(".json").write_text(json.dumps({"results": old}))
    ran = []

    def fake_parallel(fn, todo, jobs, desc, on_done):
        for item in todo:
            ran.append(item)
            on_done(item, rec(item[0], item[3], acc=0.5))

    monkeypatch.setattr(run_mqar, "run_parallel", fake_parallel)
    assert run_mqar.main(["--cells", "256x8", "--variants", "softmax_conv", "linear_conv", "--seeds", "1",
                          "--resume", "--out", str(stem), "--out-dir", str(tmp_path / "runs")]) == 0
    assert sorted(ran) == [("linear_conv", 256, 8, 1), ("softmax_conv", 256, 8, 1)]
    kept = json.loads(stem.with_suffix(".json").read_text())["results"]
    keys = sorted((r["variant"], r["seed"], "acc" in r, bool(r.get("interrupted"))) for r in kept)
    assert keys == [("linear_conv", 0, True, False), ("linear_conv", 1, True, False),
                    ("softmax_conv", 0, False, True), ("softmax_conv", 1, True, False)]


def test_recall_by_distance_buckets_every_query_once():
    """recall_by_distance on a tiny untrained MQAR model past its context (vocab 64 < 256 tokens: long_context):
    every query lands in one distance bucket, and the distances are those of the generated examples."""
    from models.lm import MHLALMConfig, MHLALMForCausalLM
    from tasks.language.mqar import recall_by_distance

    torch.manual_seed(0)
    model = MHLALMForCausalLM(MHLALMConfig(attn={"name": "mhla", "block_size": 8}, vocab_size=64, hidden_size=16,
                                           num_hidden_layers=1, num_heads=2, max_position_embeddings=32)).eval()
    out = recall_by_distance(model, 256, vocab_size=64, num_kv_pairs=4, num_examples=6, edges=(0, 64, 128, 256))
    assert out["n"] == 6 * 4 and sum(b["n"] for b in out["buckets"]) == out["n"]
    assert all(0 <= b["acc"] <= 1 for b in out["buckets"]) and out["buckets"][-1]["hi"] == 256
    with pytest.raises(ValueError, match="long_context"):
        multiquery_ar(2, 256, 64, 4)


# The recorded conditions of the committed MQAR results: file -> (lr, short conv) every record trained with.
RECORDED = {"results/mqar/no_conv.json": (3e-3, 0), "results/mqar/lr1e-3.json": (1e-3, 0),
            "results/mqar.json": (3e-3, 4)}


@pytest.mark.parametrize("path", sorted(RECORDED))
def test_recorded_mqar_commands_train_the_recorded_model_today(path):
    """Each record's ``command``, composed with today's configs, trains the model the record is about: its lr,
    its short conv, and its variant's mixing settings (the runs predate today's defaults; the command that ran is
    ``command_as_run``, and the file's ``note_commands`` says why they differ)."""
    import shlex

    from hydra import compose, initialize_config_dir

    from scripts.tables.mqar import VARIANTS
    from tasks.common.config import model_attention

    with open(os.path.join(ROOT, path)) as f:
        saved = json.load(f)
    lr, conv = RECORDED[path]
    assert "note_commands" in saved
    by_variant = {r["variant"]: r for r in saved["results"]}  # one command per variant (seeds differ by seed)
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        for variant, rec in by_variant.items():
            words = shlex.split(rec["command"])
            assert words[:2] == ["python", "train.py"] and "command_as_run" in rec
            cfg = compose(config_name="train", overrides=[w for w in words[2:] if not w.startswith("hydra.")])
            attn = model_attention(cfg)
            assert float(cfg.optim.lr) == lr and attn.get("short_conv", 0) == conv, (variant, rec["command"])
            want = dict(w.split("=", 1) for w in VARIANTS[variant] if w.startswith(("attn.", "optim.")))
            for key, value in want.items():
                group, name = key.split(".", 1)
                got = attn[name] if group == "attn" else cfg.optim[name]
                assert str(got).lower() == value.lower() or float(got) == float(value), (variant, key, got)
            if attn["name"] == "mhla" and not {"attn.mixing_param", "optim.mixing_lr_scale"} & set(want):
                # the task's rule
                assert attn["mixing_param"] == "clamp" and float(cfg.optim.mixing_lr_scale) == 0.01


def test_pairs_offset_moves_the_pairs_and_keeps_the_default():
    """``pairs_offset`` puts filler tokens before the pairs (the block-alignment control); 0 is Zoology's layout,
    the same examples as without the option."""
    N, K, off = 128, 4, 8
    assert all(torch.equal(a, b) for a, b in zip(multiquery_ar(16, N, 512, K, seed=5),
                                                    multiquery_ar(16, N, 512, K, seed=5, pairs_offset=0)))
    x, y = multiquery_ar(64, N, 512, K, seed=5, pairs_offset=off)
    keys, values = x[:, off:off + 2 * K:2], x[:, off + 1:off + 2 * K:2]
    assert (keys >= 1).all() and (keys < 256).all() and (values >= 256).all()
    qrow, qpos = (y != -100).nonzero(as_tuple=True)
    assert (qpos >= off + 2 * K).all() and ((qpos - off) % 2 == 0).all()
    for r, p in zip(qrow.tolist(), qpos.tolist()):     # every query asks a key of its example for that key's value
        j = (keys[r] == x[r, p]).nonzero().item()
        assert y[r, p] == values[r, j]
    assert (y[:, :off + 2 * K] == -100).all()
    with pytest.raises(ValueError, match="4 \\* K \\+ offset"):
        multiquery_ar(1, 64, 512, 8, pairs_offset=34)
