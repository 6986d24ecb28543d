"""The shared training harness: config composition, a few training steps, exact resume, bad configs."""

import math
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
TINY = [
    "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "data.limit=512",
    "data.eval_limit=256", "data.batch_size=64", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
]


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run(cfg, run_dir):
    from train import run as train_run  # noqa: PLC0415

    return train_run(cfg, str(run_dir))


def test_default_config_composes_and_resolves():
    cfg = make_cfg([])
    assert cfg.task.name == "mnist" and cfg.attn.name == "mhla" and cfg.model.name == "vit_mnist"
    OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("attn", ["mhla", "linear", "softmax"])
def test_train_two_steps(tmp_path, attn, capsys):
    cfg = make_cfg(TINY + [f"attn={attn}", "trainer.max_steps=2"])
    metrics = run(cfg, tmp_path)
    assert 0.0 <= metrics["top1"] <= 1.0
    assert "final: top1=" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / "last.pt").exists()
    assert (tmp_path / "checkpoints" / "best.pt").exists()
    assert (tmp_path / "metrics.jsonl").exists()


def test_resume_equals_uninterrupted_run(tmp_path):
    common = TINY + ["trainer.max_steps=6", "trainer.eval_every_steps=100", "model.drop_path_rate=0.1"]
    run(make_cfg(common), tmp_path / "straight")
    run(make_cfg(common + ["trainer.stop_after_steps=3"]), tmp_path / "split")
    interrupted = torch.load(tmp_path / "split" / "checkpoints" / "last.pt", weights_only=False)
    assert interrupted["step"] == 3
    run(make_cfg(common + ["trainer.resume=last"]), tmp_path / "split")
    a = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoints" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)
    # and the run really changed the weights
    assert any((a["model"][k] != interrupted["model"][k]).any() for k in a["model"])
    # the record of the resumed run names both processes that trained it
    from tasks.common.records import read_run_record  # noqa: PLC0415

    straight, split = read_run_record(tmp_path / "straight"), read_run_record(tmp_path / "split")
    assert [(g["from_step"], g["to_step"]) for g in straight["segments"]] == [(0, 6)]
    assert straight["resumed_from_step"] == 0
    assert straight["seconds_total"] == straight["segments"][0]["seconds"]
    assert [(g["from_step"], g["to_step"]) for g in split["segments"]] == [(0, 3), (3, 6)]
    assert split["resumed_from_step"] == 3
    assert split["seconds"] == pytest.approx(split["segments"][1]["seconds"], abs=5)
    assert split["seconds_total"] == pytest.approx(sum(g["seconds"] for g in split["segments"]), abs=0.11)
    assert all(g["commit"] == split["commit"] and g["started"] for g in split["segments"])


def test_resume_from_a_checkpoint_without_segments_says_the_history_is_unknown(tmp_path):
    common = TINY + ["trainer.max_steps=2", "trainer.eval_every_steps=100"]
    run(make_cfg(common + ["trainer.stop_after_steps=1"]), tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=False)
    del state["segments"]  # as a checkpoint written before the trainer kept them
    torch.save(state, path)
    run(make_cfg(common + ["trainer.resume=last"]), tmp_path)
    from tasks.common.records import read_run_record  # noqa: PLC0415

    record = read_run_record(tmp_path)
    assert [(g["from_step"], g["to_step"]) for g in record["segments"]] == [(None, 1), (1, 2)]
    assert record["resumed_from_step"] == 1 and record["seconds_total"] is None


def test_bad_configs_fail_at_start_with_a_fix(tmp_path):
    from tasks.common.config import ConfigError

    with pytest.raises(ConfigError, match="8x8 token grid: attn=mhla: num_blocks=9 cannot tile"):
        run(make_cfg(TINY + ["attn.num_blocks=9"]), tmp_path)
    with pytest.raises(Exception, match="not in struct|Could not override"):
        make_cfg(["attn.bogus=1"])
    with pytest.raises(Exception, match="Could not find|Could not load"):
        make_cfg(["attn=nonexistent"])


def test_cli_unknown_key_message():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "trainer.nonsense=3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "nonsense" in proc.stderr


def test_eval_entrypoint_reproduces_final_metrics(tmp_path):
    metrics = run(make_cfg(TINY + ["trainer.max_steps=4", "trainer.ema.enabled=true"]), tmp_path)
    from tasks.common.evaluation import evaluate_checkpoint  # noqa: PLC0415

    again = evaluate_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))
    assert again["top1"] == pytest.approx(metrics["top1"])
    assert again["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate_checkpoint(str(tmp_path / "nope.pt"))


def test_two_process_torchrun_gives_single_process_gradients(tmp_path):
    script = os.path.join(ROOT, "tests", "helpers", "ddp_grad_step.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    single = subprocess.run([sys.executable, script, str(tmp_path / "one.pt"), "16"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                script, str(tmp_path / "two.pt"), "16"]
    multi = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300)
    assert multi.returncode == 0, multi.stderr[-3000:]
    one = torch.load(tmp_path / "one.pt")
    two = torch.load(tmp_path / "two.pt")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)


