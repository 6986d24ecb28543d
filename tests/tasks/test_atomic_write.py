"""tasks.common.fileio.atomic_write: the one atomic write (checkpoints, .npz batches, stats, caches)."""

import os

import numpy as np
import pytest
import torch

from tasks.common.checkpoint import atomic_save, load_checkpoint
from tasks.common.fileio import atomic_write


def test_file_appears_only_complete(tmp_path):
    path = tmp_path / "sub" / "out.txt"  # the folder is created
    seen = {}

    def write(tmp):
        assert os.path.dirname(tmp) == str(path.parent)  # same folder: os.replace is a rename
        assert not path.exists()
        with open(tmp, "w") as f:
            f.write("part one, ")
            f.flush()
            seen["mid"] = path.exists()
            f.write("part two")

    assert atomic_write(path, write) == path
    assert seen["mid"] is False
    assert path.read_text() == "part one, part two"
    assert sorted(os.listdir(path.parent)) == ["out.txt"]


def test_replaces_old_file_only_when_done(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def write(tmp):
        with open(tmp, "w") as f:
            f.write("new")
        assert path.read_text() == "old"

    atomic_write(path, write, fsync=True)
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_error_in_write_fn_keeps_old_file_and_removes_temp(tmp_path, exc):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def write(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise exc("boom")

    with pytest.raises(exc, match="boom"):
        atomic_write(path, write)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_error_before_temp_exists_and_no_old_file(tmp_path):
    def write(tmp):
        raise ValueError("nothing written")

    with pytest.raises(ValueError):
        atomic_write(tmp_path / "new.bin", write)
    assert os.listdir(tmp_path) == []


def test_suffix_for_writers_that_append_an_extension(tmp_path):
    arr = np.arange(6).reshape(2, 3)
    atomic_write(tmp_path / "a.npy", lambda tmp: np.save(tmp, arr), suffix=".tmp.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), arr)
    assert os.listdir(tmp_path) == ["a.npy"]


def test_atomic_save_failure_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"step": 1, "w": torch.ones(3)}, path)
    assert load_checkpoint(path)["step"] == 1
    with pytest.raises(Exception):
        atomic_save({"step": 2, "bad": lambda: None}, path)  # a lambda does not pickle
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["last.pt"]


def test_npz_and_stats_writers_leave_no_temp(tmp_path):
    from tasks.image_gen.metrics import save_reference_stats
    from tasks.image_gen.npz import load_npz, save_npz

    imgs = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    assert save_npz(imgs, tmp_path / "s.npz") == str(tmp_path / "s.npz")
    np.testing.assert_array_equal(load_npz(tmp_path / "s.npz"), imgs)
    stats = {"mu": np.zeros(3), "sigma": np.eye(3)}
    ref = str(tmp_path / "ref_stats.npz")
    assert save_reference_stats(stats, ref, source="x") == ref
    with np.load(tmp_path / "ref_stats.npz") as d:
        np.testing.assert_array_equal(d["sigma"], np.eye(3))
        assert str(d["source"]) == "x"
    assert sorted(os.listdir(tmp_path)) == ["ref_stats.npz", "s.npz"]


def test_token_file_writer_is_atomic(tmp_path):
    from tasks.language.data import write_token_file

    class Tok:  # a character-level stand-in: ids are ord(c) % 50, EOS = 99
        eos_token_id = 99

        def __len__(self):
            return 100

        def __call__(self, docs, add_special_tokens=False):
            return {"input_ids": [[ord(c) % 50 for c in d] for d in docs]}

    path = tmp_path / "tok" / "train.bin"
    assert write_token_file(["ab", "c"], Tok(), path, batch=1) == 5
    assert np.fromfile(path, dtype=np.uint16).tolist() == [47, 48, 99, 49, 99]

    def broken():
        yield "ab"
        raise RuntimeError("reader died")

    with pytest.raises(RuntimeError, match="reader died"):
        write_token_file(broken(), Tok(), path, batch=1)
    assert np.fromfile(path, dtype=np.uint16).tolist() == [47, 48, 99, 49, 99]
    assert os.listdir(path.parent) == ["train.bin"]
