"""Gradient accumulation (``trainer.accumulate``): what ``auto`` resolves to, and that ``k`` micro-batches of ``b``
train as one batch of ``k x b``.

* resolution: ``auto`` forms the recipe's global batch (``task.global_batch`` or ``task.tokens_per_step``) from
  ``data.batch_size`` and the process count exactly, refuses one it cannot form (saying which numbers), is 1
  without a recipe batch (the CPU tasks and the ``scale=mini`` proxies), an integer forces it; the paper recipes'
  per-device batches form their global batch on 8 GPUs with 1 step and on one with 8;
* the sampler: the ``k`` micro-batches of an optimizer step hold the samples of one batch of ``k x b``;
* equality (MNIST, a 2-block ViT of width 16, drop-path 0.1, mixup 0.8 / cutmix 1.0, clipping at 0.05 that bites
  at every step, EMA evaluated beside the model, 6 steps across an epoch): one process with micro-batches of 8 x 4
  steps, and (torchrun, 2 gloo processes) DDP and FSDP2 with micro-batches of 4 x 2 processes x 4 steps, against
  one process with batches of 32: train losses, gradient norms (the norm of the summed gradient, which the clip
  uses), learning rates, eval losses and the weights and EMA after 6 steps. "Equal" needs both sides to draw the
  same random numbers; the stock task draws drop-path and mixup from the global RNG stream in batch order, so
  these runs use ``helpers.accum_task.SampleSeededClassificationTask``, whose draws the samples seed (its
  docstring). Tolerance: float sums run in another order (gradients summed over micro-batches and ranks instead
  of one batched reduction): measured losses and gradient norms within 1.2e-7 relative (one process) and 2.1e-7
  (DDP, FSDP2), weights and EMA within 1.9e-6 and 3.3e-6 absolute; asserted 1e-5 relative, weights atol 5e-5
  (rtol 1e-4), as ``test_fsdp.py``;
* stop / resume in the middle of an accumulation cycle: SIGTERM at the second micro-batch of step 3 finishes the
  step, saves it and stops; the resumed run ends bit-identical to the uninterrupted one (weights, EMA, every
  logged loss), with the stock task (drop-path and mixup from the RNG stream) on one process and with FSDP2.
"""

import json
import os

import pytest
import torch
from helpers.torchrun import run_torchrun
from hydra import compose, initialize_config_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

pytestmark = pytest.mark.usefixtures("one_thread")

# 128 samples at global batch 32: 4 steps per epoch, so 6 steps cross an epoch (and the resume at 3 crosses it)
BASE = ["logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "trainer.device=cpu",
        "data.limit=128", "data.eval_limit=64", "data.eval_batch_size=32", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every_steps=3",
        "trainer.ema.enabled=true", "trainer.ema.evaluate=both", "trainer.grad_clip=0.05",
        "model.drop_path_rate=0.1", "+task.mixup.mixup_alpha=0.8", "+task.mixup.cutmix_alpha=1.0"]
SEEDED = "task.target=helpers.accum_task.SampleSeededClassificationTask"
STOPPING = "task.target=helpers.accum_task.StoppingClassificationTask"
# the mixup groups: what each of 2 processes holds of a global micro-batch of 8 (helpers/accum_task.py)
ONE_PROCESS_GROUPS = [SEEDED, "+task.chunk_block=8", "+task.chunk_stride=2"]
TWO_PROCESS_GROUPS = [SEEDED, "+task.chunk_block=4", "+task.chunk_stride=1"]
SIGNAL_MID_CYCLE = "+task.signal_at_batch=10"  # one process, 4 micro-batches per step: step 3's second


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run(overrides, run_dir):
    from train import run as train_run  # noqa: PLC0415

    return train_run(make_cfg(overrides), str(run_dir))


def load(run_dir):
    from tasks.common.checkpoint import find_checkpoint, load_checkpoint  # noqa: PLC0415

    return load_checkpoint(find_checkpoint(run_dir, "last"))


