"""Each committed seed-grid run was trained with the config that its grid file composes today, key by key.

For every run ``<variant>_s<seed>`` under a grid's ``<out>_runs/``, the grid's command for that run
(:func:`scripts.run_seed_grid.run_overrides`) is composed with Hydra as ``train.py`` composes it
(:func:`scripts.tables.config.compose`: ``configs/train.yaml`` plus the overrides; the ``hydra.*`` run folder is
left out, as ``@hydra.main`` leaves it out of the config it passes) and resolved, then compared with the resolved
config stored in the run's ``run.json``, brought to today's schema first by the project's one mapping of renamed
keys (:func:`tasks.common.config.upgrade_config`, e.g. ``model.mhla_num_blocks`` -> ``model.token_blocks``). Every
key that differs is listed as ``key: stored -> today``; a recipe that moved since the runs (``sched.min_lr_ratio
0.01 -> 0.0``) fails.

The one exception, :data:`ADDED_SINCE`: a key added to the schema after a run was trained, absent from its stored
config, whose value today is the one that reproduces what the code did before the key existed. Nothing else is
allowed to differ.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from omegaconf import OmegaConf

from scripts import run_seed_grid as rsg
from scripts.summarize_runs import _flat
from scripts.tables.config import compose
from tasks.common.config import resolve_accumulation, upgrade_config
from tasks.common.records import RECORD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRIDS = sorted(glob.glob(os.path.join(ROOT, "configs", "grid", "*.yaml")))
ABSENT = "<absent>"

# key added to the schema since some committed runs -> (its value today, why that value is what those runs did)
ADDED_SINCE = {
    "data.long_context": (False, "MQAR's N >= vocab switch, added for the N = 512 grid; false keeps Zoology's "
                                 "vocab_size > seq_len rule, the only rule before it (tasks/language/mqar.py reads "
                                 "an absent key as false)"),
    "data.pairs_offset": (0, "filler tokens before MQAR's key-value pairs, added for the *_off8 controls; 0 is "
                             "Zoology's layout, the only one before it (an absent key reads as 0)"),
    "trainer.init_from": (None, "start from another run's weights (conversion), added later; null is a fresh "
                                "init, what every run did before it"),
    "attn_cross.name": ("native", "the cross-attention group (Wan, SANA), added later; tasks.common.config reads a "
                                  "config without it as native, and MQAR's language model has no cross-attention"),
    "trainer.init_seed": (None, "the initial weights' own seed, added for the weights-vs-data control; null is the "
                                "run's seed, the only one before it"),
    "trainer.accumulate": (1, "gradient accumulation, added later; these grids' recipes state no global batch, so "
                              "auto resolves to 1 micro-batch per optimizer step (composed() resolves it as a "
                              "1-process train.py run does), what every run did before it"),
    **{f"attn.{key}": (None, "an option added later to express the authors' release (in_norm, gate_bias, "
                             "feature_map_eps, q_scale); null is the layer's default, its behaviour before the key")
       for key in ("in_norm", "gate_bias", "feature_map_eps", "q_scale")},
    "attn.mixing_max": (None, "the clamp's upper bound, added for the ceiling control of the ones start; null is the "
                              "layer's default 1, the only bound before it"),
    "attn.write_gate": (None, "a learned gate on each token's write into the state, added for the moonshot's "
                              "selective state; null is no gate, the only state before it"),
    "attn.write_gate_penalty": (None, "the write gate's budget in training, added with it; null is none"),
    "attn.write_gate_input": (None, "what the write gate reads, added for the gate that sees the token's neighbours; "
                                    "null is the layer input, the only input before it"),
    "task.filler_decoys": (0.0, "decoy numbers in the passkey's training filler, added for the control of the "
                                "filler's numbers; 0 is the plain filler, the only filler before it"),
}


#: flat-key prefixes that are not the recipe: the cell's ``paper:`` block (the paper's numbers it is compared with)
QUOTES = ("paper.",)


def moved_keys(stored: dict, today: dict) -> list[str]:
    """``["key: stored -> today", ...]`` for every flat key whose value differs between a run's stored resolved
    config and today's composition (``<absent>`` on the side that lacks it), the keys of :data:`ADDED_SINCE`
    left out when the stored config lacks them and today's value is the listed one."""
    then = _flat(OmegaConf.to_container(upgrade_config(OmegaConf.create(stored))))
    now = _flat(today)
    moved = []
    for key in sorted(set(then) | set(now)):
        if key.startswith(QUOTES):  # the paper's numbers quoted beside the recipe: a quote sourced later moves no run
            continue
        a, b = then.get(key, ABSENT), now.get(key, ABSENT)
        if a == b or (a == ABSENT and key in ADDED_SINCE and b == ADDED_SINCE[key][0]):
            continue
        moved.append(f"{key}: {a!r} -> {b!r}")
    return moved


