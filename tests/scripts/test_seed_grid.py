"""scripts.tables.seed_grid: finished runs over seeds -> means, paired differences with a t interval, verdicts."""

import json
import os

import pytest

from scripts.tables import seed_grid


def fake_run(root, name, acc, steps=100, mix=None, record=True):
    d = os.path.join(root, name)
    os.makedirs(d)
    metrics = {"acc": acc, "steps": steps, **(mix or {})}
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 50, "eval/acc": acc / 2, **{f"eval/{k}": 0.159 for k in (mix or {})}}) + "\n")
        f.write(json.dumps({"step": steps, "eval/acc": acc}) + "\n")
    if record:
        with open(os.path.join(d, "run.json"), "w") as f:
            json.dump({"command": "python train.py x", "commit": "abc", "metrics": metrics,
                       "config": {"attn": {"name": "mhla" if "mhla" in name else "linear", "mixing_init": "uniform",
                                           "mixing_learnable": True, "short_conv": 4},
                                  "optim": {"mixing_lr_scale": 1.0}}}, f)


def test_paired_differences_verdicts_and_records(tmp_path):
    root = str(tmp_path / "runs")
    for s, (a, b) in enumerate([(0.90, 0.50), (0.92, 0.55), (0.88, 0.52)]):
        fake_run(root, f"mhla_s{s}", a, mix={"mix1_first": 0.3 + s / 100})
        fake_run(root, f"linear_s{s}", b)
    fake_run(root, "linear_s3", 0.6, record=False)  # unfinished: no run.json
    out = str(tmp_path / "res" / "cell")
    assert seed_grid.main([root, "--baseline", "linear", "--out", out, "--title", "T", "--notes", "Reads 90.0."]) == 0
    rec = json.load(open(out + ".json"))
    mh = rec["variants"]["mhla"]
    assert mh["n"] == 3 and mh["mean"] == pytest.approx(90.0)
    assert rec["variants"]["linear"]["unfinished"] == [3]
    (pair,) = rec["pairs"]
    assert (pair["a"], pair["b"]) == ("mhla", "linear")
    assert pair["mean"] == pytest.approx(((0.40 + 0.37 + 0.36) / 3) * 100)
    assert pair["excludes_zero"] and pair["verdict"] == "holds"
    md = open(out + ".md").read()
    assert "| mhla - linear | 3 | 37.7 |" in md and "holds" in md
    assert mh["last_gain"]["mean"] == pytest.approx(45.0) and mh["last_gain"]["over_steps"] == [50]
    assert "45.00 over 50 steps (s0: 45.00, s1: 46.00, s2: 44.00)" in md  # still learning at the end
    assert "0.159 -> 0.310" in md  # mixing profile: first eval -> end, mean over seeds
    assert md.split("## Reading")[1].strip() == "Reads 90.0." and rec["notes"] == "Reads 90.0."
    assert rec["runs"]["mhla_s0"]["record"]["commit"] == "abc" and os.path.exists(out + ".png")


def test_overlapping_seeds_are_level(tmp_path):
    root = str(tmp_path / "runs")
    for s, (a, b) in enumerate([(0.90, 0.50), (0.40, 0.85), (0.70, 0.60)]):
        fake_run(root, f"mhla_s{s}", a)
        fake_run(root, f"linear_s{s}", b)
    out = str(tmp_path / "cell")
    seed_grid.main([root, "--baseline", "linear", "--out", out])
    (pair,) = json.load(open(out + ".json"))["pairs"]
    assert pair["verdict"] == "level" and not pair["excludes_zero"]


def test_a_baseline_ahead_is_reversed_not_level(tmp_path):
    """When b beats a by more than two pooled standard deviations the table says so ("reversed"); the one-sided
    rule printed "level" there, which hid a baseline beating MHLA."""
    root = str(tmp_path / "runs")
    for s, (a, b) in enumerate([(0.9911, 0.9921), (0.9905, 0.9924), (0.9912, 0.9918)]):
        fake_run(root, f"mhla_s{s}", a)
        fake_run(root, f"softmax_s{s}", b)
    out = str(tmp_path / "cell")
    seed_grid.main([root, "--baseline", "softmax", "--out", out, "--digits", "2"])
    (pair,) = json.load(open(out + ".json"))["pairs"]
    assert pair["verdict"] == "reversed" and not pair["excludes_zero"]  # the rule, not the paired interval
    assert pair["gap_of_means"] == pytest.approx(-0.1167, abs=1e-3) and 2 * pair["pooled_std"] < 0.1167
    assert "| mhla - softmax | 3 | -0.12 |" in open(out + ".md").read()


