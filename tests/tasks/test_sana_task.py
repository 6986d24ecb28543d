"""SANA fine-tuning task (tasks/image_gen/sana_task.py): caption masks reach the transformer as the sampler passes
them, caption dropout to the unconditional embedding (negative.pt, or one zero token), evaluation never drops.
Tiny sana_tiny + MHLA models on CPU; the sana_mini training run itself is the ``run`` fixture of test_sana_sample."""

from __future__ import annotations

import os

import pytest
import torch
from hydra import compose, initialize_config_dir

from tasks.common.flow_matching import flow_matching_loss
from tasks.image_gen.sana_prompts import load_negative
from tasks.image_gen.sana_sampling import make_velocity
from tasks.image_gen.sana_task import LatentFolder, SanaFinetuneTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
D, C, S = 32, 8, 8  # sana_tiny: caption channels, latent channels, latent size


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_task(*overrides) -> SanaFinetuneTask:
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["task=sana_mini", "attn=mhla", "logger=none", *overrides])
    return SanaFinetuneTask(cfg)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_task().build_model().eval()


def write_root(root, lengths=(5, 3, 5, 4), negative=True):
    """``.pt`` files with captions of the given lengths (the last token of each masked out) + ``negative.pt``
    ``{"text": [3, D], "mask": [1, 1, 0]}``; returns the negative's ``(text, mask)``."""
    g = torch.Generator().manual_seed(1)
    os.makedirs(root, exist_ok=True)
    for i, n in enumerate(lengths):
        mask = torch.ones(n, dtype=torch.long)
        mask[-1] = 0
        torch.save({"latent": torch.randn(C, S, S, generator=g), "text": torch.randn(n, D, generator=g), "mask": mask},
                   os.path.join(root, f"{i:05d}.pt"))
    neg = (torch.randn(3, D, generator=g), torch.tensor([1, 1, 0]))
    if negative:
        torch.save({"text": neg[0], "mask": neg[1]}, os.path.join(root, "negative.pt"))
    return neg


def batch_of(root, task):
    ds = LatentFolder(str(root))
    return task.collate([ds[i] for i in range(len(ds))])


@torch.no_grad()
def fixed_loss(task, model, batch, seed=0):
    return task._loss(model, batch, generator=torch.Generator().manual_seed(seed))


def test_folder_reads_masks_skips_negative_and_collate_pads(tmp_path):
    write_root(tmp_path)
    torch.save({"latent": torch.randn(C, S, S), "text": torch.randn(2, D)}, tmp_path / "nomask.pt")
    ds = LatentFolder(str(tmp_path))
    assert len(ds) == 5 and not any(f.endswith("negative.pt") for f in ds.files)
    assert ds[4][2].tolist() == [1, 1]                          # no "mask": all ones
    x0, text, mask = make_task().collate([ds[i] for i in range(5)])
    assert x0.shape == (5, C, S, S) and text.shape == (5, 5, D) and mask.dtype == torch.long
    assert mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert text[1, 3:].abs().sum() == 0                         # padding is zeros


