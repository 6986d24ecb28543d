"""Every full-scale cell declares the inputs it needs (``inputs:`` of its composed config: data roots, weights,
the FID reference of its resolution) and refuses to start without them, both in ``train.py`` (the config check)
and in ``scripts/reproduce_table.py`` (before anything starts), with a message that says what to download and
where to put it; given them (stand-ins here), nothing is missing. The CPU proxies declare nothing."""

from __future__ import annotations

import argparse
import glob
import os

import pytest
from helpers.inputs import fake_fid_refs, fake_inputs
from scripts.tables import config, registry

from tasks.common.config import ConfigError, declared_inputs, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def every_cell():
    """``(table, cell)`` for every cell of every table: the runner's cells (derived and extra ones included) and
    the experiment configs of the delegated tables (5, 6, 8), which train through train.py too."""
    out = []
    for spec in registry.TABLES.values():
        if spec.kind == "cells":
            out += [(spec.id, c) for c in registry.table_cells(spec.id)]
        elif spec.id in ("5", "6", "8"):
            for p in sorted(glob.glob(os.path.join(registry.EXPERIMENTS, f"table{spec.id}", "*.yaml"))):
                name = os.path.splitext(os.path.basename(p))[0]
                out.append((spec.id, registry.Cell(name, [f"experiment=table{spec.id}/{name}"], {}, p)))
    return out


CELLS = every_cell()


def test_the_walk_covers_every_experiment_config():
    # the paper's cells live under table*/; other experiments (long_context/) run on generated data and need none
    files = {os.path.relpath(p, registry.EXPERIMENTS)[:-5] for p in glob.glob(os.path.join(registry.EXPERIMENTS,
                                                                                          "table*", "*.yaml"))}
    assert len(files) > 50, len(files)
    walked = {o.split("=", 1)[1] for _, c in CELLS for o in c.overrides[:1]}
    assert files <= walked, sorted(files - walked)
    assert {"7a", "7b", "3b", "5", "6", "8"} <= {t for t, _ in CELLS}  # derived, extra and delegated cells too


@pytest.mark.parametrize("table, cell", CELLS, ids=[f"{t}-{c.name}" for t, c in CELLS])
def test_full_scale_cell_refuses_without_its_inputs(table, cell, tmp_path):
    spec = registry.table_spec(table)
    cfg, _ = config.compose(cell.overrides)
    declared = declared_inputs(cfg)
    blocking = {n: e for n, e in declared.items() if e.get("key") or e.get("option")}
    assert blocking, f"{cell.name} declares no input it needs"
    for name, entry in declared.items():  # each says what it is, where to get it and where to put it
        assert entry.get("what") and entry.get("get") and entry.get("put"), (cell.name, name)
        assert sum(bool(entry.get(k)) for k in ("key", "option", "step")) == 1, (cell.name, name)
    # the runner: nothing given -> one message per blocking input, naming the download and the place
    args = argparse.Namespace(fid_refs={}, no_fid=False)
    problems = config.config_problems(spec, cell.overrides, "full", args)
    assert len(problems) == len(blocking), problems
    for entry in blocking.values():
        assert any(entry["get"] in p and entry["put"] in p for p in problems), (cell.name, entry["what"])
    # train.py: the same refusal for the config options (the FID reference is the runner's)
    keys = [e for e in blocking.values() if e.get("key")]
    if keys:
        with pytest.raises(ConfigError, match="nothing is downloaded at run time") as e:
            validate_config(cfg)
        for entry in keys:
            assert f"{entry['key']}={entry['put']}" in str(e.value)
    # given every input, nothing is missing
    given = fake_inputs(cfg, tmp_path)
    args.fid_refs = fake_fid_refs(tmp_path)
    assert config.config_problems(spec, [*cell.overrides, *given], "full", args) == []
    if any(e.get("option") == "fid_ref" for e in blocking.values()):  # --no-fid waives the reference only
        assert config.config_problems(spec, [*cell.overrides, *given], "full",
                                      argparse.Namespace(fid_refs={}, no_fid=True)) == []
        assert config.config_problems(spec, [*cell.overrides, *given], "full",
                                      argparse.Namespace(fid_refs={}, no_fid=False)) != []


MINI = [(t, c) for t, c in CELLS if registry.TABLES[t].kind == "cells" and registry.TABLES[t].mini
        and not c.eval_only]


@pytest.mark.parametrize("table, cell", MINI, ids=[f"{t}-{c.name}" for t, c in MINI])
def test_cpu_proxy_needs_nothing(table, cell):
    option = config.mini_option(config.cell_info(cell))
    assert config.config_problems(registry.table_spec(table), [*cell.overrides, f"scale={option}"], "mini") == []
    cfg, _ = config.compose([*cell.overrides, f"scale={option}"])
    assert not [e for e in declared_inputs(cfg).values() if e.get("key")], cell.name
