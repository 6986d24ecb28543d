"""scripts/mqar_extrapolation.py: distance buckets, seed groups and the table's numbers."""

from scripts import mqar_extrapolation as mx


def test_edges_and_groups():
    assert mx.edges_for(256, 2048) == (0, 64, 128, 192, 256, 512, 1024, 2048)
    assert mx.group({"mhla_s0": "a", "mhla_s1": "b", "linear": "c"}) == {"mhla": {0: "a", 1: "b"},
                                                                          "linear": {"linear": "c"}}


def test_table_means_over_seeds_and_buckets():
    def rec(acc, near, far):
        return {"acc": acc, "n": 8, "buckets": [{"lo": 0, "hi": 64, "acc": near, "n": 4},
                                                 {"lo": 256, "hi": 512, "acc": far, "n": 4}]}

    record = {"train_len": 256, "num_kv_pairs": 8, "lengths": ["512"], "edges": [0, 64, 128, 192, 256, 512],
              "num_examples": 8, "seed": 1, "rules_of": {"mhla": ["uniform_far", "window"]},
              "groups": {"mhla": {"0": {"window": {"512": rec(0.5, 1.0, 0.0)},
                                        "uniform_far": {"512": rec(0.75, 1.0, 0.5)}},
                                  "1": {"window": {"512": rec(0.5, 1.0, 0.0)},
                                        "uniform_far": {"512": rec(0.85, 1.0, 0.7)}}}}}
    md = mx.markdown(record, "cmd")
    assert "| mhla | uniform_far | 2 | 80.0 ± 7.1 | 100.0 | - | - | - | 60.0 |" in md
    assert "| mhla | window | 2 | 50.0 ± 0.0 | 100.0 | - | - | - | 0.0 |" in md


def test_rewrite_from_json_adds_the_reading(tmp_path):
    import json

    record = {"command": "cmd", "train_len": 256, "num_kv_pairs": 8, "lengths": ["256"],
              "edges": [0, 64, 128, 192, 256], "num_examples": 8, "seed": 1, "rules_of": {"linear": ["-"]},
              "groups": {"linear": {"0": {"-": {"256": {"acc": 0.5, "n": 8, "buckets": []}}}}}}
    out = tmp_path / "x"
    (tmp_path / "x.json").write_text(json.dumps(record))
    assert mx.main(["unused=dir", "--out", str(out), "--plot-only", "--notes", "Linear reads 50.0."]) == 0
    md = (tmp_path / "x.md").read_text()
    assert "| linear | - | 1 | 50.0 ± 0.0 |" in md and md.split("## Reading")[1].strip() == "Linear reads 50.0."
    assert json.loads((tmp_path / "x.json").read_text())["notes"] == "Linear reads 50.0."


def test_add_merges_new_seeds_and_refuses_repeats():
    import pytest

    def res(acc):
        return {"-": {"256": {"acc": acc, "n": 8, "buckets": []}}}

    previous = {"command": "cmd0", "train_len": 256, "num_kv_pairs": 8, "lengths": ["256"], "edges": [0, 64],
                "num_examples": 8, "seed": 1, "rules_of": {"linear": ["-"]}, "runs": {"linear/0": {}},
                "groups": {"linear": {"0": res(0.5)}}}
    record = mx.merge_into(previous, {"linear": {"1": res(0.7)}}, {"linear": ["-"]}, {"linear/1": {}}, 256, 8,
                           "cmd1", {"load": 0.1})
    assert sorted(record["groups"]["linear"]) == ["0", "1"] and previous["groups"]["linear"].keys() == {"0"}
    md = mx.markdown(record, record["command"])
    assert "Made by `cmd0`; runs linear/1 added by `cmd1`" in md and "| linear | - | 2 | 60.0 ± 14.1 |" in md
    with pytest.raises(SystemExit, match="already in the record"):
        mx.merge_into(record, {"linear": {"1": res(0.7)}}, {"linear": ["-"]}, {"linear/1": {}}, 256, 8, "c", {})
    with pytest.raises(SystemExit, match="N = 512"):
        mx.merge_into(record, {"linear": {"2": res(0.7)}}, {"linear": ["-"]}, {"linear/2": {}}, 512, 8, "c", {})