def _experiments():
    import glob  # noqa: PLC0415

    paths = glob.glob(os.path.join(CONFIGS, "experiment", "*", "*.yaml"))
    return sorted(os.path.relpath(p, os.path.join(CONFIGS, "experiment"))[:-5] for p in paths)


@pytest.mark.parametrize("experiment", _experiments())
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    from helpers.inputs import fake_inputs  # noqa: PLC0415

    from tasks.common.config import ConfigError, validate_config

    cfg = make_cfg([f"experiment={experiment}"])
    extra = fake_inputs(cfg, tmp_path)  # the inputs the cell declares (data roots, weights): stand-ins
    if "root" in cfg.data and not any(o.startswith("data.root=") for o in extra):
        extra.append(f"data.root={tmp_path}")  # data that lives in a local folder: point it at an existing one
    if OmegaConf.is_missing(cfg.model, "pretrained"):  # a fine-tuning cell: its checkpoint is mandatory
        extra.append(f"model.pretrained={tmp_path / 'ckpt.pt'}")
    if extra:
        cfg = make_cfg([f"experiment={experiment}", *extra])
    OmegaConf.to_container(cfg, resolve=True)

    def numbers(x):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from numbers(v)
        elif isinstance(x, list):
            for v in x:
                yield from numbers(v)

    # every paper-table cell (configs/experiment/table*/) states its table and the paper's number(s) (top-1, FID,
    # VBench, perplexities, LongBench average, ...); a baseline whose numbers the paper (docs/paper_tables.md) does
    # not give says so with nulls. Experiments of our own (e.g. long_context/) are not paper cells.
    if not experiment.startswith("table"):
        assert "paper" not in cfg, f"{experiment}: a paper block outside configs/experiment/table*/"
        validate_config(cfg)
        return
    paper = OmegaConf.to_container(cfg.paper, resolve=True)
    assert paper.get("table"), f"{experiment}: no paper.table"
    values = [v for k, v in paper.items() if k not in ("table", "row")]
    assert any(v > 0 for v in numbers(values)) or all(v is None for v in values), \
        f"{experiment}: paper block has neither numbers nor explicit nulls: {paper}"
    if experiment.split("/")[0] in ("table2", "table3", "table3b", "table4", "table12", "table13"):
        assert any(v > 0 for v in numbers(values)), f"{experiment}: docs/paper_tables.md gives this cell's number"
    if str(cfg.model.get("arch", "")).startswith("fla_"):  # trained with flash-linear-attention, not train.py
        with pytest.raises(ConfigError, match="trained outside train.py"):
            validate_config(cfg)
        return
    validate_config(cfg)


