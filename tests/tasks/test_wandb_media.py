"""W&B and loaders in the shared trainer: mixing-matrix heatmaps and task media (sample grids, videos) logged
as W&B media, one resumed training = one W&B run, the same keys in metrics.jsonl / W&B / train.log, and
data-loader workers capped to the CPUs. W&B runs offline into tmp folders (nothing reaches the network); its
``.wandb`` files are read back with :func:`wandb_records`."""

import glob
import json
import os
import re
import struct
import time
import warnings

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tasks.common.logger import Media, RunLogger, format_metrics, heatmap_image, split_media
from mhla.hooks import logged_matrices
from tasks.common.trainer import Trainer, available_cpus, cap_num_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
TINY = [
    "trainer.progress_bar=false", "trainer.count_flops=false", "data.limit=512", "data.eval_limit=256",
    "data.batch_size=64", "model.embed_dim=16", "model.depth=2", "model.num_heads=2",
]  # 8 steps per epoch
WANDB = ["logger=wandb", "logger.mode=offline"]
INTERNAL = ("_step", "_runtime", "_timestamp", "_wandb")  # W&B's own history / summary keys

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """Every W&B folder under ``tmp_path``, offline, and an unreachable server should anything try."""
    for var, sub in (("WANDB_DIR", "wandb"), ("WANDB_CONFIG_DIR", "wandb_config"),
                     ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data"),
                     ("WANDB_ARTIFACT_DIR", "wandb_artifacts"), ("XDG_CACHE_HOME", "cache")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run(overrides, run_dir):
    from train import run as train_run  # noqa: PLC0415

    return train_run(make_cfg(overrides), str(run_dir))


# ------------------------------------------------------------------------------ reading W&B's offline files
def _chunks(data: bytes):
    """The records of a ``.wandb`` file (LevelDB's log format after a 7-byte header: 32 KiB blocks, each
    record split into FULL / FIRST / MIDDLE / LAST chunks behind a 7-byte crc, length, type header)."""
    if data[:4] != b":W&B":
        pytest.skip(f"unknown .wandb file header {data[:7]!r}: this W&B version writes another format")
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the tail of a block too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # still being written
            return
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            yield buf
            buf = b""


def _finished_records(path: str, timeout: float = 30.0) -> list:
    """The records of the ``.wandb`` file ``path`` once it ends with the run's exit record (W&B's service
    process may still be writing it when ``finish()`` returns)."""
    from wandb.proto import wandb_internal_pb2 as pb  # noqa: PLC0415

    deadline = time.time() + timeout
    while True:
        with open(path, "rb") as f:
            records = [pb.Record.FromString(chunk) for chunk in _chunks(f.read())]
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            return records
        time.sleep(0.2)


def wandb_records(run_dir) -> list:
    """``(run id, history {step: {key: value}}, summary {key: value})`` of each offline W&B run in
    ``run_dir/wandb``, by start time (history items of one step merged, as W&B shows them)."""
    out = []
    for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb")):
        run_id, start, history, summary = None, None, {}, {}
        for rec in _finished_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id, start = rec.run.run_id, rec.run.start_time.ToNanoseconds()
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                history.setdefault(items["_step"], {}).update(items)
            elif kind == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in rec.summary.update})
        out.append((start, run_id, history, summary))
    return [rest for _, *rest in sorted(out, key=lambda r: r[0])]


def user_keys(record: dict) -> set:
    """The keys of a W&B history row or summary that we logged (not W&B's own, not a media file's fields)."""
    return {k for k in record if not k.startswith(INTERNAL + ("mixing/", "final/samples"))}