def records(run_dir, key) -> dict:
    """step -> value of ``key`` in metrics.jsonl."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if key in rec:
                out[rec["step"]] = rec[key]
    return out


def assert_curves_close(a_dir, b_dir, keys=("train/loss", "train/grad_norm", "train/lr", "eval/loss",
                                            "eval/ema_loss")):
    for key in keys:
        a, b = records(a_dir, key), records(b_dir, key)
        assert sorted(a) == sorted(b) and a, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5), (key, step)


def assert_weights_close(a: dict, b: dict):
    assert a["step"] == b["step"] == 6
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            torch.testing.assert_close(b[part][k].float(), a[part][k].float(), rtol=1e-4, atol=5e-5,
                                       msg=f"{part}.{k}")


def assert_bit_identical(a_dir, b_dir):
    a, b = load(a_dir), load(b_dir)
    assert a["step"] == b["step"] == 6
    for part in ("model", "ema"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k}"
    assert records(a_dir, "train/loss") == records(b_dir, "train/loss")


# ------------------------------------------------------------------------------------------ resolution
def accumulation(overrides, world_size=1):
    from tasks.common.config import resolve_accumulation  # noqa: PLC0415

    return resolve_accumulation(make_cfg(overrides), world_size)


def test_auto_forms_the_recipe_global_batch_exactly():
    assert accumulation(["task=imagenet"], 2) == 4  # 1024 = 128 x 2 x 4
    assert accumulation(["task=imagenet"], 8) == 1
    assert accumulation(["task=imagenet", "data.batch_size=32"], 1) == 32
    assert accumulation(["task=imagenet", "trainer.accumulate=3"], 2) == 3  # forced
    assert accumulation(["task=mnist"], 4) == 1  # no recipe batch
    # tokens per step: whole sequences of data.seq_len
    assert accumulation(["task=lm_fineweb", "task.global_batch=null", "+task.tokens_per_step=262144"], 1) == 8
    assert accumulation(["task=lm_fineweb", "+task.tokens_per_step=262144"], 4) == 2  # = 128 sequences: agrees


def test_the_paper_recipes_form_their_global_batch():
    """Each recipe's per-device batch forms its global batch on the paper's 8 GPUs without accumulation, and on
    one process with 8 accumulation steps; the CPU tasks and the mini proxies state none (1)."""
    for task in ("imagenet", "imagenet_gen", "lm_fineweb", "sana_finetune"):
        assert accumulation([f"task={task}"], 8) == 1, task
        assert accumulation([f"task={task}"], 1) == 8, task
    for task in ("mnist", "mnist_gen", "lm_mini", "mqar", "video_mini", "sana_mini", "wan_finetune"):
        assert accumulation([f"task={task}"], 1) == 1, task
    for cell, scale in (("table2/deit_t_mhla", "deit_t"), ("table13/deit_t_384_mhla", "deit_t"),
                        ("table3/dit_b2_256_mhla", "dit_b"), ("table4/sana_600m_mhla", "sana_600m")):
        assert accumulation([f"experiment={cell}", f"scale=mini/{scale}"], 1) == 1, cell


@pytest.mark.parametrize("overrides,world,message", [
    (["data.batch_size=96"], 1, r"global batch 1024 \(task.global_batch=1024\) cannot be formed from "
                                r"data.batch_size=96 x 1 process = 96 per micro-step: .*data.batch_size=64 "
                                r"\(16 accumulation steps\)"),
    ([], 3, "the number of processes must divide 1024"),
    (["data.batch_size=256"], 8, r"256 x 8 processes = 2048 per micro-step.*data.batch_size=128 \(1 "),
    (["task.global_batch=100", "+task.tokens_per_step=4096"], 1, "disagree"),
])
def test_auto_refuses_a_global_batch_it_cannot_form(overrides, world, message):
    from tasks.common.config import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=message):
        accumulation(["task=imagenet" if "+task.tokens_per_step=4096" not in overrides else "task=lm_fineweb",
                      *overrides], world)


@pytest.mark.parametrize("value", [0, -2, "'many'", 1.5])
def test_bad_accumulate_fails_at_start(value):
    from tasks.common.config import ConfigError, check_trainer  # noqa: PLC0415

    with pytest.raises(ConfigError, match="trainer.accumulate must be auto"):
        check_trainer(make_cfg([f"trainer.accumulate={value}"]))


def test_micro_batches_of_a_step_hold_the_samples_of_one_batch():
    from tasks.common.data import ResumableSampler  # noqa: PLC0415

    one = list(ResumableSampler(100, 24, seed=3))  # 4 steps of 24, 4 samples dropped
    for world in (1, 2):
        ranks = [list(ResumableSampler(100, 3, rank=r, world_size=world, seed=3, accumulate=8 // world))
                 for r in range(world)]
        sampler = ResumableSampler(100, 3, world_size=world, seed=3, accumulate=8 // world)
        assert sampler.steps_per_epoch == 4 and sampler.batches_per_epoch == 4 * 8 // world
        for step in range(4):
            mine = [i for r in ranks for i in r[step * 24 // world:(step + 1) * 24 // world]]
            assert sorted(mine) == sorted(one[step * 24:(step + 1) * 24])
    skipped = ResumableSampler(100, 3, seed=3, accumulate=8)
    skipped.set_epoch(0, skip_batches=2 * 8)  # a resume at step 2: from its first micro-batch
    assert list(skipped) == one[48:96]
    with pytest.raises(ValueError, match=r"fewer than one global batch \(128 = 4 per device x 2 x 16 accumulation"):
        ResumableSampler(100, 4, world_size=2, accumulate=16)


def test_gradients_cross_processes_on_the_last_micro_batch_only():
    """DDP: ``no_sync`` around every micro-batch but the last; FSDP2: gradient sync off around them and back on
    after (the equality tests cannot see this: syncing every micro-batch gives the same sums, slower)."""
    import contextlib  # noqa: PLC0415
    from types import SimpleNamespace  # noqa: PLC0415

    from omegaconf import OmegaConf  # noqa: PLC0415

    from tasks.common.distributed import DistInfo  # noqa: PLC0415
    from tasks.common.fsdp import no_gradient_sync  # noqa: PLC0415
    from tasks.common.trainer import Trainer  # noqa: PLC0415

    class Model:
        calls: list = []

        def no_sync(self):
            return "ddp no_sync"

        def set_requires_gradient_sync(self, sync):
            self.calls.append(sync)

    trainer = Trainer.__new__(Trainer)
    trainer.dist, run = DistInfo(world_size=2), SimpleNamespace(wrapped=Model(), model=Model())
    trainer.tcfg = OmegaConf.create({"strategy": "ddp"})
    assert trainer._gradient_sync(run, sync=False) == "ddp no_sync"
    assert isinstance(trainer._gradient_sync(run, sync=True), contextlib.nullcontext)
    trainer.tcfg = OmegaConf.create({"strategy": "fsdp"})
    with trainer._gradient_sync(run, sync=False):
        assert Model.calls == [False]
    assert Model.calls == [False, True]
    assert isinstance(trainer._gradient_sync(run, sync=True), contextlib.nullcontext)
    with pytest.raises(RuntimeError), no_gradient_sync(run.model):  # sync back on after an error too
        raise RuntimeError
    assert Model.calls[-1] is True
    trainer.dist = DistInfo(world_size=1)
    assert isinstance(trainer._gradient_sync(run, sync=False), contextlib.nullcontext)


# ------------------------------------------------------------------------------------------ one process
@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """The reference (batches of 32), the same as 4 micro-batches of 8, and the stock task's accumulation run
    straight and stopped mid-cycle + resumed."""
    from tasks.common.trainer import TrainingInterrupted  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("accumulation")
    torch.set_num_threads(1)
    dirs = {name: tmp / name for name in ("batch32", "micro8", "straight", "split")}
    run(BASE + ONE_PROCESS_GROUPS + ["data.batch_size=32"], dirs["batch32"])
    run(BASE + ONE_PROCESS_GROUPS + ["data.batch_size=8", "trainer.accumulate=4"], dirs["micro8"])
    stock = BASE + ["data.batch_size=8", "trainer.accumulate=4"]
    run(stock, dirs["straight"])
    with pytest.raises(TrainingInterrupted) as stopped:
        run(stock + [STOPPING, SIGNAL_MID_CYCLE], dirs["split"])
    dirs["stopped_at"] = stopped.value.step
    dirs["checkpoint_step"] = load(dirs["split"])["step"]
    run(stock + [STOPPING, "trainer.resume=last"], dirs["split"])
    return dirs


def test_micro_batches_equal_one_batch(one_process_runs):
    runs = one_process_runs
    assert_curves_close(runs["batch32"], runs["micro8"])
    assert min(records(runs["micro8"], "train/grad_norm").values()) > 0.05  # the clip bites at every step
    assert_weights_close(load(runs["batch32"]), load(runs["micro8"]))
    log = (runs["micro8"] / "train.log").read_text()
    assert "global batch 32 = 8 x 1 process x 4 accumulation steps, 4 steps per epoch" in log
    assert "schedule: 6 steps (1.5 epochs)" in log
    with open(runs["micro8"] / "run.json") as f:
        assert json.load(f)["config"]["trainer"]["accumulate"] == 4  # the resolved count
    assert load(runs["micro8"])["config"]["trainer"]["accumulate"] == 4


def test_the_seeded_task_really_mixes_and_drops():
    """The equality above is not vacuous: the seeded task's model drops paths and its batches carry mixed
    (soft) targets."""
    from helpers.accum_task import SampleSeededClassificationTask, SeededDropPath  # noqa: PLC0415

    task = SampleSeededClassificationTask(make_cfg(BASE + ONE_PROCESS_GROUPS + ["data.batch_size=32"]))
    model = task.build_model()
    assert len([m for m in model.modules() if isinstance(m, SeededDropPath) and m.drop_prob > 0]) == 2
    train, _ = task.build_datasets()
    batch = task.collate([train[i] for i in range(8)])
    x, y, seeds = task.on_batch(batch, torch.device("cpu"))
    assert y.shape == (8, 10) and bool((y.max(dim=1).values < 1).any()) and len(set(seeds)) == 8
    assert task.groups(16) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_stop_mid_cycle_and_resume_equals_an_uninterrupted_run(one_process_runs):
    runs = one_process_runs
    assert runs["stopped_at"] == runs["checkpoint_step"] == 3  # the signal's step finished, saved
    assert_bit_identical(runs["straight"], runs["split"])
    assert "SIGTERM received: stopped at step 3/6" in (runs["split"] / "train.log").read_text()


def test_forced_accumulation_against_the_recipe_warns(tmp_path, capsys):
    run(BASE + ["data.batch_size=8", "trainer.accumulate=2", "+task.global_batch=32", "trainer.max_steps=1",
                "trainer.ema.enabled=false"], tmp_path)
    out = capsys.readouterr().out
    assert "global batch 16 = 8 x 1 process x 2 accumulation steps" in out
    assert ("WARNING: the recipe's global batch is 32 (task.global_batch=32) but this run uses 16 "
            "(trainer.accumulate=2)") in out


# ------------------------------------------------------------------------------------------ torchrun
@pytest.mark.slow  # one torchrun launch (as tests/tasks/test_fsdp.py's): left out by make test-fast
def test_ddp_and_fsdp_micro_batches_equal_one_batch(one_process_runs, tmp_path):
    """DDP and FSDP2, 2 gloo processes x micro-batches of 4 x 4 steps, against one process's batches of 32; an
    FSDP2 run stopped mid-cycle (rank 0's sixth micro-batch: step 2's second) and resumed equals its straight
    run bit for bit."""
    two = BASE + TWO_PROCESS_GROUPS + ["data.batch_size=4", "trainer.accumulate=auto", "+task.global_batch=32"]
    fsdp = two + ["trainer.strategy=fsdp"]
    dirs = {name: tmp_path / name for name in ("ddp", "fsdp", "split")}
    run_torchrun([(dirs["ddp"], two), (dirs["fsdp"], fsdp),
                  (dirs["split"], fsdp + ["+task.signal_at_batch=6"], True),
                  (dirs["split"], fsdp + ["trainer.resume=last"])], tmp_path)
    reference = one_process_runs["batch32"]
    for name in ("ddp", "fsdp"):
        assert_curves_close(reference, dirs[name])
        assert_weights_close(load(reference), load(dirs[name]))
    log = (dirs["ddp"] / "train.log").read_text()
    assert ("global batch 32 = 4 x 2 processes x 4 accumulation steps (trainer.accumulate=auto: "
            "task.global_batch=32)") in log
    assert "SIGTERM received: stopped at step 2/6" in (dirs["split"] / "train.log").read_text()
    assert_bit_identical(dirs["fsdp"], dirs["split"])
