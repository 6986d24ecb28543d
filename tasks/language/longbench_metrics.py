"""LongBench's scoring functions (THUDM/LongBench ``metrics.py`` / ``eval.py``), re-implemented; the only package
they need is jieba (Chinese word segmentation, imported when a Chinese QA / summarization dataset is scored).

Per-dataset metric (``DATASET_METRIC``) and the scoring rule of ``eval.py`` (:func:`score_dataset`): a prediction
scores the maximum of the metric over the reference answers; for ``trec``, ``triviaqa``, ``samsum`` (and
``lsht``) only the first line of the prediction (leading newlines stripped) is scored; the dataset score is
``100 x mean``, rounded to 2 decimals.

* ``qa_f1``: SQuAD-style token F1 after normalization (lower case, drop punctuation, drop the articles
  a/an/the, collapse whitespace).
* ``rouge_l``: ROUGE-L F as the ``rouge`` package (pltrdy/rouge, ``Rouge().get_scores``) that LongBench calls
  computes it: summary-level union LCS over ``.``-split sentences, on distinct words (see :func:`rouge_l`);
  an empty prediction or reference scores 0 (``rouge`` raises, LongBench catches and returns 0).
* ``classification``: the classes named in the prediction; a class contained in the (longer) gold class is
  dropped; score ``1 / #matches`` if the gold class is matched, else 0.
* ``retrieval``: the numbers in the prediction; fraction equal to the gold ``Paragraph N`` id
  (``passage_retrieval_zh``: the gold ``段落N`` id; no word segmentation, as in LongBench).
* Chinese QA / summaries (``multifieldqa_zh``; ``dureader``, ``vcsum``): words from ``jieba.cut(text,
  cut_all=False)`` (accurate mode); QA-F1 on the segmented words after :func:`normalize_zh_answer` (lower case,
  English and Chinese punctuation and all whitespace removed, empty words dropped; no article removal); ROUGE-L
  on the words joined by spaces.
* ``count``: the numbers in the prediction; fraction equal to the gold count.
* ``code_sim``: the first line of the prediction without `````, ``#`` or ``//``; similarity
  ``fuzz.ratio / 100`` = ``round(100 * 2 M / T) / 100`` with ``difflib.SequenceMatcher`` (``M`` matched characters,
  ``T`` total length), which is what ``fuzzywuzzy``'s ``ratio`` computes on its pure-Python path (with
  python-Levenshtein installed fuzzywuzzy uses a Levenshtein-based ratio that can differ slightly).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Sequence

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
    try:
        import jieba  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - jieba is a dependency (pyproject.toml, requirements.lock)
        raise ImportError("the Chinese LongBench metrics need jieba: pip install jieba") from e
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


def _lcs_words(x: Sequence[str], y: Sequence[str]) -> set[str]:
    """The words of one longest common subsequence of ``x`` and ``y`` (as a set), traced back with the ``rouge``
    package's tie-break (move up only when the cell above is strictly larger)."""
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i, a in enumerate(x, 1):
        row, prev = table[i], table[i - 1]
        for j, b in enumerate(y, 1):
            row[j] = prev[j - 1] + 1 if a == b else max(prev[j], row[j - 1])
    i, j, words = len(x), len(y), set()
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_sentences(text: str) -> list[list[str]]:
    """``rouge``'s split: pieces between ``.`` (non-empty before whitespace cleanup), words split on one space."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if len(piece) > 0]


def rouge_l(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F of the ``rouge`` package (``Rouge().get_scores(pred, ref)["rouge-l"]["f"]``, summary level).

    Sentences are split on ``.``; ``m`` / ``n`` = number of *distinct* words of the reference / prediction; the
    overlap is the number of distinct words in the union of the LCS of every (reference sentence, prediction
    sentence) pair; ``R = overlap / m``, ``P = overlap / n``, ``F = 2 P R / (P + R + 1e-8)``. An empty (or
    whitespace-only) prediction or reference scores 0 (the package raises and LongBench returns 0).
    """
    if not prediction.strip() or not ground_truth.strip():
        return 0.0
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp or not ref:
        return 0.0
    m = len({w for s in ref for w in s})
    n = len({w for s in hyp for w in s})
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= _lcs_words(r, h)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_l(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_l(" ".join(zh_words(prediction)), " ".join(zh_words(ground_truth)))


# ------------------------------------------------------------------------------- class / retrieval / count


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = (), **_) -> float:
    matches = [c for c in all_classes if c in prediction]
    # a matched class that is a proper part of the gold class (e.g. "Ent" in "Entity") does not count against it
    matches = [c for c in matches if not (c in ground_truth and c != ground_truth)]
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
    """``fuzzywuzzy.fuzz.ratio``: ``round(100 * SequenceMatcher(None, a, b).ratio())``; 0 if either is empty."""
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


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