def jsonl(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------ units
def test_media_checks_kind_and_file_type(tmp_path):
    assert Media(tmp_path / "a.png").kind == "image"
    assert Media(np.zeros((4, 4, 3), np.uint8)).kind == "image"
    assert Media(str(tmp_path / "a.gif"), "video").kind == "video"
    with pytest.raises(ValueError, match="image or video"):
        Media(tmp_path / "a.png", "audio")
    with pytest.raises(ValueError, match="must end in"):
        Media(tmp_path / "a.txt")
    with pytest.raises(ValueError, match="must be a file"):
        Media(np.zeros((2, 4, 4, 3), np.uint8), "video")
    scalars, media = split_media({"loss": 1.0, "grid": Media(tmp_path / "a.png")})
    assert scalars == {"loss": 1.0} and list(media) == ["grid"]


def test_without_wandb_media_are_not_rendered_nor_logged(tmp_path):
    for cfg in (None, OmegaConf.create({"name": "none"})):
        logger = RunLogger(cfg, tmp_path, {}, {})
        assert not logger.logs_media and logger.run_id is None
        logger.log_media({"x": Media(np.zeros((4, 4), np.uint8))}, step=1)  # a no-op
        logger.finish()


def test_heatmap_image_is_rgb_with_a_panel_per_head():
    one = heatmap_image(torch.rand(5, 5).numpy(), "one")
    heads = heatmap_image(torch.rand(4, 5, 5).numpy(), "four heads")
    assert one.dtype == heads.dtype == np.uint8 and one.shape[2] == heads.shape[2] == 3
    assert heads.shape[0] > one.shape[0] and heads.shape[1] > one.shape[1]  # a 2 x 2 grid of panels
    assert heatmap_image(np.zeros((3, 3)), "zeros").std() > 0  # all-zero matrix: still drawn


def test_logged_matrices_are_the_learnable_mhla_mixing_matrices():
    from mhla.layers import MultiHeadLinearAttention  # noqa: PLC0415
    from mhla.mixing import MixingMatrix  # noqa: PLC0415
    from tasks.classification.task import ClassificationTask  # noqa: PLC0415

    model = ClassificationTask(make_cfg(TINY + ["logger=none"])).build_model()
    layers = [n for n, m in model.named_modules() if isinstance(m, MultiHeadLinearAttention)]
    found = logged_matrices(model)
    assert len(layers) == 2 and sorted(found) == sorted(f"mixing/{n}" for n in layers)
    for key, w in found.items():
        layer = model.get_submodule(key.partition("/")[2])
        torch.testing.assert_close(w, layer.mixing().detach().float())
    frozen = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    frozen[0].mixing = MixingMatrix(3, learnable=False)
    frozen[1].mixing = MixingMatrix(3, num_heads=2)
    assert {k: tuple(v.shape) for k, v in logged_matrices(frozen).items()} == {"mixing/1": (2, 3, 3)}


# ------------------------------------------------------------------------------------------ runs
def test_one_record_same_keys_in_jsonl_wandb_and_train_log_and_mixing_heatmaps(tmp_path):
    run(TINY + WANDB + ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every_steps=2"], tmp_path)
    records = jsonl(tmp_path)
    ((run_id, history, summary),) = wandb_records(tmp_path)
    assert run_id
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)["wandb_run_id"] == run_id

    # metrics.jsonl and W&B: the same keys and values at every step (W&B merges the records of a step)
    by_step: dict[int, dict] = {}
    for rec in records:
        if not any(k.startswith("final/") for k in rec):
            by_step.setdefault(rec["step"], {}).update({k: v for k, v in rec.items() if k != "step"})
    assert sorted(by_step) == sorted(history) == [0, 1, 2, 3, 4]
    for step, logged in by_step.items():
        assert user_keys(history[step]) == set(logged), step
        for k, v in logged.items():
            assert history[step][k] == pytest.approx(v), (step, k)
    (final,) = [rec for rec in records if "final/top1" in rec]
    assert {k for k in final if k != "step"} == {k for k in user_keys(summary) if k.startswith("final/")}
    assert {"final/top1", "final/loss", "final/train_time_s", "final/steps"} <= set(final)

    # train.log: the text line of every record, with the same keys (less the group prefix its heading names)
    text = (tmp_path / "train.log").read_text()
    for rec in records:
        train = {k: v for k, v in rec.items() if k.startswith("train/")}
        evals = {k: v for k, v in rec.items() if k.startswith("eval/")}
        if train:
            line = f"step {rec['step']}/4 (epoch {rec['epoch']:.2f}): {format_metrics(train, 'train/')}, "
            assert line in text
        if evals:
            assert f"step {rec['step']}: {format_metrics(evals, 'eval/')}\n" in text
            keys = set(re.search(rf"step {rec['step']}: (.*)\n", text).group(1).split(" "))
            assert {k.split("=")[0] for k in keys} == {k.removeprefix("eval/") for k in evals}

    # the mixing heatmap of both MHLA layers at both evaluations, as W&B images
    for step in (2, 4):
        for layer in ("blocks.0.attn", "blocks.1.attn"):
            assert history[step][f"mixing/{layer}/_type"] == "image-file", (step, layer)
    media = os.path.join(tmp_path, "wandb", "offline-run-*", "files", "media", "images", "mixing")
    assert len(glob.glob(os.path.join(media, "*.png"))) == 4


def test_resumed_training_writes_to_the_same_wandb_run(tmp_path, capsys):
    common = TINY + WANDB + ["trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every_steps=3"]
    run(common + ["trainer.stop_after_steps=3"], tmp_path)
    first_id = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)["wandb_run_id"]
    run(common + [f"trainer.resume={tmp_path}"], tmp_path)
    out = capsys.readouterr().out
    assert f"W&B run {first_id} (continued: the id stored in the checkpoint)" in out
    (a_id, a_hist, _), (b_id, b_hist, b_summary) = wandb_records(tmp_path)
    assert first_id and a_id == b_id == first_id
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)["wandb_run_id"] == first_id
    assert max(a_hist) == 3 and min(k for k in b_hist if k > 0) == 4 and max(b_hist) == 6  # no step twice
    assert b_summary["final/steps"] == 6

    # an explicit logger.run_id wins over the checkpoint's
    run(common + ["trainer.max_steps=7", f"trainer.resume={tmp_path}", "logger.run_id=chosen01"], tmp_path)
    assert wandb_records(tmp_path)[-1][0] == "chosen01"


