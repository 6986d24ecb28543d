"""FSDP2 (``trainer.strategy=fsdp``) and multi-node launches, on the CPU: 2 processes under ``torchrun`` with
gloo.

* classification (MNIST, a 2-block ViT of width 16 with MHLA, EMA evaluated beside the model, gradient
  clipping that bites) and the LM task (``lm_mini``, 2 blocks of width 32 with MHLA, on a local text folder;
  greedy samples at the end): the FSDP run's loss curve, evaluations and final weights equal a single-process
  run with the same global batch, and an FSDP run interrupted at step 3 and resumed ends bit-identical to the
  uninterrupted FSDP run;
* the checkpoint of an FSDP run (a DCP folder, ``last.dcp``, each rank writing its shards) reads on one
  process as the dict a single process saves (same keys, optimizer layout, EMA), and ``eval.py``'s evaluation
  of it reproduces the run's metrics; a run resumes across strategies (one process's ``last.pt`` under FSDP,
  an FSDP run's ``last.dcp`` on one process); ``trainer.precision=bf16`` under FSDP (MixedPrecisionPolicy)
  runs and follows the fp32 curve;
* multi-node: the classification runs are one launch of two ``torchrun`` launchers with ``--nnodes 2`` (one
  process each, a c10d rendezvous on localhost: two nodes on one machine); the default run folder is one
  folder agreed by both nodes, global rank 0 alone writes it, and the ranks know their node from torchrun's
  variables. The LM runs are one single-node launch (``--standalone --nproc_per_node 2``).

Tolerance of "equal" (FSDP vs one process): the ranks' gradients are averaged by a reduce-scatter instead of
one mean over the global batch, so float sums run in another order. Measured: train losses and gradient
norms within 2.1e-7 relative, eval losses within 1.1e-7, weights within 1.3e-7 (MNIST) and 3.4e-6 (LM)
absolute after 6 AdamW steps; asserted: losses, gradient norms and eval losses rtol 1e-5, weights atol 5e-5
(rtol 1e-4). Resumed vs uninterrupted FSDP runs: exact (every tensor of the checkpoint,
every logged loss).

Each ``torchrun`` launch runs several runs in a row (``tests/helpers/trainer_runs.py``), one thread per
process.
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
#: the tests that use the torchrun launches (two for the whole module; the file took 2.5 min on the 2 shared
#: cores at load average 14): part of ``make test``, left out by ``make test-fast``
SLOW = pytest.mark.slow

# 128 samples: 4 steps per epoch at global batch 32, so 6 steps cross an epoch and the resume at 3 crosses it;
# 97 eval samples in batches of 16: rank 0 runs 4 eval batches, rank 1 three (the gathered evaluation allows
# it)
CLS = ["logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "trainer.device=cpu",
       "data.limit=128", "data.eval_limit=97", "data.eval_batch_size=16", "model.embed_dim=16",
       "model.depth=2", "model.num_heads=2", "trainer.max_steps=6", "trainer.log_every=1",
       "trainer.eval_every_steps=3", "trainer.ema.enabled=true", "trainer.ema.evaluate=both",
       "trainer.grad_clip=0.05", "trainer.strategy=fsdp"]
DROP_PATH = ["model.drop_path_rate=0.1"]  # the resume pair: per-rank RNG states restored


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run_single(overrides, run_dir):
    from train import run as train_run  # noqa: PLC0415

    return train_run(make_cfg(overrides), str(run_dir))


def load(run_dir, which="last"):
    """The run's ``last`` checkpoint (``.pt`` or an FSDP run's ``.dcp`` folder) as one dict."""
    from tasks.common.checkpoint import find_checkpoint, load_checkpoint  # noqa: PLC0415

    return load_checkpoint(find_checkpoint(run_dir, which))


def records(run_dir, key):
    """step -> value of ``key`` in metrics.jsonl."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if key in rec:
                out[rec["step"]] = rec[key]
    return out


def assert_curves_close(one, fsdp, keys):
    for key in keys:
        a, b = records(one, key), records(fsdp, key)
        assert sorted(a) == sorted(b) and a, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5), (key, step)


