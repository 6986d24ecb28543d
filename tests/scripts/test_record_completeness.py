"""Every committed result carries what it was made under, or is named here as legacy with the reason.

A results file (``results/**/*.json``) is complete when it holds, for its runs: the resolved config of each
(``config``; a benchmark's ``measurement`` stands for it: what it times is its command), the effective attention
block beside each config that has an ``attn`` (``attention``: every option the model ran with, written by the
trainer since 31d41c7), the code's ``commit``, the clean-tree flag (``dirty``, false everywhere), the ``machine``
(a machine block, or a measurement's cpu count) and the load (``load_before``). A table under ``results/`` with
no .json beside it has no record at all. The seed grids' ``<out>_runs/<run>/run.json`` are not listed apart:
their table's .json holds every one of them (tests/scripts/test_tables_rebuild.py rebuilds it from them).

:data:`LEGACY` lists each incomplete file with exactly what it lacks and why; the test fails on a new incomplete
file, on a listed file that lacks something more (or less: a file that was completed is taken off the list).
The way off the list is a re-run, or the record completed from its runs.
"""

from __future__ import annotations

import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NO_JSON = "no JSON record"
CONFIG, COMMIT, CLEAN, MACHINE, LOAD = ("no per-run resolved config", "no commit", "no clean-tree flag",
                                       "no machine", "no load")
NOTHING = [CONFIG, COMMIT, CLEAN, MACHINE, LOAD]

# the reasons, shared by several files
BEFORE_RECORDS = ("made before the run record (resolved config, commit, clean-tree flag, load) existed; the "
                  "commands are in the file")
BEFORE_ATTENTION = ("trained before run.json stored the effective attention (31d41c7); the table labels these runs "
                    "from their stored config resolved today (tasks.common.records.effective_attention)")
ANALYSIS = ("an analysis of trained checkpoints: each entry's config is the checkpoint's own, and the analysis "
            "script stores no attention block")

# a worktree whose only changes were the seed table that run_seed_grid rewrites under results/ after each run
RESULTS_ONLY_DIRT = ("models trained or evaluated in a worktree of the commit their records name, after an earlier run "
                     "of the same queue had rewritten the seed table under results/ (no code); code_version no longer "
                     "counts results/ as dirt")

