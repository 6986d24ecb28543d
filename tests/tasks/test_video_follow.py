"""The prompt-following check of the mini video task (tasks/video_gen/follow.py): every training render passes
it, and each way of not following a prompt fails the check it should."""

import torch

from tasks.video_gen.data import MovingShapes, render_clip
from tasks.video_gen.follow import all_prompts, check_prompt, color_labels, follow_report, shape_separability


def clip(color="red", shape="square", direction="right", **kw):
    start = {"right": (0.5, 0.25), "left": (0.5, 0.75), "down": (0.25, 0.5), "up": (0.75, 0.5)}[direction]
    return render_clip(color, shape, direction, num_frames=8, size=16, start=start, radius=2.5, speed=1.0, **kw)


def test_every_render_follows_its_caption():
    data = MovingShapes(64, num_frames=8, size=16, seed=3)
    report = follow_report([data[i][0] for i in range(64)], [data.caption(i) for i in range(64)])
    assert report["followed"] == 1.0
    prompts = all_prompts()
    assert len(prompts) == 32 and len(set(prompts)) == 32
    videos = [clip(*p.split()[1:3], p.split()[4]) for p in prompts]
    assert follow_report(videos, prompts)["followed"] == 1.0


def test_each_failure_is_caught():
    right = clip("red", "square", "right")
    assert check_prompt(right, "a red square moving right")["ok"]
    wrong_way = check_prompt(right, "a red square moving left")
    assert not wrong_way["ok"] and not wrong_way["moved"] and wrong_way["color_ok"]
    wrong_color = check_prompt(right, "a blue square moving right")
    assert not wrong_color["ok"] and not wrong_color["color_ok"]
    static = right[:, :1].expand_as(right)
    assert not check_prompt(static, "a red square moving right")["moved"]
    sideways = check_prompt(clip("red", "square", "down"), "a red square moving right")  # moves across the axis
    assert not sideways["axis"] and not sideways["ok"]
    slow = render_clip("red", "square", "right", num_frames=8, size=16, start=(0.5, 0.4), radius=2.5, speed=0.1)
    assert not check_prompt(slow, "a red square moving right")["moved"]  # 0.7 px < 8% of 16 px
    gone = right.clone()
    gone[:, 5] = -0.8  # the shape vanishes in one frame
    assert not check_prompt(gone, "a red square moving right")["color_ok"]
    flooded = right.clone()
    flooded[:, :, :, :] = torch.tensor([1.0, 1.0, -0.9]).view(3, 1, 1, 1)  # a yellow canvas: red is a minority
    flooded[:, :, 7:9, 7:9] = torch.tensor([1.0, -0.8, -0.8]).view(3, 1, 1, 1)
    assert not check_prompt(flooded, "a red square moving right")["color_ok"]


def test_colour_labels_and_shape():
    v = clip("green", "circle", "up")
    labels = color_labels(v)
    assert set(labels.unique().tolist()) == {-1, 1}  # background and green (index 1 of COLORS)
    assert check_prompt(v, "a green circle moving up")["shape_guess"] == "circle"
    assert check_prompt(clip("green", "square", "up"), "a green square moving up")["shape_guess"] == "square"
    assert shape_separability(size=16, n=64) > 0.9  # 16 px renders: the fill-ratio rule tells them apart


def test_table5_mini_trains_rows_and_writes_table(tmp_path):
    """scripts/tables/table5_mini.py on a tiny setting: every row trained with train.py, sampled, checked and
    timed; the md has one line per row with the 31.5k-token columns, the json the records, a frames picture."""
    import json

    from scripts.tables import table5_mini

    out = tmp_path / "t5"
    tiny = ["trainer.max_steps=2", "data.train_size=8", "data.eval_size=4", "data.batch_size=4", "data.num_frames=4",
            "data.height=8", "data.width=8", "model.num_layers=3", "sample.num_steps=2",
            "model.attn_defaults.mhla.blocks=[2,2,2]"]  # MHLA's blocks, for the rows that run MHLA
    argv = ["--rows", "softmax", "mhla_hybrid", "--threads", "1", "--latency-repeats", "2", "--settle-s", "0",
            "--out", str(out),
            "--out-dir", str(tmp_path / "runs"), *tiny]
    assert table5_mini.main(argv) == 0
    data = json.loads((tmp_path / "t5.json").read_text())["results"]
    assert [r["row"] for r in data] == ["softmax", "mhla_hybrid"]
    for r in data:
        assert r["metrics"]["loss"] > 0 and r["latency_s"] > 0 and len(r["latency_times_s"]) == 2
        assert min(r["latency_times_s"]) <= r["latency_s"] <= max(r["latency_times_s"])
        assert len(r["all_follow"]["per_prompt"]) == 32 and 0 <= r["sample_follow"]["followed"] <= 1
    md = (tmp_path / "t5.md").read_text()
    assert "| MHLA hybrid (layer 2 of 4 softmax) |" in md and "paper latency" in md and "(1.61x)" in md
    assert (tmp_path / "t5_frames.png").stat().st_size > 1000
    assert table5_mini.main(["--plot-only", "--out", str(out)]) == 0
    # a row whose run folder is gone keeps its metrics, but its old latency leaves the (re-timed) latency column
    import shutil

    shutil.rmtree(tmp_path / "runs" / "softmax_s0")
    assert table5_mini.main(["--resume", *argv]) == 0
    data = {r["row"]: r for r in json.loads((tmp_path / "t5.json").read_text())["results"]}
    assert data["softmax"]["latency_stale"] and "latency_stale" not in data["mhla_hybrid"]
    line = next(x for x in (tmp_path / "t5.md").read_text().splitlines() if x.startswith("| softmax"))
    assert line.split(" | ")[5:7] == ["-", "-"]  # its latency and ratio are not shown
    summary = json.loads((tmp_path / "t5.json").read_text())["summary"]
    assert "latency_s" not in summary["softmax"] and summary["mhla_hybrid"]["latency_s"]["n"] == 1