def assert_states_close(a: dict, b: dict, atol=5e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=1e-4, atol=atol, msg=k)


def assert_states_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_optimizers_equal(a: dict, b: dict):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert_states_equal(a["state"][i], b["state"][i])


# ------------------------------------------------------------------------------------------ sharding rule
def test_shard_units_are_the_repeated_blocks():
    import torch.nn as nn  # noqa: PLC0415

    from tasks.classification.task import ClassificationTask  # noqa: PLC0415
    from tasks.common.fsdp import shard_units  # noqa: PLC0415
    from helpers.lm_configs import lm_config  # noqa: PLC0415

    vit = ClassificationTask(make_cfg(["model.embed_dim=16", "model.depth=3", "model.num_heads=2"]))
    vit = vit.build_model()
    assert shard_units(vit) == list(vit.blocks)  # timm: blocks = Sequential(Block, ...)

    from models.lm import MHLALMForCausalLM  # noqa: PLC0415

    lm = MHLALMForCausalLM(lm_config("mhla", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_heads=2,
                                     block_size=4))
    assert [type(u).__name__ for u in shard_units(lm)] == ["MHLALMBlock"] * 2  # _no_split_modules

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))  # mixed classes: no
            # inside a unit: not a unit of its own
            self.inner = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # leaf layers, not blocks
            self.layers = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(4, 2)

    from tasks.video_gen.task import VideoGenTask  # noqa: PLC0415

    wan = VideoGenTask(make_cfg(["task=video_mini"])).build_model()  # diffusers WanTransformer3DModel inside
    blocks = len(wan.transformer.blocks)
    assert [type(u).__name__ for u in shard_units(wan)] == ["WanTransformerBlock"] * blocks
    assert make_cfg(["task=wan_finetune"]).trainer.strategy == "fsdp"  # the Wan recipe asks for FSDP

    net = Net()
    assert shard_units(net) == list(net.layers)
    assert shard_units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == []


def test_strategy_is_checked_at_start(tmp_path):
    from tasks.common.config import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="trainer.strategy must be ddp or fsdp"):
        run_single(CLS + ["data.batch_size=32", "trainer.strategy=zero3"], tmp_path)


# ------------------------------------------------------------------------------------------ classification
@pytest.fixture(scope="module")
def cls_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_cls")
    names = ("single", "fsdp", "straight", "split", "to_fsdp", "from_fsdp", "bf16")
    dirs = {name: tmp / name for name in names}
    torch.set_num_threads(1)
    # 16 x 2 processes: the same global batch as 32 on one
    one, two = CLS + ["data.batch_size=32"], CLS + ["data.batch_size=16"]
    run_single(one, dirs["single"])
    run_single(one + ["trainer.stop_after_steps=3"], dirs["to_fsdp"])  # last.pt at step 3, resumed under FSDP
    launchers = run_torchrun([(None, two),  # "fsdp": the default run folder
                              (dirs["straight"], two + DROP_PATH),
                              (dirs["split"], two + DROP_PATH + ["trainer.stop_after_steps=3"]),
                              (dirs["split"], two + DROP_PATH + ["trainer.resume=last"]),
                              (dirs["to_fsdp"], two + ["trainer.resume=last"]),
                              (dirs["from_fsdp"], two + ["trainer.stop_after_steps=3"]),
                              (dirs["bf16"], two + ["trainer.precision=bf16"])], tmp, nodes=2)
    (dirs["fsdp"],) = (tmp / "outputs" / "mnist" / "vit_mnist-mhla").iterdir()  # one folder for both nodes
    dirs["launchers"] = launchers
    run_single(one + ["trainer.resume=last"], dirs["from_fsdp"])  # last.dcp at step 3, resumed on one process
    return dirs