def test_mask_reaches_the_transformer_as_in_the_sampler(tmp_path, model):
    write_root(tmp_path)
    task = make_task()
    batch = batch_of(tmp_path, task)
    base = fixed_loss(task, model, batch)
    masked, unmasked = [b.clone() for b in batch], [b.clone() for b in batch]
    masked[1][0, 4] += 10.0                                     # row 0: token 4 is masked out
    unmasked[1][0, 1] += 10.0
    torch.testing.assert_close(fixed_loss(task, model, masked), base, rtol=1e-6, atol=1e-7)
    assert abs(float(fixed_loss(task, model, unmasked)) - float(base)) > 1e-5
    # the same call as the sampler's velocity (tasks.image_gen.sana_sampling.make_velocity)
    velocity = make_velocity(model)
    x0, text, mask = batch
    ref = flow_matching_loss(lambda xt, tt: velocity(xt, tt, (text, mask)), x0, shift=4.0, distribution="logit_normal",
                             generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(base, ref, rtol=0, atol=0)


def test_caption_dropout_one_is_the_loss_of_the_negative_embedding(tmp_path, model):
    nt, nm = write_root(tmp_path)
    task = make_task(f"task.data_root={tmp_path}", "task.caption_dropout=1.0")
    x0, text, mask = batch_of(tmp_path, task)
    b = x0.shape[0]
    torch.manual_seed(3)
    loss, logs = task.training_loss(model, [x0, text, mask])
    torch.manual_seed(3)
    ref = task._loss(model, [x0, nt[None].expand(b, -1, -1), nm[None].expand(b, -1)])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    assert float(logs["caption_dropped"]) == 1.0
    torch.manual_seed(3)
    plain = task._loss(model, [x0, text, mask])
    assert abs(float(plain.detach()) - float(loss.detach())) > 1e-5  # dropping the caption matters


def test_caption_dropout_zero_is_the_plain_loss(tmp_path, model):
    write_root(tmp_path)
    task = make_task(f"task.data_root={tmp_path}", "task.caption_dropout=0.0")
    batch = batch_of(tmp_path, task)
    torch.manual_seed(3)
    loss, logs = task.training_loss(model, batch)
    after = torch.rand(1)
    torch.manual_seed(3)
    ref = task._loss(model, batch)
    assert torch.equal(loss, ref) and torch.equal(after, torch.rand(1))  # no extra RNG draw either
    assert float(logs["caption_dropped"]) == 0.0


def test_partial_dropout_is_seeded_and_substitutes_whole_rows(tmp_path):
    nt, nm = write_root(tmp_path)
    task = make_task(f"task.data_root={tmp_path}", "task.caption_dropout=0.25")
    text, mask = torch.randn(2000, 5, D), torch.ones(2000, 5, dtype=torch.long)
    torch.manual_seed(7)
    t1, m1, d1 = task.drop_captions(text, mask)
    torch.manual_seed(7)
    t2, m2, d2 = task.drop_captions(text, mask)
    assert torch.equal(d1, d2) and torch.equal(t1, t2) and torch.equal(m1, m2)
    assert 0.2 < d1.float().mean() < 0.3
    assert torch.equal(t1[d1][:, :3], nt.expand(int(d1.sum()), -1, -1)) and t1[d1][:, 3:].abs().sum() == 0
    assert m1[d1].tolist() == [[1, 1, 0, 0, 0]] * int(d1.sum())
    assert torch.equal(t1[~d1], text[~d1]) and torch.equal(m1[~d1], mask[~d1])


def test_evaluation_never_drops_captions(tmp_path, model):
    write_root(tmp_path)
    task0 = make_task(f"task.data_root={tmp_path}", "task.caption_dropout=0.0")
    task1 = make_task(f"task.data_root={tmp_path}", "task.caption_dropout=1.0")
    ds = LatentFolder(str(tmp_path))
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=task1.collate)
    r0 = task0.evaluate(model, loader, torch.device("cpu"), None)
    r1 = task1.evaluate(model, loader, torch.device("cpu"), None)
    assert r0 == r1
    batch = batch_of(tmp_path, task1)
    torch.manual_seed(0)
    l0 = task0.training_loss(model, batch)[0]
    torch.manual_seed(0)
    l1 = task1.training_loss(model, batch)[0]
    assert abs(float(l0.detach()) - float(l1.detach())) > 1e-5  # training does drop


def test_unconditional_fallback_is_one_zero_token_and_warns_for_a_real_root(tmp_path, capsys):
    write_root(tmp_path, negative=False)
    task = make_task(f"task.data_root={tmp_path}", "task.caption_dropout=0.1")
    task.build_datasets()
    assert "negative.pt not found" in capsys.readouterr().out
    nt, nm = task.negative_caption(D)
    assert torch.equal(nt, torch.zeros(1, D)) and nm.tolist() == [1]
    gen = make_task()                                           # generated data: same fallback, no warning
    assert gen.cfg.task.caption_dropout == 0.1
    train, _ = gen.build_datasets()
    x0, text, mask = gen.collate([train[i] for i in range(2)])
    assert mask.tolist() == [[1] * 8] * 2
    t, m, _ = gen.drop_captions(text, mask, p=1.0)
    assert t.abs().sum() == 0 and m.tolist() == [[1] + [0] * 7] * 2
    assert "warning" not in capsys.readouterr().out
    # the sampler's zeros negative is the same unconditional branch
    zt, zm = load_negative("zeros", D)
    assert torch.equal(zt, nt) and zm is None
