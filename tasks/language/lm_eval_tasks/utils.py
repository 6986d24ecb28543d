"""Datasets of the local lm-eval tasks in this folder (``custom_dataset``): a jsonl file, one ``{"text": ...}``
per line, read into a ``datasets.DatasetDict`` with a single ``test`` split (nothing is downloaded or cached).

lm-eval calls ``custom_dataset(**metadata, **dataset_kwargs)``: the file comes from ``--metadata`` /
``TaskManager(metadata=...)`` or from the task's ``dataset_kwargs``.
"""

from __future__ import annotations

import json
import os


def _jsonl_dataset(path: str | None, key: str):
    if not path:
        raise ValueError(f"no data file: pass --metadata '{{\"{key}\": \"/path/file.jsonl\"}}' to lm_eval (or "
                         f"dataset_kwargs={{'{key}': ...}} in a task dict; see tasks/language/lm_eval_adapter.py)")
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}={path} does not exist")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or "text" not in rows[0]:
        raise ValueError(f"{path}: expected one {{\"text\": ...}} object per line")
    import datasets  # noqa: PLC0415

    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": r["text"]} for r in rows])})


def lambada_dataset(lambada_file: str | None = None, **_):
    return _jsonl_dataset(lambada_file, "lambada_file")


def text_dataset(text_file: str | None = None, **_):
    return _jsonl_dataset(text_file, "text_file")
