"""LongBench's scoring functions (THUDM/LongBench ``metrics.py`` / ``eval.py``) with the packages LongBench uses:
``rouge`` (ROUGE-L), ``fuzzywuzzy`` (code similarity) and ``jieba`` (Chinese words), so the scores equal the
official script's by construction; the remaining functions are a few lines each and follow the official ones
line by line, including their quirks (below).

Per-dataset metric (``DATASET_METRIC``) and the scoring rule of ``eval.py`` (:func:`score_dataset`): a prediction
scores the maximum of the metric over the reference answers; for ``trec``, ``triviaqa``, ``samsum`` (and
``lsht``) only the first line of the prediction (leading newlines stripped) is scored; the dataset score is
``100 x mean``, rounded to 2 decimals.

* ``qa_f1``: SQuAD-style token F1 after normalization (lower case, drop punctuation, drop the articles
  a/an/the, collapse whitespace).
* ``rouge_l``: ``Rouge().get_scores([pred], [ref], avg=True)["rouge-l"]["f"]`` of the ``rouge`` package
  (pltrdy/rouge 1.0.1: summary-level union LCS over ``.``-split sentences, on distinct words, case-sensitive);
  any exception scores 0, as LongBench's bare ``except``: an empty (or ``.``-only) prediction or reference, and
  a sentence pair long enough (about 1,000 words together) for the package's recursive LCS traceback to exceed
  Python's recursion limit (``RecursionError``; the exact length depends on the call depth, a few frames).
* ``classification``: the classes named in the prediction (substring test); then, **as LongBench does**, the
  matched classes that are a proper part of the gold class are removed *while iterating over the same list*,
  so a match right after a removed one is skipped and stays; score ``1 / #matches`` if the gold class is among
  the matches, else 0 (LongBench's fallback to the most similar class is unreachable: it tests
  ``em_match_list != 0``, a list against an int, which is always true). :func:`classification_score` reproduces
  this (scores comparable with published LongBench numbers); :func:`classification_score_intended` drops every
  such class (what the loop means to do), for reference only.
* ``retrieval``: the numbers in the prediction; fraction equal to the gold ``Paragraph N`` id
  (``passage_retrieval_zh``: the gold ``段落N`` id; no word segmentation, as in LongBench).
* Chinese QA / summaries (``multifieldqa_zh``; ``dureader``, ``vcsum``): words from ``jieba.cut(text,
  cut_all=False)`` (accurate mode); QA-F1 on the segmented words after :func:`normalize_zh_answer` (lower case,
  English and Chinese punctuation and all whitespace removed, empty words dropped; no article removal); ROUGE-L
  on the words joined by spaces.
* ``count``: the numbers in the prediction; fraction equal to the gold count.
* ``code_sim``: the first line of the prediction without `````, ``#`` or ``//``; similarity
  ``fuzzywuzzy.fuzz.ratio / 100``. LongBench installs ``fuzzywuzzy`` without ``python-Levenshtein``, so
  ``ratio`` is ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())`` (equal strings: 100, one empty
  string: 0); with python-Levenshtein installed fuzzywuzzy switches to a Levenshtein ratio that can differ, so
  requirements.lock leaves it out (:data:`FUZZ_PURE_PYTHON` says which path is active).

Where :func:`score_dataset` differs from ``eval.py``: each row is scored with its own ``all_classes`` (``eval.py``
passes the last row's to every row; in the official files every row of a dataset has the same list).
"""

from __future__ import annotations

import difflib
import re
import string
import warnings
from collections import Counter
from collections.abc import Sequence

import jieba
from rouge import Rouge

with warnings.catch_warnings():  # fuzzywuzzy warns that python-Levenshtein is absent: LongBench's setting
    warnings.simplefilter("ignore", UserWarning)
    from fuzzywuzzy import fuzz

FUZZ_PURE_PYTHON = fuzz.SequenceMatcher is difflib.SequenceMatcher
"""True when fuzzywuzzy scores with difflib (no python-Levenshtein), as in LongBench's environment."""

# ------------------------------------------------------------------------------------------- QA F1