# committed results file -> (what it lacks, why)
LEGACY = {
    "results/analysis/attention_rank_entropy.json": (NOTHING, "a computation on synthetic Gaussian inputs, no run"),
    "results/analysis/trained_rank_entropy.json": ([CONFIG, COMMIT, CLEAN, LOAD], "Fig. 3 on the table2_mini "
                                                   "checkpoints, written before the analysis recorded its commit"),
    "results/auto_m.json": (["2 from a dirty tree", "9 of 9 runs without the effective attention"],
                            "two of its records made at 693749a with uncommitted changes; its runs "
                            + BEFORE_ATTENTION),
    "results/bench/kernel_resources.json": (NOTHING, "a static compile table (registers, spills and shared memory "
                                            "of each kernel variant from ptxas), no run: "
                                            "tests/ops/test_kernel_resources.py checks it against today's compile"),
    "results/classification/table2_converged.json": (
        ["3 from a dirty tree", "7 of 21 runs without the effective attention"],
        "linear_s1, mhla_s2 and softmax_s1 trained at 34bab0c with uncommitted changes; the 5-epoch runs and "
        "softmax_s0 (3afa967) " + BEFORE_ATTENTION),
    "results/classification/table2_converged_mixing.json": (
        ["1 from a dirty tree", "7 of 7 runs without the effective attention"],
        ANALYSIS + "; run at b7df305 with uncommitted changes"),
    "results/classification/table2_converged_predictions.json": (
        ["1 from a dirty tree", "4 of 4 runs without the effective attention"],
        ANALYSIS + "; run at b1f46aa with uncommitted changes"),
    "results/classification/table2_converged_trainfit.json": (["11 of 11 runs without the effective attention"],
                                                              ANALYSIS),
    "results/classification/table2_mini_1200steps.json": (NOTHING, BEFORE_RECORDS),
    "results/classification/table2_mini_mhla_mixing_lr0.01.json": (NOTHING, BEFORE_RECORDS),
    "results/classification/mnist_default.md": ([NO_JSON], "one run of the embedded default, written by hand"),
    "results/classification/table2_mini_inline_probe.md": ([NO_JSON], "a one-seed check written by hand"),
    "results/classification/table2_mini_mhla_rala_wrapper.md": ([NO_JSON], "a check written by hand"),
    "results/conversion/lm_mini.json": (["14 of 14 runs without the effective attention"], BEFORE_ATTENTION),
    "results/conversion/mnist.json": (["14 of 14 runs without the effective attention"], BEFORE_ATTENTION),
    "results/language/long_context_mixed_4k_nope_wgcl1_1m.json": (
        ["5 from a dirty tree"],
        "seeds 0, 1, 2 and 4 (and the record's own measurement, seed 0's) evaluated (14afa35, e197a61) in worktrees "
        "whose only changes were the seed table that run_seed_grid had rewritten under results/ (no code); seed 3 "
        "re-evaluated from a clean tree gave the same accuracy at every depth and length, as did the clean reruns "
        "of every seed at 256-16,384 tokens"),
    "results/language/long_context_mixed_4k_nope_wgcsigl1_1m.json": (["2 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/long_context_mixed_4k_nope_relwgcl1_1m.json": (
        ["7 from a dirty tree"], RESULTS_ONLY_DIRT + "; the evaluations too, in the same worktree"),
    "results/language/long_context_mixed_4k_nope_relwgcl1_far_1m.json": (["3 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/long_context_mixed_4k_nope_relwgcl1_nonum_1m.json": (["3 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/write_gate_stats_controls.json": (["3 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/long_context_mixed_4k_nope_wghcl1.json": (["4 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/long_context_mixed_4k_nope_wghcl1_1m.json": (["6 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/long_context_mixed_4k_nope_wghcl1_train_len.json": (["4 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/write_gate_stats_wghcl1.json": (["2 from a dirty tree"], RESULTS_ONLY_DIRT),
    "results/language/long_context_state_mixed_4k_nope_retrain_seeds.json": (["9 from a dirty tree"],
                                                                              RESULTS_ONLY_DIRT),
    "results/language/length_extrapolation.json": ([CONFIG, COMMIT, CLEAN, LOAD],
                                                   "an evaluation of LM checkpoints written before the evaluator "
                                                   "recorded its commit and load"),
    "results/language/length_extrapolation_mixing_lr1.json": ([CONFIG, COMMIT, CLEAN, LOAD], "as length_extrapolation"),
    "results/language/length_extrapolation_seed1.json": ([CONFIG, COMMIT, CLEAN, LOAD], "as length_extrapolation"),
    "results/language/length_extrapolation_seed2.json": ([CONFIG, COMMIT, CLEAN, LOAD], "as length_extrapolation"),
    "results/language/lm_mini.md": ([NO_JSON], "one run of task=lm_mini, written by hand"),
    "results/language/mixing_lr.json": (NOTHING, BEFORE_RECORDS),
    "results/mqar.json": ([CONFIG, COMMIT, CLEAN, LOAD], BEFORE_RECORDS),
    "results/mqar/extrapolation_n256.json": ([CONFIG], "an evaluation of the N = 256 grid's checkpoints: their "
                                             "configs are the grid's run records (seeds_n256.json)"),
    "results/mqar/extrapolation_n512.json": ([CONFIG, "2 from a dirty tree"],
                                             "an evaluation of the N = 512 grid's checkpoints (configs: "
                                             "seeds_n512.json); two of its three additions ran with uncommitted "
                                             "changes (9a3ebe3, 120a3a8)"),
    "results/mqar/lr1e-3.json": ([CONFIG, COMMIT, CLEAN, LOAD], BEFORE_RECORDS),
    "results/mqar/no_conv.json": ([CONFIG, COMMIT, CLEAN, LOAD], BEFORE_RECORDS),
    "results/mqar/seeds_n256.json": (["22 of 36 runs without the effective attention"],
                                     "the five-seed rows of mhla_lm, linear, frozen_loc, frozen_unif and the two "
                                     "softmax seeds (4014e62) " + BEFORE_ATTENTION),
    "results/mqar_mini.json": (NOTHING, BEFORE_RECORDS),
    "results/params.json": ([CONFIG, COMMIT, CLEAN, LOAD], "parameter counts of the composed configs (no training, "
                                                          "no timing), written before it recorded its commit"),
    "results/table11_mini.json": ([CONFIG, COMMIT, CLEAN, LOAD], BEFORE_RECORDS),
    "results/table2_mini.json": ([CONFIG, COMMIT, CLEAN, LOAD], BEFORE_RECORDS),
    "results/table3_mini.json": ([CONFIG, COMMIT, CLEAN, LOAD], BEFORE_RECORDS + " (the machine is the runs', kept "
                                                                               "when the table was rewritten)"),
    "results/table5_mini.json": (["24 of 24 runs without the effective attention"],
                                 "trained at 34bab0c, after 31d41c7, but tasks.common.launch.run_training copies "
                                 "each run's commit, dirty, machine, load and config from its run.json, not its "
                                 "attention block"),
    "results/table6.json": (NOTHING, "the paper's numbers only: no model of ours is trained"),
    "results/table8.json": (NOTHING, "the paper's numbers only: no model of ours is trained"),
    "results/video/cross_mini.json": (["9 of 9 runs without the effective attention"], BEFORE_ATTENTION),
    "results/video/levers.json": (NOTHING, BEFORE_RECORDS),
    "results/video/seeds.json": (NOTHING, BEFORE_RECORDS),
}


def _dicts(x):
    """Every dict inside a JSON value, itself first."""
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _dicts(v)
    elif isinstance(x, list):
        for v in x:
            yield from _dicts(v)


def record_gaps(data) -> list[str]:
    """What a results file (its parsed JSON) lacks of the module docstring's list, in that order."""
    dicts = list(_dicts(data))
    keys = {k for d in dicts for k in d}
    runs = [d for d in dicts if isinstance(d.get("config"), dict)]
    gaps = []
    if not runs and "measurement" not in keys:
        gaps.append(CONFIG)
    if "commit" not in keys:
        gaps.append(COMMIT)
    if "dirty" not in keys:
        gaps.append(CLEAN)
    dirty = sum(d.get("dirty") is True for d in dicts)
    if dirty:
        gaps.append(f"{dirty} from a dirty tree")
    if not keys & {"machine", "cpu_count"}:
        gaps.append(MACHINE)
    if "load_before" not in keys:
        gaps.append(LOAD)
    with_attn = [d for d in runs if isinstance(d["config"].get("attn"), dict)]
    without = sum("attention" not in d for d in with_attn)
    if without:
        gaps.append(f"{without} of {len(with_attn)} runs without the effective attention")
    return gaps


def committed_gaps() -> dict[str, list[str]]:
    """``{path: gaps}`` for every incomplete results file and every table without a .json."""
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "**", "*.json"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        if "_runs" + os.sep in rel:  # a seed grid's run: its table's .json holds it
            continue
        with open(path) as f:
            gaps = record_gaps(json.load(f))
        if gaps:
            out[rel] = gaps
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "**", "*.md"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        name = os.path.basename(rel)
        if name == "README.md" or name.endswith("_reading.md") or "_runs" + os.sep in rel:
            continue
        if not os.path.exists(path[:-3] + ".json"):
            out[rel] = [NO_JSON]
    return out


def test_every_incomplete_record_is_listed_as_legacy():
    found = committed_gaps()
    new = {p: g for p, g in found.items() if p not in LEGACY}
    assert not new, f"incomplete records not in LEGACY (complete them, re-run, or list them with a reason): {new}"
    changed = {p: (LEGACY[p][0], g) for p, g in found.items() if g != LEGACY[p][0]}
    assert not changed, f"LEGACY says -> the file lacks: {changed}"
    completed = sorted(set(LEGACY) - set(found))
    assert not completed, f"complete now (or removed): take them off LEGACY: {completed}"
    assert all(reason.strip() for _, reason in LEGACY.values())


def test_record_gaps_names_what_is_missing():
    complete = {"runs": {"a_s0": {"record": {"config": {"attn": {"name": "mhla"}}, "attention": {"name": "mhla"},
                                             "commit": "abc", "dirty": False, "machine": {"cpu": "x"},
                                             "load_before": [0.1, 0.1, 0.1]}}}}
    assert record_gaps(complete) == []
    run = complete["runs"]["a_s0"]["record"]
    for key, gap in (("commit", COMMIT), ("dirty", CLEAN), ("machine", MACHINE), ("load_before", LOAD),
                     ("attention", "1 of 1 runs without the effective attention")):
        assert record_gaps({"runs": {"a_s0": {"record": {k: v for k, v in run.items() if k != key}}}}) == [gap]
    assert record_gaps({"runs": {"a_s0": {"record": {**run, "dirty": True}}}}) == ["1 from a dirty tree"]
    assert CONFIG in record_gaps({"runs": {"a_s0": {k: v for k, v in run.items() if k != "config"}}})
