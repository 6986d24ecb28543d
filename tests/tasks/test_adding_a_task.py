"""docs/adding_a_task.md, followed: its two files are the repository's (``examples/``), ``train.py`` trains the
task for two steps through its ``task.target`` exactly as the page says, and the checkpoint gives back the same
Task class and model, as ``eval.py`` rebuilds them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "adding_a_task.md")
FILES = {"python": os.path.join(ROOT, "examples", "bars_task.py"),
         "yaml": os.path.join(ROOT, "examples", "configs", "task", "bars.yaml")}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", open(DOC).read(), flags=re.S)


def test_the_page_shows_the_two_files_as_they_are():
    for lang, path in FILES.items():
        assert open(path).read() in _blocks(lang), f"docs/adding_a_task.md shows another {path}"
    assert "python train.py --config-dir examples/configs task=bars attn=linear" in _blocks("bash")[0]


def test_the_bars_images_are_the_labels_they_say():
    from examples.bars_task import BarImages

    data = BarImages(64, 16, noise=0.0, seed=0)
    again = BarImages(64, 16, noise=0.0, seed=0)
    assert torch.equal(data.images, again.images) and set(data.labels.tolist()) == {0, 1}
    for image, label in (data[i] for i in range(len(data))):
        rows, cols = image[0].sum(dim=1), image[0].sum(dim=0)  # a horizontal bar fills two rows
        full = rows if label == 0 else cols
        assert sorted(full.tolist())[-2:] == [16.0, 16.0] and (full > 0).sum() == 2


def test_train_py_trains_the_task_through_its_target(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config-dir", "examples/configs", "task=bars", "attn=linear",
           "logger=none", "trainer.device=cpu", "trainer.max_steps=2", "trainer.max_epochs=null",
           "trainer.progress_bar=false", "trainer.count_flops=false", "data.num_train=128", "data.num_eval=64",
           "model.depth=1", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = next(line for line in proc.stdout.splitlines() if line.startswith("final: "))
    metrics = dict(kv.split("=") for kv in final[len("final: "):].split())
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0 and float(metrics["loss"]) > 0

    from tasks.common.evaluation import load_run  # noqa: PLC0415  (as eval.py rebuilds a checkpoint's run)

    cfg, task, model, _ = load_run(str(run_dir / "checkpoints" / "last.pt"))
    assert type(task).__name__ == "BarsTask" and cfg.task.target == "examples.bars_task.BarsTask"
    assert task.attention.name == "linear" and int(cfg.model.num_classes) == 2
    logits = model(torch.zeros(3, 1, 32, 32))
    assert logits.shape == (3, 2)
