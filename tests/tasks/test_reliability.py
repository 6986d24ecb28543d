"""Reliability of the shared harness: exact resume with drop-path, Ctrl-C / SIGTERM, temp-file clean-up, unique
run folders, resuming from another folder, settings that are silently wrong, eval.py's checks, data-loader
workers and train.log. Tiny MNIST runs (a 2-block ViT of width 16), a few seconds each."""

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from hydra import compose, initialize_config_dir

from tasks.common.trainer import stop_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
TINY = [
    "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "data.limit=512",
    "data.eval_limit=256", "data.batch_size=64", "model.embed_dim=16", "model.depth=2", "model.num_heads=2",
]  # 8 steps per epoch
DROP_PATH = TINY + ["model.drop_path_rate=0.1", "trainer.log_every=1", "trainer.eval_every_steps=100"]

pytestmark = pytest.mark.usefixtures("one_thread")


def make_cfg(overrides, hydra_config=False):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=hydra_config)


def run(overrides, run_dir):
    from train import run as train_run  # noqa: PLC0415

    return train_run(make_cfg(overrides), str(run_dir))


def load(path):
    return torch.load(path, weights_only=False)


def losses(run_dir) -> dict[int, float]:
    """step -> train loss, from metrics.jsonl (the last record of a step wins)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "train/loss" in rec:
                out[rec["step"]] = rec["train/loss"]
    return out


# ------------------------------------------------------------------------------------------ exact resume
def test_the_resume_model_really_uses_drop_path():
    from tasks.classification.task import ClassificationTask  # noqa: PLC0415

    model = ClassificationTask(make_cfg(DROP_PATH)).build_model()
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    assert rates and max(rates) > 0, "drop-path is off in this model: the resume test would prove nothing"


def test_resume_with_drop_path_is_bit_identical(tmp_path):
    """12 straight steps vs 5 + resume + 7 (crossing an epoch): same weights, same loss at every step."""
    common = DROP_PATH + ["trainer.max_steps=12"]
    run(common, tmp_path / "straight")
    run(common + ["trainer.stop_after_steps=5"], tmp_path / "split")
    assert load(tmp_path / "split" / "checkpoints" / "last.pt")["step"] == 5
    run(common + ["trainer.resume=last"], tmp_path / "split")
    a = load(tmp_path / "straight" / "checkpoints" / "last.pt")
    b = load(tmp_path / "split" / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 12
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=0, msg=k)
    straight, split = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(straight) == sorted(split) == list(range(1, 13))
    assert split == straight  # bit-identical loss lines, before and after the resume


def test_metrics_file_holds_one_run(tmp_path):
    """metrics.jsonl holds the run it belongs to: a resume drops what the interrupted run logged past its
    checkpoint (a hard kill leaves such lines; the resumed run logs those steps again), and a fresh run in a used
    folder starts the file anew, as it overwrites the earlier run's checkpoints."""
    def records(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    common = DROP_PATH + ["trainer.max_steps=12"]
    run(common + ["trainer.stop_after_steps=5"], tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # logged after the checkpoint of step 5, then killed
        f.write(json.dumps({"step": 7, "train/loss": 99.0}) + "\n")
    run(common + ["trainer.resume=last"], tmp_path)
    steps = [r["step"] for r in records(tmp_path) if "train/loss" in r]
    assert steps == list(range(1, 13)) and 99.0 not in losses(tmp_path).values()
    assert sum("params" in r for r in records(tmp_path)) == 1
    run(DROP_PATH + ["trainer.max_steps=3"], tmp_path)  # fresh, in the same folder
    assert [r["step"] for r in records(tmp_path) if "train/loss" in r] == [1, 2, 3]
    assert sum("params" in r for r in records(tmp_path)) == 1


# ------------------------------------------------------------------------------------------ interrupts
def start_train(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(cwd, n: int, proc, timeout: float = 240) -> str:
    """Wait until a run folder under ``cwd/outputs`` has logged ``n`` training steps; return the folder."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for root, _, files in os.walk(os.path.join(cwd, "outputs")):
            if "metrics.jsonl" in files and len(losses(root)) >= n:
                return root
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps logged in {timeout} s")


LONG = DROP_PATH + ["trainer.max_steps=100000", "trainer.max_epochs=null"]


@pytest.mark.parametrize("sig,code,logger", [(signal.SIGINT, 130, "none"), (signal.SIGTERM, 143, "wandb")])
def test_signal_saves_last_checkpoint_finishes_logger_and_exits_with_its_code(tmp_path, sig, code, logger):
    args = [a for a in LONG if not a.startswith("logger=")] + [f"logger={logger}", "logger.mode=offline"] \
        if logger == "wandb" else LONG
    proc = start_train(args, tmp_path)
    run_dir = wait_for_steps(tmp_path, 3, proc)
    proc.send_signal(sig)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == code, out
    reached = max(losses(run_dir))
    state = load(os.path.join(run_dir, "checkpoints", "last.pt"))
    assert state["step"] == reached >= 3, out
    assert f"{signal.Signals(sig).name} received: stopped at step {reached}" in out
    # a fresh folder per launch: <time>_<pid of the process that started the run>
    assert os.path.basename(run_dir).endswith(f"_{proc.pid}")
    if logger == "wandb":  # the offline W&B run was finished, not cut off (a killed one holds 7 bytes)
        (wandb_file,) = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(run_dir, "wandb"))
                         for f in fs if f.endswith(".wandb") and "latest-run" not in r]
        assert os.path.getsize(wandb_file) > 1000
        with open(os.path.join(os.path.dirname(wandb_file), "logs", "debug.log")) as f:
            assert "finishing run" in f.read()

    # resume from the command line with the run folder: it continues there, from the step reached
    again = start_train(LONG + [f"trainer.resume={run_dir}", f"trainer.stop_after_steps={reached + 2}"], tmp_path)
    out = again.communicate(timeout=240)[0]
    assert again.returncode == 0, out
    assert f"resumed from {run_dir}/checkpoints/last.pt at step {reached}" in out
    assert load(os.path.join(run_dir, "checkpoints", "last.pt"))["step"] == reached + 2
    assert max(losses(run_dir)) == reached + 2
    runs = [r for r, _, fs in os.walk(os.path.join(tmp_path, "outputs")) if "metrics.jsonl" in fs]
    assert runs == [run_dir], "the resumed run wrote to a new folder"


def test_stale_temp_checkpoints_are_removed_at_start(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir(parents=True)
    stale = [ckpts / ".last.pt.0123456789ab.tmp", ckpts / ".best.pt.ba9876543210.tmp"]
    for p in stale:
        p.write_bytes(b"half a checkpoint")
    other = tmp_path / ".last.pt.0123456789ab.tmp"  # not in the run's checkpoint folder: left alone
    other.write_bytes(b"x")
    run(TINY + ["trainer.max_steps=1"], tmp_path)
    assert not any(p.exists() for p in stale)
    assert other.exists()
    assert sorted(os.listdir(ckpts)) == ["best.pt", "last.pt"]


# ------------------------------------------------------------------------------------------ run folders
def run_dir_of(overrides, monkeypatch=None) -> str:
    from omegaconf import OmegaConf  # noqa: PLC0415

    from tasks.common.config import register_resolvers  # noqa: PLC0415

    register_resolvers()
    cfg = make_cfg(overrides, hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"]


def test_default_run_folder_is_unique_per_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    folder = run_dir_of([])
    assert folder.startswith("outputs/mnist/vit_mnist-mhla/") and folder.endswith(f"_{os.getpid()}")
    # the ranks of one torchrun share their launcher's id, so they share the folder
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_dir_of([]).endswith(f"_{os.getppid()}")


def test_resume_names_the_run_folder(tmp_path):
    run_a = tmp_path / "a"
    (run_a / "checkpoints").mkdir(parents=True)
    (run_a / "checkpoints" / "last.pt").write_bytes(b"")
    assert run_dir_of([f"trainer.resume={run_a}"]) == str(run_a)
    assert run_dir_of([f"trainer.resume={run_a}/checkpoints/last.pt"]) == str(run_a)
    assert run_dir_of(["trainer.resume=auto"]).startswith("outputs/")
    assert run_dir_of([f"trainer.resume={tmp_path / 'missing'}"]).startswith("outputs/")


# ------------------------------------------------------------------------------------------ resume
def test_resume_from_another_folder_warns_about_changed_settings(tmp_path, capsys):
    common = TINY + ["trainer.max_steps=6"]
    run(common + ["trainer.stop_after_steps=3"], tmp_path / "a")
    capsys.readouterr()
    run(common + [f"trainer.resume={tmp_path / 'a'}", "optim.lr=1e-3", "seed=1"], tmp_path / "b")
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'a' / 'checkpoints' / 'last.pt'} at step 3" in out
    assert "WARNING: this run's optim.lr is 0.001 but the checkpoint's is 0.002" in out
    assert "WARNING: this run's seed is 1 but the checkpoint's is 0" in out
    assert "run's global batch" not in out and "run's step total" not in out
    assert load(tmp_path / "b" / "checkpoints" / "last.pt")["step"] == 6


def test_resume_whose_schedule_ended_before_the_checkpoint_says_so(tmp_path, capsys):
    from tasks.common.config import ConfigError  # noqa: PLC0415

    run(TINY + ["trainer.max_steps=6"], tmp_path)  # 6 steps at batch 64
    capsys.readouterr()
    # batch 128 -> 4 steps per epoch; max_epochs=1 -> 4 steps < the checkpoint's 6
    with pytest.raises(ConfigError, match="at step 6, past the end of this run's schedule"):
        run(TINY + ["data.batch_size=128", "trainer.max_epochs=1", "trainer.resume=last"], tmp_path)
    assert "WARNING: this run's global batch is 128 but the checkpoint's is 64" in capsys.readouterr().out
    # exactly at the end: nothing to train, said so, and the checkpoint is evaluated for the final line
    metrics = run(TINY + ["trainer.max_steps=6", "trainer.resume=last"], tmp_path)
    assert "nothing left to train" in capsys.readouterr().out
    assert 0.0 <= metrics["top1"] <= 1.0


def test_resume_auto_in_a_new_folder_says_how_to_continue_another(tmp_path, capsys):
    run(TINY + ["trainer.max_steps=1", "trainer.resume=auto"], tmp_path)
    assert "trainer.resume=<its run folder>" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("overrides,message", [
    (["trainer.max_steps=0"], "trainer.max_steps must be an integer >= 1 or null"),
    (["trainer.max_steps=-1", "trainer.max_epochs=null"], "trainer.max_steps must be an integer >= 1"),
    (["trainer.max_steps=null", "trainer.max_epochs=null"], "both null"),
    (["trainer.max_epochs=0"], "trainer.max_epochs must be > 0 or null"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip is the maximum gradient norm"),
    (["data.eval_batch_size=0"], "data.eval_batch_size must be an integer >= 1 or null"),
    (["trainer.log_every=0"], "trainer.log_every must be an integer >= 1"),
    (["trainer.checkpoint_every_steps=0"], "trainer.checkpoint_every_steps must be"),
])
def test_bad_trainer_settings_fail_at_start(tmp_path, overrides, message):
    from tasks.common.config import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=message):
        run(TINY + overrides, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_max_steps_capped_by_max_epochs_is_said_at_start(tmp_path, capsys):
    run(TINY + ["trainer.max_steps=20", "trainer.max_epochs=1"], tmp_path)
    out = capsys.readouterr().out
    assert "NOTE: trainer.max_steps=20 is capped by trainer.max_epochs=1" in out
    assert "schedule: 8 steps" in out
    assert load(tmp_path / "checkpoints" / "last.pt")["step"] == 8


def test_grad_clip_zero_or_null_means_no_clipping(tmp_path):
    from tasks.common.config import check_trainer  # noqa: PLC0415

    for value in ("0", "null", "0.5"):
        check_trainer(make_cfg(TINY + [f"trainer.grad_clip={value}"]))


# ------------------------------------------------------------------------------------------ eval.py
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    run(TINY + ["trainer.max_steps=2"], run_dir)
    return run_dir / "checkpoints" / "last.pt"


def test_eval_rejects_misspelled_overrides_like_train(trained, capsys):
    from eval import main  # noqa: PLC0415
    from tasks.common.config import ConfigError  # noqa: PLC0415
    from tasks.common.evaluation import evaluate_checkpoint  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"Could not override 'data\.eval_batchsize'"):
        evaluate_checkpoint(str(trained), ["data.eval_batchsize=100"])
    assert main([f"ckpt={trained}", "trainer.nonsense=3"]) == 2
    assert "trainer.nonsense" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data.eval_batch_size must be"):
        evaluate_checkpoint(str(trained), ["data.eval_batch_size=0"])
    assert 0.0 <= evaluate_checkpoint(str(trained), ["data.eval_batch_size=100", "+extra=1"])["top1"] <= 1.0


@pytest.mark.parametrize("kind", ["empty", "text", "foreign", "tensor"])
def test_eval_and_resume_on_a_file_that_is_not_a_checkpoint(tmp_path, kind):
    from tasks.common.checkpoint import NotACheckpointError  # noqa: PLC0415
    from tasks.common.evaluation import evaluate_checkpoint  # noqa: PLC0415

    path = tmp_path / "checkpoints" / "last.pt"
    path.parent.mkdir()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("model weights\n")
    elif kind == "foreign":
        torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 3}, path)
    else:
        torch.save(torch.zeros(3), path)
    with pytest.raises(NotACheckpointError, match=re.escape(f"not a checkpoint of this project: {path}")):
        evaluate_checkpoint(str(path))
    with pytest.raises(NotACheckpointError, match=re.escape(f"not a checkpoint of this project: {path}")):
        run(TINY + ["trainer.max_steps=1", "trainer.resume=last"], tmp_path)


# ------------------------------------------------------------------------------------------ load
def test_workers_persist_and_see_each_epoch(tmp_path, trainer_loaders):
    """With workers, loaders keep them across epochs and evaluations; set_epoch reaches the workers' copy."""
    from tasks.common.data import WorkerEpoch  # noqa: PLC0415

    loaders = trainer_loaders
    run(TINY + ["trainer.max_steps=10", "trainer.num_workers=1"], tmp_path)  # 2 epochs, 2 evaluations
    assert len(loaders) == 2 and all(dl.persistent_workers for dl in loaders)
    # ... and fit ends them: they ignore SIGTERM, so workers left alive while a loader is still referenced
    # (here: the spy's list) would make the interpreter wait for them forever at exit
    assert all(dl._iterator is None for dl in loaders)
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]

    class EpochOf(torch.utils.data.Dataset):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return self.epoch

    data = WorkerEpoch(EpochOf())
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True)
    seen = []
    for epoch in range(3):
        data.set_epoch(epoch)
        seen += [int(x) for batch in loader for x in batch]
    stop_workers(loader)
    assert seen == [0, 0, 1, 1, 2, 2]


def test_train_log_holds_the_run(tmp_path):
    run(TINY + ["trainer.max_steps=3", "trainer.log_every=1"], tmp_path)
    text = (tmp_path / "train.log").read_text()
    for expected in ("model: ", "data: 512 train samples", "schedule: 3 steps", "step 2/3", "step 3: top1=",
                     "final: top1="):
        assert expected in text, (expected, text)


# ------------------------------------------------------------------------------------------ init_seed
def test_init_seed_draws_the_weights_and_leaves_the_data_to_the_run_seed(tmp_path):
    """``trainer.init_seed``: the initial weights of seed 1 (lr 0 keeps them: equal to a seed-1 run's), and
    everything else of seed 0 (set to the run's own seed, the loss lines equal a plain seed-0 run's)."""
    still = TINY + ["trainer.max_steps=1", "optim.lr=0", "optim.weight_decay=0"]
    run(still + ["seed=0", "trainer.init_seed=1"], tmp_path / "w1d0")
    run(still + ["seed=1"], tmp_path / "s1")
    run(still + ["seed=0"], tmp_path / "s0")
    a, b, c = (load(tmp_path / n / "checkpoints" / "last.pt")["model"] for n in ("w1d0", "s1", "s0"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
    moving = TINY + ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every_steps=100", "seed=0"]
    run(moving, tmp_path / "plain")
    run(moving + ["trainer.init_seed=0"], tmp_path / "same")
    assert losses(tmp_path / "same") == losses(tmp_path / "plain")
