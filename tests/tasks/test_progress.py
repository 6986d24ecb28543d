"""tasks.common.progress.ProgressLoader: the eval passes of train.py and eval.py show a bar with a rate and an ETA."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from tasks.common.progress import ProgressLoader


def _loader():
    return DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3, generator=torch.Generator())


def test_progress_loader_yields_the_loaders_batches_with_a_bar(capsys):
    loader = _loader()
    wrapped = ProgressLoader(loader, "eval @ step 7")
    assert len(wrapped) == 4 and wrapped.generator is loader.generator and wrapped.dataset is loader.dataset
    got = [b[0] for b in wrapped]
    assert all(torch.equal(a, b[0]) for a, b in zip(got, loader, strict=True))
    err = capsys.readouterr().err
    assert "eval @ step 7" in err and "/4 [" in err and "batch/s" in err  # total known: rate and ETA


def test_progress_loader_disabled_prints_nothing(capsys):
    got = list(ProgressLoader(_loader(), "eval", enabled=False))
    assert len(got) == 4 and capsys.readouterr().err == ""


def test_progress_loader_without_len():
    assert list(ProgressLoader(iter([1, 2, 3]), "eval")) == [1, 2, 3]