@SLOW
def test_fsdp_classification_equals_one_process(cls_runs):
    one, fsdp = cls_runs["single"], cls_runs["fsdp"]
    assert_curves_close(one, fsdp, ["train/loss", "train/grad_norm", "eval/loss", "eval/ema_loss"])
    assert min(records(fsdp, "train/grad_norm").values()) > 0.05  # the clip (0.05) bites at every step
    for key in ("eval/top1", "eval/ema_top1", "eval/top5"):  # at most one of the 97 samples flips
        a, b = records(one, key), records(fsdp, key)
        assert all(abs(a[s] - b[s]) <= 1.01 / 97 for s in a), key
    a, b = load(one), load(fsdp)
    assert a["step"] == b["step"] == 6
    assert_states_close(a["model"], b["model"])
    assert_states_close(a["ema"], b["ema"])  # the EMA of the sharded weights = the EMA of the whole ones
    assert sorted(os.listdir(fsdp / "checkpoints")) == ["best.dcp", "last.dcp"]
    assert sorted(f for f in os.listdir(fsdp / "checkpoints" / "last.dcp") if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its shards
    train_log = (fsdp / "train.log").read_text()
    assert "FSDP2 over 2 processes: sharded 2 blocks (Block), then the rest of the model" in train_log


@SLOW
def test_fsdp_classification_resume_is_bit_identical(cls_runs):
    straight, split = cls_runs["straight"], cls_runs["split"]
    a, b = load(straight), load(split)
    assert a["step"] == b["step"] == 6
    assert_states_equal(a["model"], b["model"])
    assert_states_equal(a["ema"], b["ema"])
    assert_optimizers_equal(a["optimizer"], b["optimizer"])
    assert a["rng"] is not None and len(b["rng"]) == 2  # one RNG state per rank
    assert records(split, "train/loss") == records(straight, "train/loss")  # steps 1-6, bit-identical
    assert list(records(split, "train/loss")) == [1, 2, 3, 4, 5, 6]
    assert records(split, "eval/ema_loss") == records(straight, "eval/ema_loss")
    assert "resumed from" in (split / "train.log").read_text()
    # drop-path made the runs differ from the plain one: the RNG states mattered
    assert records(straight, "train/loss") != records(cls_runs["fsdp"], "train/loss")


@SLOW
def test_fsdp_mixed_precision(cls_runs):
    """``trainer.precision=bf16`` under FSDP (MixedPrecisionPolicy; gloo runs it on the CPU too): bf16 weights
    in the forward and backward, fp32 gradient reduction, fp32 master weights in the checkpoint; the losses
    follow the fp32 single-process run to bf16's precision (measured: 4.4e-5 relative at most over the 6
    steps; asserted: 2e-3)."""
    run = cls_runs["bf16"]
    assert "bf16 parameters, fp32 gradient reduction" in (run / "train.log").read_text()
    assert all(v.dtype == torch.float32 for v in load(run)["model"].values() if v.is_floating_point())
    a, b = records(cls_runs["single"], "train/loss"), records(run, "train/loss")
    assert sorted(a) == sorted(b) and all(b[s] == pytest.approx(a[s], rel=2e-3) for s in a)


@SLOW
def test_resume_across_strategies(cls_runs):
    """One process's ``last.pt`` resumed under FSDP, and an FSDP run's ``last.dcp`` resumed on one process,
    end where the single-process run ends (to the tolerance of FSDP vs one process)."""
    single = load(cls_runs["single"])
    for name, fmt in (("to_fsdp", ".dcp"), ("from_fsdp", ".pt")):
        run = cls_runs[name]
        state = load(run)
        assert state["step"] == 6 and os.path.exists(run / "checkpoints" / f"last{fmt}"), name
        assert_states_close(single["model"], state["model"])
        assert_states_close(single["ema"], state["ema"])
        assert_curves_close(cls_runs["single"], run, ["train/loss", "eval/loss"])
        assert "resumed from" in (run / "train.log").read_text()


@SLOW
def test_fsdp_checkpoint_is_the_single_process_file(cls_runs):
    one, fsdp = load(cls_runs["single"]), load(cls_runs["fsdp"])
    assert one.keys() == fsdp.keys()
    assert list(one["model"]) == list(fsdp["model"])
    assert set(one["ema"]) == set(fsdp["ema"])
    # the optimizer state keyed by parameter index with the same groups, as optimizer.state_dict() has it
    assert list(one["optimizer"]["state"]) == list(fsdp["optimizer"]["state"])
    for ga, gb in zip(one["optimizer"]["param_groups"], fsdp["optimizer"]["param_groups"], strict=True):
        assert ga == gb
    for i, s in one["optimizer"]["state"].items():
        assert s.keys() == fsdp["optimizer"]["state"][i].keys()
        assert_states_close(s, fsdp["optimizer"]["state"][i])
    assert all(not v.is_cuda and type(v) is torch.Tensor for v in fsdp["model"].values())  # plain tensors

    from tasks.common.evaluation import evaluate_checkpoint  # noqa: PLC0415

    final = records(cls_runs["fsdp"], "eval/ema_loss")[6]
    assert evaluate_checkpoint(str(cls_runs["fsdp"] / "checkpoints" / "last.dcp"))["loss"] == pytest.approx(
        final, rel=1e-5)
    best = load(cls_runs["fsdp"], "best")  # best.dcp: the step with the best eval top-1
    top1 = records(cls_runs["fsdp"], "eval/top1")
    assert best["step"] in (3, 6) and best["best_metric"] == max(top1.values())


# ------------------------------------------------------------------------------------------ LM
@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    import numpy as np  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("fsdp_lm")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ("the cat sat on a mat while dogs ran past quick brown foxes under green trees near old "
             "houses").split()
    for i in range(40):
        (corpus / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, size=120)) + ".")
    lm = ["task=lm_mini", "model=lm_mini", "attn=mhla", "logger=none", "data=text_local",
          f"data.path={corpus}", f"data.cache_dir={tmp / 'cache'}", "data.vocab_size=300",
          "data.val_fraction=0.2", "data.seq_len=32", "data.eval_batch_size=8", "model.hidden_size=32",
          "model.num_hidden_layers=2", "model.num_heads=2", "attn.block_size=8", "trainer.max_steps=6",
          "trainer.eval_every_steps=3", "trainer.log_every=1", "trainer.progress_bar=false",
          "trainer.device=cpu", "trainer.grad_clip=0.1", "trainer.strategy=fsdp", "task.num_samples=1",
          "task.prompt_len=8", "task.sample_tokens=8"]
    dirs = {name: tmp / name for name in ("single", "straight", "split")}
    torch.set_num_threads(1)
    run_single(lm + ["data.batch_size=8"], dirs["single"])  # also writes the tokenizer and token caches
    two = lm + ["data.batch_size=4"]
    run_torchrun([(dirs["straight"], two),
                  (dirs["split"], two + ["trainer.stop_after_steps=3"]),
                  (dirs["split"], two + ["trainer.resume=last"])], tmp)
    return dirs