def test_image_gen_sample_grid_goes_to_wandb(tmp_path):
    run(["task=mnist_gen", *WANDB, "trainer.progress_bar=false", "trainer.count_flops=false",
         "trainer.device=cpu", "model.depth=1", "model.hidden_size=32", "model.num_heads=2",
         "trainer.max_steps=2", "data.batch_size=8", "task.sample.steps=3", "task.sample.per_class=1",
         "task.sample.classes=3", "data.limit=64", "data.eval_limit=16"], tmp_path)
    ((_, history, _),) = wandb_records(tmp_path)
    assert history[2]["final/samples/_type"] == "image-file"
    assert "one row per class" in history[2]["final/samples/caption"]
    assert any(k.startswith("mixing/") for k in history[2])  # DiT's MHLA layers, at the last evaluation


def test_video_samples_go_to_wandb(tmp_path):
    run(["task=video_mini", *WANDB, "trainer.max_steps=2", "data.train_size=8", "data.eval_size=4",
         "data.batch_size=4", "data.num_frames=4", "data.height=8", "data.width=8", "model.num_layers=2",
         "attn.layers=hybrid", "sample.num_steps=2", "sample.prompts=[a red square moving right]",
         "trainer.progress_bar=false"], tmp_path)
    ((_, history, _),) = wandb_records(tmp_path)
    assert history[2]["final/samples/_type"] == "video-file"
    assert history[2]["final/samples/path"].endswith(".gif")


# ------------------------------------------------------------------------------------------ loaders
def test_cap_num_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert available_cpus() == 2
    assert cap_num_workers(0) == (0, None) and cap_num_workers(2) == (2, None)
    workers, note = cap_num_workers(8)
    assert workers == 2 and "trainer.num_workers=8 capped to 2" in note


@pytest.mark.parametrize("task", ["mnist", "imagenet", "imagenet_gen", "lm_fineweb"])
def test_every_task_config_gets_at_most_the_cpus(tmp_path, task):
    cfg = make_cfg([f"task={task}", "logger=none", "trainer.device=cpu"])
    trainer = Trainer(cfg, None, tmp_path)
    assert trainer.num_workers == min(int(cfg.trainer.num_workers), available_cpus())


@pytest.mark.parametrize("workers", [None, 8])
def test_no_worker_warning_and_the_cap_applies(tmp_path, capsys, trainer_loaders, workers):
    """The default config, and 8 workers asked for (as the ImageNet recipes do) on this machine: no PyTorch
    warning about workers; the loaders get at most the CPUs, with one line saying so when capped."""
    loaders = trainer_loaders
    extra = [] if workers is None else [f"trainer.num_workers={workers}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(TINY + ["logger=none", "trainer.max_steps=2"] + extra, tmp_path)
    assert not [w for w in caught if "worker" in str(w.message).lower()], [str(w.message) for w in caught]
    asked = int(make_cfg([]).trainer.num_workers) if workers is None else workers
    assert [dl.num_workers for dl in loaders] == [min(asked, available_cpus())] * 2
    capped = asked > available_cpus()
    assert (f"trainer.num_workers={asked} capped to {available_cpus()}" in capsys.readouterr().out) == capped
