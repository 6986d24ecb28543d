"""Smoke test of scripts/length_extrapolation.py: the extension rules and the per-position evaluation."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers.lm_configs import lm_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    from scripts import length_extrapolation  # noqa: PLC0415

    return length_extrapolation


def test_extension_rules_and_per_position_loss(tmp_path):
    le = _script()
    from mhla.mixing import EXTENSION_RULES, MixingMatrix, extend_causal_mixing
    from models.lm.configuration_mhla_lm import MHLALMConfig
    from models.lm.modeling_mhla_lm import MHLALMForCausalLM

    torch.manual_seed(0)
    M, n = 4, 9
    mix = MixingMatrix(M, init="uniform", causal=True)
    with torch.no_grad():
        mix.raw.uniform_(0.1, 0.9)
    L = mix.learned().detach()
    # uniform_far: identical to the library default; every rule keeps the learned corner and causality
    assert torch.allclose(extend_causal_mixing(L, n, "uniform_far"), mix(n).detach())
    for rule in EXTENSION_RULES:
        W = extend_causal_mixing(L, n, rule)
        assert W.shape == (n, n) and torch.equal(W.triu(1), torch.zeros(n, n))
        assert torch.allclose(W[:M, :M], L)
        with le.extension_rule(mix, rule):
            assert torch.allclose(mix(n).detach(), W)
    assert mix.extension == "uniform_far"  # restored after each rule
    assert torch.allclose(mix(n).detach(), extend_causal_mixing(L, n, "uniform_far"))
    i = n - 1
    far = slice(0, i - (M - 1))
    assert torch.all(extend_causal_mixing(L, n, "window")[i, far] == 0)
    assert torch.isclose(extend_causal_mixing(L, n, "uniform_far")[i, far].sum(), L[M - 1, 0])
    assert torch.allclose(extend_causal_mixing(L, n, "last_row")[i, :M], L[M - 1])
    assert torch.isclose(extend_causal_mixing(L, n, "mass_matched")[i].sum(), L[M - 1].sum())
    with pytest.raises(ValueError):
        extend_causal_mixing(L, n, "nope")

    # per-position loss on a tiny MHLA LM, under a rule, past the learned size
    cfg = lm_config("mhla", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2,
                       block_size=4, max_position_embeddings=16)
    model = MHLALMForCausalLM(cfg).eval()
    tokens = np.random.default_rng(0).integers(0, 64, size=200).astype(np.uint16)
    with le.extension_rule(model, "relative"):
        loss, n_win = le.per_position_loss(model, tokens, 48, tokens_per_batch=96)
    assert loss.shape == (47,) and n_win == 4 and np.isfinite(loss).all()
    b = le.bucket_ppl(loss, edges=(0, 16, 48))
    assert set(b) == {"0-16", "16-48"} and all(v > 1 for v in b.values())

    # the report: markdown tables and the plot from a results dict
    curve = {str(Lw): {"windows": 1, "ppl": 2.0, "buckets": le.bucket_ppl(np.full(Lw - 1, 0.5)),
                       "loss": [0.5] * (Lw - 1)} for Lw in (256, 2048)}
    res = {"runs": {"m": {"attn": "mhla", "train_seq_len": 256, "block_size": 32, "checkpoint": "x",
                          "val_tokens": 10}}, "curves": {"m/relative": curve, "m/window": curve}, "mixing": {}}
    md = le.markdown(res, "cmd", {"host": "h"}, "reading")
    assert "| m/window | 1.6 | 1.6 | 1.6 | 1.6 |" in md and "L = 2048" in md and md.rstrip().endswith("reading")
    le.write_plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_lm_config_carries_the_extension_rule():
    from mhla.mixing import MixingMatrix
    from models.lm.configuration_mhla_lm import MHLALMConfig
    from models.lm.modeling_mhla_lm import MHLALMForCausalLM

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, max_position_embeddings=16)
    cfg = MHLALMConfig(attn={"name": "mhla", "block_size": 4, "mixing_extension": "window"}, **small)
    rules = {m.extension for m in MHLALMForCausalLM(cfg).modules() if isinstance(m, MixingMatrix)}
    assert rules == {"window"}
    assert MHLALMConfig.from_dict(cfg.to_dict()).attn["mixing_extension"] == "window"  # saved and loaded
    assert MHLALMConfig(attn="mhla", **small).attn["mixing_extension"] == "uniform_far"  # the default
    with pytest.raises(ValueError, match="extension"):
        MHLALMForCausalLM(MHLALMConfig(attn={"name": "mhla", "mixing_extension": "nope"}, **small))


def test_train_commands_skip_trained_models(tmp_path):
    le = _script()
    (tmp_path / "linear" / "checkpoints").mkdir(parents=True)
    (tmp_path / "linear" / "checkpoints" / "last.pt").write_bytes(b"x")
    cmds = le.train_commands(str(tmp_path), seed=3)
    # linear has a checkpoint: not retrained; the others of the registry's list are (mhla/registry.py benchmarked)
    assert set(cmds) == set(le.TRAIN_ATTNS) - {"linear"} and {"mhla", "softmax"} <= set(cmds)
    cmd = cmds["mhla"]
    assert cmd[1].endswith("train.py") and "task=lm_mini" in cmd and "attn=mhla" in cmd and "seed=3" in cmd
    assert "data.seq_len=256" in cmd and f"hydra.run.dir={tmp_path / 'mhla'}" in cmd
    with pytest.raises(SystemExit):
        le.main([])  # neither runs nor --train


def test_plot_reads_compact_curves(tmp_path):
    le = _script()
    loss = np.linspace(5.0, 6.0, 255)
    full = {"windows": 1, "ppl": 2.0, "buckets": le.bucket_ppl(loss), "loss": loss.tolist()}
    compact = {**{k: v for k, v in full.items() if k != "loss"},
               "loss_per_32_positions": [float(loss[a:a + 32].mean()) for a in range(0, 255, 32)]}
    got = le.position_losses(compact, 256)
    assert got.shape == (255,) and np.allclose(got[:224].reshape(7, 32).mean(1), loss[:224].reshape(7, 32).mean(1))
    assert np.array_equal(le.position_losses(full, 256), loss)
    res = {"runs": {"m": {"attn": "mhla", "train_seq_len": 256, "block_size": 32, "checkpoint": "x", "val_tokens": 10}},
           "curves": {"m/uniform_far": {"256": compact}}, "mixing": {}}
    le.write_plot(res, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 0


def test_merge_keeps_each_parts_conditions_and_marks_a_busy_one(tmp_path):
    """--merge: the record lists every part with its command and measurement (commit, load), and is marked BUSY
    when any part ran on a busy machine (its perplexities stand; its seconds are not an idle machine's)."""
    import json

    le = _script()
    curve = {"256": {"windows": 1, "ppl": 2.0, "buckets": {"0-256": 2.0}, "loss_per_32_positions": [0.7] * 8}}
    parts = []
    for i, busy in enumerate((False, True)):
        part = {"runs": {f"m{i}": {"attn": "linear", "train_seq_len": 256, "block_size": 32, "checkpoint": "x",
                                   "val_tokens": 10, "commit": "abc", "dirty": False}},
                "curves": {f"m{i}": curve}, "mixing": {}, "seconds": 1.0, "command": f"part {i}",
                "measurement": {"commit": "abc", "dirty": False, "load_before": [0.1 + busy, 0, 0], "busy": busy,
                                "cpu_count": 2, "threads": 1}}
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    out = tmp_path / "merged"
    assert le.main(["--merge", *map(str, parts), "--out", str(out)]) == 0
    rec = json.loads((tmp_path / "merged.json").read_text())
    assert set(rec["runs"]) == {"m0", "m1"} and [p["command"] for p in rec["parts"]] == ["part 0", "part 1"]
    assert [p["measurement"]["busy"] for p in rec["parts"]] == [False, True]
    assert rec["measurement"]["busy"] is True and rec["measurement"]["commit"] == "abc"
    assert "BUSY" in (md := (tmp_path / "merged.md").read_text()) and "do not depend on the load" in md


def test_seed_groups_join_a_variants_seeds_per_rule():
    le = _script()
    keys = ["mhla_state_s0/uniform_far", "mhla_state_s1/uniform_far", "mhla_state_s0/relative", "linear_s2",
            "linear_s10", "mhla"]
    assert le.seed_groups(keys) == {"mhla_state/uniform_far": keys[:2], "mhla_state/relative": [keys[2]],
                                    "linear": keys[3:5], "mhla": ["mhla"]}