def test_lower_is_better_turns_the_verdict_the_best_step_and_the_convergence(tmp_path):
    """A perplexity: the variant with the lower values is the better one (its ordering holds), its best evaluation
    is its lowest, and a fall at the last evaluation is a gain (still gaining); without the flag the same runs
    read the other way round."""
    root = str(tmp_path / "runs")
    for s, (a, b) in enumerate([(300.0, 360.0), (305.0, 362.0), (298.0, 359.0)]):
        fake_run(root, f"mhla_s{s}", a)  # eval curve 150 -> 300: rising, i.e. getting worse
        fake_run(root, f"linear_s{s}", b)
    lower, higher = str(tmp_path / "lower"), str(tmp_path / "higher")
    seed_grid.main([root, "--metric", "acc", "--scale", "1", "--baseline", "linear", "--out", lower,
                    "--lower-is-better"])
    seed_grid.main([root, "--metric", "acc", "--scale", "1", "--baseline", "linear", "--out", higher])
    rec_low, rec_high = json.load(open(lower + ".json")), json.load(open(higher + ".json"))
    assert rec_low["lower_is_better"] is True and "lower_is_better" not in rec_high
    assert rec_low["pairs"][0]["verdict"] == "holds" and rec_high["pairs"][0]["verdict"] == "reversed"
    assert rec_low["pairs"][0]["mean"] == pytest.approx(rec_high["pairs"][0]["mean"])  # same numbers, other verdict
    assert rec_low["variants"]["mhla"]["best_step"] == {"0": 50, "1": 50, "2": 50}
    assert rec_high["variants"]["mhla"]["best_step"] == {"0": 100, "1": 100, "2": 100}
    assert rec_low["variants"]["mhla"]["convergence"] == "converged"  # it got worse at the end: no gain left
    assert rec_high["variants"]["mhla"]["convergence"] == "still gaining"
    md = open(lower + ".md").read()
    assert "; lower is better." in md and "a < b *holds*" in md
    assert "lower is better" not in open(higher + ".md").read()


def test_last_gain_needs_two_evaluations():
    assert seed_grid.last_gain({"curve": [(312, 0.2), (624, 0.5), (936, 0.55)]}) == pytest.approx((0.05, 312))
    assert seed_grid.last_gain({"curve": [(312, 0.2)]}) is None


def test_steps_fall_back_to_the_last_evaluation():
    run = {"metrics": {"acc": 0.9}, "curve": [(312, 0.2), (3120, 0.9)]}
    assert seed_grid.steps_of(run) == 3120
    assert seed_grid.steps_of({"metrics": {"steps": 7}, "curve": []}) == 7
    assert seed_grid.steps_of({"metrics": {}, "curve": []}) is None


def test_uniform_reference_and_block_size_follow_each_runs_m():
    """The mixing note's uniform reference is computed per block count (the N = 256 table's 0.159 at M = 16), and
    the attention column tells two block sizes apart."""
    assert seed_grid.uniform_share(16) == pytest.approx(0.1587, abs=1e-4)
    assert seed_grid.uniform_share(8) == pytest.approx(sum(1 / (i + 1) for i in range(1, 8)) / 7)
    record = {"config": {"data": {"seq_len": 256}},
              "attention": {"name": "mhla", "block_size": 32, "mixing_init": "uniform", "mixing_learnable": False}}
    assert seed_grid.num_blocks_of(record) == 8
    assert "block 32" in seed_grid.describe(record)
    assert seed_grid.uniform_shares([{"num_blocks": 16}, {"num_blocks": 8}, {"num_blocks": None}]) == \
        "0.245 at M = 8, 0.159 at M = 16"


def described(name="mhla", **options) -> str:
    """The attention column of a run with block size 32, started at 1, learnable, and ``options``."""
    return seed_grid.describe({"config": {"optim": {"mixing_lr_scale": 1.0}},
                               "attention": {"name": name, "block_size": 32, "mixing_init": "ones",
                                             "mixing_learnable": True, **options}})


def test_the_attention_column_names_a_clamp_bound_other_than_1():
    """Two rows that differ only in ``attn.mixing_max`` are told apart; the paper's bound of 1 (or a record from
    before the option) is not named."""
    assert described(mixing_max=16.0) == "mhla, block 32, init=ones, learnable, max 16.0, mixing lr x 1.0"
    assert described(mixing_max=1.0) == described() == "mhla, block 32, init=ones, learnable, mixing lr x 1.0"


def test_the_attention_column_names_a_far_rule_other_than_the_default():
    """A variant trained under ``relative`` is told apart from the same attention under the default ``uniform_far``
    (or a record from before the option)."""
    assert described(mixing_extension="relative") == (
        "mhla, block 32, init=ones, learnable, mixing lr x 1.0, rule relative")
    assert described(mixing_extension="uniform_far") == described() == (
        "mhla, block 32, init=ones, learnable, mixing lr x 1.0")


def test_the_attention_column_names_a_write_gate():
    """A variant with a write gate (``attn.write_gate``) is told apart from the same attention without one."""
    assert described(write_gate="relu") == "mhla, block 32, init=ones, learnable, mixing lr x 1.0, write gate relu"
    assert described(write_gate=None) == described()
    assert described(write_gate="relu", write_gate_penalty=0.01).endswith("write gate relu (budget 0.01)")
    assert described(write_gate="relu", write_gate_penalty=0.01, write_gate_input="short_conv").endswith(
        "write gate relu on the short conv (budget 0.01)")
    assert described("linear", write_gate="sigmoid") == "linear, write gate sigmoid"


def test_one_seed_shows_no_spread(tmp_path):
    """A variant with one finished seed has no standard deviation to show: "(one seed)", not "± 0.00"."""
    root = str(tmp_path / "runs")
    fake_run(root, "mhla_s0", 0.9899)
    for s in range(2):
        fake_run(root, f"linear_s{s}", 0.99 + s / 1000)
    out = str(tmp_path / "cell")
    seed_grid.main([root, "--baseline", "linear", "--out", out, "--digits", "2"])
    md = open(out + ".md").read()
    assert "| 98.99 (one seed) |" in md and "± 0.00 |" not in md and "99.05 ± 0.07" in md
