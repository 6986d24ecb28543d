"""LongBench (Bai et al. 2023) on local files: prompts, middle truncation, greedy generation, official metrics.

Reads the official ``data/<dataset>.jsonl`` files (from ``data.zip`` of the HF dataset ``THUDM/LongBench``; fields
``input, context, answers, all_classes, length, dataset, language, _id``) from a local folder, and follows the
official ``pred.py`` / ``eval.py`` (THUDM/LongBench, ``LongBench/`` folder):

* prompt = ``DATASET_PROMPT[dataset].format(context=..., input=...)`` (``config/dataset2prompt.json``);
* if the tokenized prompt is longer than ``max_length``, keep its first and last ``max_length // 2`` tokens
  (decoded and re-joined: "truncate in the middle, since the left and right side may contain crucial
  instructions");
* greedy decoding of at most ``DATASET_MAXLEN[dataset]`` new tokens (``config/dataset2maxlen.json``); for
  ``samsum`` a newline also stops generation; no chat template (base models);
* score with :mod:`tasks.language.longbench_metrics` (:func:`~tasks.language.longbench_metrics.score_dataset`).

Table 8's 14 tasks (:data:`TABLE8_TASKS`, in the paper's column order, grouped as in :data:`TABLE8_GROUPS`):
Multi-Doc QA (2WM, HQA, Mus: 2wikimqa, hotpotqa, musique), Single-Doc QA (QQA, NQA: qasper, narrativeqa),
Few-shot (SSM, TQA: samsum, triviaqa), Synthetic (PEN, PZH: passage_retrieval_en, passage_retrieval_zh),
Summarization (QMS, GvR, MNs: qmsum, gov_report, multi_news) and Code (RBP, LCC: repobench-p, lcc). PZH is
Chinese; LongBench scores it with ``retrieval_zh_score`` (the ``段落N`` id). The other Chinese datasets
(multifieldqa_zh, dureader, vcsum, lsht) are supported too; their QA-F1 / ROUGE-L segment words with jieba, as
LongBench does (:mod:`tasks.language.longbench_metrics`).

    python -m tasks.language.evaluate longbench --pretrained /ckpt/mhla-340m --data /data/LongBench/data \\
        --max-length 2048 --out results/longbench/mhla
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tqdm.auto import tqdm

from .eval_ppl import encode
from .lm_eval_adapter import greedy_generate_batch
from .longbench_metrics import score_dataset

# The official prompt templates (THUDM/LongBench, LongBench/config/dataset2prompt.json).
DATASET_PROMPT = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# Maximum new tokens per dataset (THUDM/LongBench, LongBench/config/dataset2maxlen.json).
DATASET_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
    "multifieldqa_zh": 64, "dureader": 128, "vcsum": 512, "lsht": 64, "passage_retrieval_zh": 32,
}

# Table 8's column groups and abbreviations (paper) -> LongBench dataset names, in the paper's column order.
TABLE8_GROUPS = {
    "Multi-Doc QA": (("2WM", "2wikimqa"), ("HQA", "hotpotqa"), ("Mus", "musique")),
    "Single-Doc QA": (("QQA", "qasper"), ("NQA", "narrativeqa")),
    "Few-shot": (("SSM", "samsum"), ("TQA", "triviaqa")),
    "Synthetic": (("PEN", "passage_retrieval_en"), ("PZH", "passage_retrieval_zh")),
    "Summarization": (("QMS", "qmsum"), ("GvR", "gov_report"), ("MNs", "multi_news")),
    "Code": (("RBP", "repobench-p"), ("LCC", "lcc")),
}
TABLE8_TASKS = tuple(name for group in TABLE8_GROUPS.values() for _, name in group)

DOWNLOAD_HELP = (
    "LongBench data is read from local files only: download data.zip of the Hugging Face dataset THUDM/LongBench "
    "(https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip), unzip it and pass the folder that "
    "holds narrativeqa.jsonl, qasper.jsonl, ... (e.g. --data /data/LongBench/data).")


def load_longbench(data_dir: str, dataset: str, limit: int | None = None) -> list[dict]:
    """Rows of ``<data_dir>/<dataset>.jsonl``."""
    path = os.path.join(data_dir, f"{dataset}.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LongBench file {path} not found. {DOWNLOAD_HELP}")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def build_prompt(dataset: str, row: dict) -> str:
    return DATASET_PROMPT[dataset].format(context=row["context"], input=row["input"])


def truncate_middle(tokenizer, prompt: str, max_length: int) -> list[int]:
    """Token ids of ``prompt``; when longer than ``max_length``, the first and last ``max_length // 2`` tokens are
    decoded and joined into a new prompt (LongBench's middle truncation), which is encoded again."""
    ids = encode(tokenizer, prompt)
    if len(ids) <= max_length:
        return ids
    half = max_length // 2
    text = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:],
                                                                                     skip_special_tokens=True)
    return encode(tokenizer, text)