@SLOW
def test_fsdp_lm_equals_one_process(lm_runs):
    one, fsdp = lm_runs["single"], lm_runs["straight"]
    assert_curves_close(one, fsdp, ["train/loss", "train/grad_norm", "eval/val_loss"])
    a, b = load(one), load(fsdp)
    assert_states_close(a["model"], b["model"])  # tied embeddings: both names, as one process saves them
    assert "lm_head.weight" in b["model"] and "model.embed_tokens.weight" in b["model"]
    mixing = [v for k, v in b["model"].items() if k.endswith("mixing.raw")]
    assert mixing and all(0 <= m.min() and m.max() <= 1 for m in mixing)  # the clamp hook ran on the shards
    # after_fit: rank 0 sampled alone from the gathered weights (transformers' generate, no deadlock)
    assert (fsdp / "samples.txt").read_text().count("greedy continuation") == 1
    assert "sharded 2 blocks (MHLALMBlock)" in (fsdp / "train.log").read_text()


@SLOW
def test_fsdp_lm_resume_is_bit_identical(lm_runs):
    straight, split = lm_runs["straight"], lm_runs["split"]
    a, b = load(straight), load(split)
    assert a["step"] == b["step"] == 6
    assert_states_equal(a["model"], b["model"])
    assert_optimizers_equal(a["optimizer"], b["optimizer"])
    assert records(split, "train/loss") == records(straight, "train/loss")
    assert list(records(split, "train/loss")) == [1, 2, 3, 4, 5, 6]
    assert records(split, "eval/val_loss") == records(straight, "eval/val_loss")