def composed(grid: dict, variant: str, seed: int) -> dict:
    """Today's resolved ``train.py`` config of the grid's run ``<variant>_s<seed>``, with ``trainer.accumulate``
    resolved for one process as the trainer resolves it and stores it in the run's record."""
    cfg, _ = compose(rsg.run_overrides(grid, variant, seed, "unused"))
    today = OmegaConf.to_container(cfg, resolve=True)
    today["trainer"]["accumulate"] = resolve_accumulation(cfg, world_size=1)
    return today


def committed_runs(grid: dict) -> list[str]:
    """The run folders under the grid's ``<out>_runs/`` (none when it has no committed runs yet)."""
    folder = os.path.join(ROOT, f"{grid['out']}_runs")
    if not os.path.isdir(folder):
        return []
    return sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))


@pytest.mark.parametrize("path", GRIDS, ids=os.path.basename)
def test_grid_file_composes_the_config_of_its_committed_runs(path):
    grid = rsg.load_grid(path)
    runs = rsg.runs_of(grid)
    assert runs and len(set(runs)) == len(runs)
    found = committed_runs(grid)
    if not found:
        pytest.skip(f"{grid['out']}: no committed runs yet")
    unknown = sorted(set(found) - {f"{v}_s{s}" for v, s in runs})
    assert not unknown, f"runs the grid does not describe: {unknown}"
    problems = {}
    for name in found:
        variant, seed = name.rsplit("_s", 1)
        with open(os.path.join(ROOT, f"{grid['out']}_runs", name, RECORD)) as f:
            stored = json.load(f)["config"]
        moved = moved_keys(stored, composed(grid, variant, int(seed)))
        if moved:
            problems[name] = moved
    assert not problems, "today's composition differs from the stored config:\n" + "\n".join(
        f"{name}: {'; '.join(keys)}" for name, keys in problems.items())


def test_a_moved_recipe_key_is_listed():
    """The check can fail: the grid's command with the schedule's floor moved (``sched.min_lr_ratio=0.0``) composes
    a config that differs from the stored runs' in that key, and the key is named with both values."""
    grid = rsg.load_grid(os.path.join(ROOT, "configs", "grid", "table2_converged.yaml"))
    name = next(n for n in committed_runs(grid) if os.path.exists(os.path.join(ROOT, f"{grid['out']}_runs", n, RECORD)))
    with open(os.path.join(ROOT, f"{grid['out']}_runs", name, RECORD)) as f:
        stored = json.load(f)["config"]
    variant, seed = name.rsplit("_s", 1)
    assert moved_keys(stored, composed(grid, variant, int(seed))) == []
    moved = {**grid, "common": [*grid["common"], "sched.min_lr_ratio=0.0"]}
    assert moved_keys(stored, composed(moved, variant, int(seed))) == [
        f"sched.min_lr_ratio: {stored['sched']['min_lr_ratio']!r} -> 0.0"]
    today = composed(grid, variant, int(seed))
    del today["sched"]["min_lr_ratio"]  # a key dropped from the schema is listed
    assert moved_keys(stored, today) == [f"sched.min_lr_ratio: {stored['sched']['min_lr_ratio']!r} -> '{ABSENT}'"]
    today = composed(grid, variant, int(seed))
    today["data"]["pairs_offset"] = 8  # an added key is allowed only at the value that reproduces the old runs
    assert moved_keys(stored, today) == [f"data.pairs_offset: '{ABSENT}' -> 8"]