def _newline_token(tokenizer) -> int | None:
    ids = encode(tokenizer, "\n")
    return ids[-1] if ids else None


def predict_dataset(model, tokenizer, rows: Sequence[dict], dataset: str, max_length: int,
                    progress: bool = False, batch_size: int = 1) -> list[str]:
    """Greedy predictions for ``rows`` of one dataset (the prompt plus its generation fits ``max_length``),
    ``batch_size`` prompts per ``generate`` call (left-padded with the 2-D attention mask; our LM runs each row
    alone, so a batch gives the tokens of one prompt at a time)."""
    max_new = DATASET_MAXLEN[dataset]
    eos = [getattr(tokenizer, "eos_token_id", None)]
    if dataset == "samsum":  # the official script also stops samsum at a newline
        eos.append(_newline_token(tokenizer))
    bar = tqdm(total=len(rows), desc=dataset, dynamic_ncols=True) if progress else None
    preds = []
    for start in range(0, len(rows), max(1, int(batch_size))):
        chunk = rows[start:start + max(1, int(batch_size))]
        prompts = [truncate_middle(tokenizer, build_prompt(dataset, row), max_length - max_new) for row in chunk]
        new = greedy_generate_batch(model, prompts, max_new, eos_token_ids=[e for e in eos if e is not None],
                                    pad_token_id=eos[0] if eos[0] is not None else 0)
        preds += [tokenizer.decode(ids, skip_special_tokens=True) for ids in new]
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return preds


def run_longbench(model, tokenizer, data_dir: str, datasets: Sequence[str] = TABLE8_TASKS, *, max_length: int,
                  out_dir: str | None = None, limit: int | None = None, progress: bool = True,
                  batch_size: int = 1) -> dict:
    """Predict and score each dataset; writes ``<out_dir>/<dataset>.jsonl`` (pred, answers, all_classes, length)
    in the official format and ``<out_dir>/result.json``. Returns ``{dataset: score, "average": mean}``.

    ``max_length`` bounds prompt + generation (the official script bounds the prompt alone by the model's
    context; our models are trained with a fixed context, so the generation budget is taken out of it).
    ``batch_size``: prompts per ``generate`` call (:func:`predict_dataset`).
    """
    unknown = [d for d in datasets if d not in DATASET_PROMPT]
    if unknown:
        raise KeyError(f"unsupported LongBench datasets {unknown}; supported: {sorted(DATASET_PROMPT)}")
    scores = {}
    for dataset in datasets:
        rows = load_longbench(data_dir, dataset, limit)
        preds = predict_dataset(model, tokenizer, rows, dataset, max_length, progress, batch_size)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"{dataset}.jsonl"), "w", encoding="utf-8") as f:
                for row, pred in zip(rows, preds):
                    f.write(json.dumps({"pred": pred, "answers": row["answers"], "all_classes": row.get("all_classes"),
                                        "length": row.get("length")}, ensure_ascii=False) + "\n")
        scores[dataset] = score_dataset(dataset, preds, [r["answers"] for r in rows],
                                        [r.get("all_classes") for r in rows])
    scores["average"] = round(sum(scores[d] for d in datasets) / len(datasets), 2)
    if out_dir:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(scores, f, indent=2)
    return scores