def normalize_answer(s: str) -> str:
    """Lower case, remove punctuation, remove articles (a, an, the), collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


# ------------------------------------------------------------------------------------------ Chinese

# The Chinese punctuation LongBench's ``normalize_zh_answer`` removes (besides ``string.punctuation``).
ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


def zh_words(text: str) -> list[str]:
    """jieba's accurate-mode segmentation (``jieba.cut(text, cut_all=False)``), LongBench's Chinese tokenizer."""
    jieba.setLogLevel(30)  # no "Building prefix dict ..." lines on every run
    return list(jieba.cut(text, cut_all=False))


def normalize_zh_answer(s: str) -> str:
    """Lower case, remove English and Chinese punctuation, remove all whitespace (LongBench)."""
    drop = set(string.punctuation + ZH_PUNCTUATION)
    return "".join("".join(ch for ch in s.lower() if ch not in drop).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    pred = [w for w in (normalize_zh_answer(t) for t in zh_words(prediction)) if w]
    gold = [w for w in (normalize_zh_answer(t) for t in zh_words(ground_truth)) if w]
    return token_f1(pred, gold)


# ------------------------------------------------------------------------------------------- ROUGE-L

_ROUGE = Rouge()


def rouge_l(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F of the ``rouge`` package as LongBench calls it; 0 when the package raises (module docstring)."""
    try:
        return float(_ROUGE.get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"])
    except Exception:  # noqa: BLE001 - LongBench's bare except: empty texts, RecursionError on very long sentences
        return 0.0


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_l(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_l(" ".join(zh_words(prediction)), " ".join(zh_words(ground_truth)))


# ------------------------------------------------------------------------------- class / retrieval / count


def _matched_classes(prediction: str, all_classes: Sequence[str]) -> list[str]:
    return [c for c in all_classes if c in prediction]


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = (), **_) -> float:
    """LongBench's ``classification_score``, quirk included (module docstring): classes that are a proper part
    of the gold class are removed from the matches while the matches are being iterated, so the match that
    follows each removed one is not examined."""
    matches = _matched_classes(prediction, all_classes)
    i = 0                       # the position a Python list iterator keeps
    while i < len(matches):
        c = matches[i]
        if c in ground_truth and c != ground_truth:
            matches.remove(c)   # list.remove (first equal item): the next item shifts into position i ...
        i += 1                  # ... and the iterator moves on all the same, so that item is never examined
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def classification_score_intended(prediction: str, ground_truth: str, all_classes: Sequence[str] = (),
                                  **_) -> float:
    """What LongBench's loop means to compute: *every* matched class that is a proper part of the gold class is
    dropped. Not used for scoring (it differs from the published numbers); kept to document the quirk."""
    matches = [c for c in _matched_classes(prediction, all_classes) if not (c in ground_truth and c != ground_truth)]
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(target) for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    gold = re.findall(r"Paragraph (\d+)", ground_truth)
    if not gold:
        raise ValueError(f"retrieval answer {ground_truth!r} names no 'Paragraph N'")
    return _fraction_equal(prediction, gold[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    gold = re.findall(r"段落(\d+)", ground_truth)
    if not gold:
        raise ValueError(f"retrieval answer {ground_truth!r} names no '段落N'")
    return _fraction_equal(prediction, gold[0])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    return _fraction_equal(prediction, ground_truth)


# --------------------------------------------------------------------------------------------- code


def fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` (LongBench's code similarity, 0..100)."""
    return int(fuzz.ratio(a, b))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth) / 100


# ------------------------------------------------------------------------------------------ datasets

DATASET_METRIC = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score, "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score, "musique": qa_f1_score, "gov_report": rouge_score, "qmsum": rouge_score,
    "multi_news": rouge_score, "trec": classification_score, "triviaqa": qa_f1_score, "samsum": rouge_score,
    "passage_count": count_score, "passage_retrieval_en": retrieval_score, "lcc": code_sim_score,
    "repobench-p": code_sim_score,
    "multifieldqa_zh": qa_f1_zh_score, "dureader": rouge_zh_score, "vcsum": rouge_zh_score,
    "lsht": classification_score, "passage_retrieval_zh": retrieval_zh_score,
}
"""The 21 LongBench datasets: 16 English, 5 Chinese (jieba-segmented QA-F1 / ROUGE-L where LongBench uses it)."""

FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum", "lsht")


def score_dataset(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
                  all_classes: Sequence[Sequence[str] | None] | Sequence[str] | None = None) -> float:
    """LongBench's ``scorer``: ``100 x mean_i max_{gold in answers_i} metric(pred_i, gold)``, 2 decimals."""
    if dataset not in DATASET_METRIC:
        raise KeyError(f"no LongBench metric for {dataset!r}; known: {sorted(DATASET_METRIC)}")
    if not predictions:
        raise ValueError(f"{dataset}: no predictions to score")
    metric = DATASET_METRIC[dataset]
    total = 0.0
    for i, (pred, golds) in enumerate(zip(predictions, answers)):
        classes = all_classes[i] if all_classes and isinstance(all_classes[0], (list, tuple)) else all_classes
        if dataset in FIRST_LINE_ONLY:
            pred = pred.lstrip("\n").split("\n")[0]
        total += max((metric(pred, g, all_classes=classes or ()) for g in golds), default=0.0)
    return round(100 * total / len(predictions), 2)