def test_imagenet_without_root_says_what_to_download(tmp_path):
    from tasks.common.config import ConfigError

    with pytest.raises(ConfigError, match="image-net.org"):
        run(make_cfg(["task=imagenet", "logger=none"]), tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        run(make_cfg(["task=imagenet", "logger=none", f"data.root={tmp_path / 'missing'}"]), tmp_path)


def test_other_data_without_root_points_at_its_config(tmp_path):
    from omegaconf import OmegaConf

    from tasks.common.config import ConfigError, check_data

    cfg = OmegaConf.create({"data": {"name": "video_folder", "root": None, "batch_size": 1}})
    with pytest.raises(ConfigError, match=r"configs/data/video_folder.yaml") as e:
        check_data(cfg)
    assert "image-net" not in str(e.value)


@pytest.fixture(scope="module")
def fake_imagefolder(tmp_path_factory):
    """A tiny ImageNet-style folder (4 classes) of random RGB images."""
    from PIL import Image  # noqa: PLC0415

    root = tmp_path_factory.mktemp("imagenet")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 6), ("val", 2)):
        for c in range(4):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                arr = (torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(arr).save(d / f"{i}.png")
    return root


@pytest.mark.parametrize("model", ["deit_t", "deit_s", "deit_b"])
@pytest.mark.parametrize("attn", ["softmax", "linear", "mhla", "focused", "inline", "mala", "rala"])
def test_every_model_and_attention_trains_two_steps_on_imagefolder(model, attn, fake_imagefolder, tmp_path):
    """DeiT configs at tiny size through the ImageNet pipeline (RandAugment, mixup, repeated aug, EMA)."""
    overrides = [
        "task=imagenet", f"model={model}", f"attn={attn}", f"data.root={fake_imagefolder}", "logger=none",
        "trainer.max_steps=2", "trainer.progress_bar=false", "trainer.num_workers=0", "trainer.device=cpu",
        "trainer.accumulate=1",  # the recipe's global batch, 1024, would be 256 accumulation steps of 4
        "data.batch_size=4", "data.eval_batch_size=8", "model.img_size=32", "model.input_size=32",
        "model.pad_to=32", "model.patch_size=8", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
        "model.num_classes=4", "model.token_blocks=4", "attn.cpe=true",
    ]
    metrics = run(make_cfg(overrides), tmp_path)
    assert 0.0 <= metrics["top1"] <= 1.0 and math.isfinite(metrics["loss"])


@pytest.mark.parametrize(
    "model,attn",
    [("vlt_t", a) for a in ["softmax", "linear", "mhla", "focused", "inline", "mala", "rala"]] + [("vlt_s", "mhla")],
)
def test_vlt_trains_two_steps(model, attn, tmp_path):
    overrides = TINY[:3] + [
        f"model={model}", f"attn={attn}", "trainer.max_steps=2", "data.limit=16", "data.eval_limit=16",
        "data.batch_size=8", "model.img_size=32", "model.input_size=32", "model.in_chans=1", "model.num_classes=10",
        "model.stage_num_blocks=[4,4]",
    ]
    metrics = run(make_cfg(overrides), tmp_path)
    assert 0.0 <= metrics["top1"] <= 1.0


def test_vlt_bad_stage_blocks():
    from tasks.common.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="model=vlt_t on its 8x8 token grid: attn=mhla: num_blocks=49 cannot tile"):
        validate_config(make_cfg(["model=vlt_t", "model.img_size=32"]))


def test_wandb_offline_logging(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    overrides = [o for o in TINY if o != "logger=none"] + ["trainer.max_steps=1", "logger.run_name=test"]
    run(make_cfg(overrides), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "no offline W&B run directory was written"


def test_hf_imagefolder_format(fake_imagefolder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    overrides = [
        "task=imagenet", "model=deit_t", "attn=mhla", f"data.root={fake_imagefolder}", "data.format=hf",
        "logger=none", "trainer.max_steps=2", "trainer.progress_bar=false", "trainer.num_workers=0",
        "trainer.accumulate=1",  # the recipe's global batch, 1024, would be 256 accumulation steps of 4
        "data.batch_size=4", "data.eval_batch_size=8", "model.img_size=32", "model.input_size=32",
        "model.pad_to=32", "model.patch_size=8", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
        "model.num_classes=4", "model.token_blocks=4",
    ]
    metrics = run(make_cfg(overrides), tmp_path)
    assert 0.0 <= metrics["top1"] <= 1.0


def test_attention_a_model_cannot_take(tmp_path):
    from tasks.common.config import ConfigError

    with pytest.raises(ConfigError, match="needs attention over a 2-D token grid with prefix tokens; attn=rala has no "
                                          "prefix tokens. Attentions that fit: .*mhla"):
        run(make_cfg(TINY + ["model.class_token=true", "attn=rala"]), tmp_path)


def test_table7a_init_sweep_keeps_the_table2_cells_cpe():
    """Table 7a's 75.8 is Table 2's DeiT-T MHLA cell (with CPE): every cell of sweep=mhla_init keeps CPE."""
    cell = make_cfg(["experiment=table2/deit_t_mhla"])
    for init in ("uniform", "locality"):
        for learnable in ("true", "false"):
            cfg = make_cfg(["sweep=mhla_init", "task=imagenet", "model=deit_t", f"attn.mixing_init={init}",
                            f"attn.mixing_learnable={learnable}"])
            assert cfg.attn.cpe is True and cfg.attn.cpe_kernel == cell.attn.cpe_kernel
            assert cfg.attn.mixing_init == init


def test_dit_and_dig_cells_train_in_fp32_like_their_scripts():
    """DiT's and DiG's train.py use fp32 with TF32 matmuls: the Table 3 / 12 cells pin it (not bf16 'auto')."""
    import glob

    checked = 0
    for path in sorted(glob.glob(os.path.join(CONFIGS, "experiment", "table3*", "*.yaml"))
                       + glob.glob(os.path.join(CONFIGS, "experiment", "table12", "*.yaml"))):
        name = os.path.relpath(path, os.path.join(CONFIGS, "experiment"))[:-5]
        cfg = make_cfg([f"experiment={name}"])
        if cfg.task.name == "imagenet_gen":
            assert cfg.trainer.precision == "fp32" and cfg.trainer.tf32 is True, name
            checked += 1
    assert checked >= 10