# ------------------------------------------------------------------------------------------ multi-node
@SLOW
def test_two_nodes_on_one_machine_write_one_run_folder(cls_runs):
    """The classification launch was two ``torchrun --nnodes 2 --nproc_per_node 1`` launchers (two elastic
    agents, as on two machines): the default run folder is one, named by the launch (the same start time and
    launcher id on both nodes), written by global rank 0 alone."""
    run_dir = cls_runs["fsdp"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["best.dcp", "last.dcp"]
    launcher = run_dir.name.rsplit("_", 1)[1]
    assert launcher.isdigit() and int(launcher) in cls_runs["launchers"]  # one node's agent names it
    # global rank 0 alone writes: each line of train.log once; the ranks read their node from torchrun's
    # variables
    lines = (run_dir / "train.log").read_text().splitlines()
    assert sum("torchrun: 2 processes on 2 nodes (1 per node), trainer.strategy=fsdp" in line
               for line in lines) == 1
    assert sum("step 6: top1=" in line for line in lines) == 1


# ------------------------------------------------------------------------------------------ DCP folders
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: what we want
def test_dcp_folders_replace_atomically_and_recover(tmp_path):
    """``CheckpointManager.save_sharded`` on one process (DCP needs no process group): ``last.dcp`` replaced
    whole at each save, ``best.dcp`` a copy when the metric improves; a save stopped between its renames (only
    ``.last.dcp.old`` left) and a temp folder of a killed save are put right at the next start."""
    import torch.nn as nn  # noqa: PLC0415

    from tasks.common.checkpoint import CheckpointManager, find_checkpoint, load_checkpoint  # noqa: PLC0415
    from tasks.common.config import resume_run_dir  # noqa: PLC0415
    from tasks.common.fsdp import sharded_state  # noqa: PLC0415

    run = tmp_path / "run"
    folder = run / "checkpoints"
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = CheckpointManager(folder, monitor="top1", mode="max", sharded=True)

    def save(step, top1):
        with torch.no_grad():
            model.weight.fill_(step)
        state = {"step": step, "config": {}, "scheduler": {}, "rng": [], "ema_num_updates": None}
        return ckpt.save_sharded(sharded_state(model, opt, None), state, {"top1": top1}, step, True)

    assert save(1, 0.5) and not save(2, 0.4)
    last, best = load_checkpoint(folder / "last.dcp"), load_checkpoint(folder / "best.dcp")
    assert (last["step"], best["step"], best["best_metric"]) == (2, 1, 0.5)
    assert torch.equal(last["model"]["weight"], torch.full((2, 3), 2.0)) and last["ema"] is None
    optim = last["optimizer"]  # keyed by parameter index, as optimizer.state_dict()
    assert list(optim["state"]) == [0, 1] and optim["param_groups"][0]["params"] == [0, 1]
    assert find_checkpoint(run) == find_checkpoint(folder) == folder / "last.dcp"
    assert sorted(p.name for p in folder.iterdir()) == ["best.dcp", "last.dcp"]  # nothing left behind
    # trainer.resume=<run>/checkpoints/last.dcp goes on in that run's folder, as with last.pt
    assert resume_run_dir(str(folder / "last.dcp"), "new") == str(run)

    os.rename(folder / "last.dcp", folder / ".last.dcp.old")  # stopped between the renames
    (folder / ".last.dcp.step3.tmp").mkdir()  # a save killed while writing
    removed = CheckpointManager(folder, sharded=True).remove_stale_temp_files()
    assert [p.name for p in removed] == [".last.dcp.step3.tmp"]
    assert load_checkpoint(find_checkpoint(run))["step"] == 2
