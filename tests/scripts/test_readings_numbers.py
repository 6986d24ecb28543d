"""Every number and every verdict word a results reading quotes is bound to its data.

A *reading* is the hand-written part of a results file (what follows its ``## Reading`` heading). Beside each
``results/**/<stem>.md`` with a reading sits its binding ``<stem>.reading.bind`` (:mod:`scripts.tables.readings`
says the format): each decimal number of the reading, in order, names the JSON path (or arithmetic over paths,
in this record or another) it prints, at the decimals it is quoted with; each verdict word (holds, level,
reversed, converged, still gaining, better, worse) names the rule that gives it from the data, or says why that use
is not a verdict. No number stands in for another: a number passes only when its own path prints it.

The tests: every reading is bound and passes (:data:`scripts.tables.readings.UNBOUND` lists the readings left on
the old check, any JSON number rounding to the quoted one, with the reason; nothing is excused from failing); a
``*_reading.md`` (the source the writers paste under ``## Reading``) quotes what its page quotes; and for every
reading an injected wrong number and an injected wrong verdict word fail the check, in the reading and in the
binding alike (a binding that agrees with a wrong reading still fails on the data). Reads only text and JSON."""

from __future__ import annotations

import glob
import os
import re

import pytest

from scripts.tables import readings as R

ROOT = R.ROOT
OTHER_WORD = {"level": "holds", "holds": "level", "reversed": "level", "converged": "still gaining",
              "still gaining": "converged", "better": "worse", "worse": "better"}


def bound() -> list[str]:
    return [p for p in R.reading_files() if p not in R.UNBOUND]


def load(rel: str):
    path = os.path.join(ROOT, rel)
    with open(path, encoding="utf-8") as f:
        md = f.read()
    bpath = R.binding_path(path)
    binding = R.load_binding(bpath) if os.path.exists(bpath) else {"files": {}, "numbers": [], "verdicts": []}
    return md, binding, R.names_for(path, binding)


def test_readings_are_found():
    found = R.reading_files()
    assert "results/table5_mini.md" in found and "results/mqar/no_conv.md" in found
    assert set(R.UNBOUND) <= set(found), sorted(set(R.UNBOUND) - set(found))
    assert all(reason.strip() for reason in R.UNBOUND.values())


@pytest.mark.parametrize("rel", bound())
def test_reading_is_bound_to_its_data(rel):
    problems = R.check_file(os.path.join(ROOT, rel))
    assert not problems, f"{rel}:\n" + "\n".join(problems)


def test_every_binding_has_its_reading():
    """No binding is left behind by a removed or renamed page."""
    for bpath in glob.glob(os.path.join(ROOT, "results", "**", "*" + R.SUFFIX), recursive=True):
        md = bpath[: -len(R.SUFFIX)] + ".md"
        assert os.path.relpath(md, ROOT) in bound(), f"{bpath}: no bound reading {md}"


def _source_pairs():
    out = []
    for src in sorted(glob.glob(os.path.join(ROOT, "results", "**", "*_reading.md"), recursive=True)):
        rel = os.path.relpath(src, ROOT)
        page = {"results/mqar/conv_reading.md": "results/mqar.md",
                "results/video/table5_mini_reading.md": "results/table5_mini.md"}.get(rel, rel[: -len("_reading.md")]
                                                                                       + ".md")
        out.append((rel, page))
    return out


@pytest.mark.parametrize("src,page", _source_pairs())
def test_reading_source_quotes_what_its_page_quotes(src, page):
    """A ``*_reading.md`` is pasted under its page's ``## Reading`` (after any generated lines): its numbers and
    verdict words are the tail of the page's, so the page's binding covers it."""
    with open(os.path.join(ROOT, src), encoding="utf-8") as f:
        text = R.reading(f.read())
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        page_text = R.reading(f.read())
    for get in (R.numbers, R.words):
        mine, theirs = get(text), get(page_text)
        assert theirs[len(theirs) - len(mine):] == mine, f"{src} and {page} quote different {get.__name__}"


# -- injection: a wrong number and a wrong verdict word must fail -------------------------------------------

def _entries(binding, key, sep="=~"):
    return [R.split_entry(e, sep) for e in binding[key]]


def _replace_nth(text: str, pattern: re.Pattern, n: int, new: str) -> str:
    m = list(pattern.finditer(text))[n]
    return text[: m.start()] + new + text[m.end():]


def _wrong(q: str) -> str:
    """A different number at the same decimals (the last digit moved by 3)."""
    digits = len(q.split(".")[1])
    return f"{float(q) + 3 * 10 ** -digits:.{digits}f}"


@pytest.mark.parametrize("rel", bound())
def test_injected_wrong_number_fails(rel):
    """Up to three of the reading's bound numbers, one at a time, moved by 3 in their last digit: the check fails
    on the reading, and on the data when the binding is changed to agree (an unbound added number fails too)."""
    md, binding, names = load(rel)
    text = R.reading(md)
    assert R.check(text, binding, names) == [], "the reading's text alone must pass"
    nums = _entries(binding, "numbers")
    picks = [i for i, (_, sep, _) in enumerate(nums) if sep == "="]
    assert R.check(text + "\n\nAnd 12.5 more.", binding, names), f"{rel}: an unbound number passed"
    for i in ({picks[0], picks[len(picks) // 2], picks[-1]} if picks else ()):
        q = nums[i][0]
        wrong = _wrong(q)
        bad_text = _replace_nth(text, R.DECIMAL, i, wrong)
        assert R.check(bad_text, binding, names), f"{rel}: {q} -> {wrong} in the reading passed"
        bad_binding = dict(binding, numbers=list(binding["numbers"]))
        bad_binding["numbers"][i] = f"{wrong} = {nums[i][2]}"
        problems = R.check(bad_text, bad_binding, names)
        assert any(p.startswith(f"{wrong} = ") for p in problems), \
            f"{rel}: {q} -> {wrong} in the reading and its binding passed the data"


@pytest.mark.parametrize("rel", bound())
def test_injected_wrong_verdict_fails(rel):
    """The first and last rule-given verdict words, one at a time, swapped for their opposite (level <-> holds,
    reversed -> level, converged <-> still gaining, better <-> worse): the check fails on the reading, and on the
    rule when the binding is changed to agree; a word marked as no verdict cannot change, nor one be added."""
    md, binding, names = load(rel)
    text = R.reading(md)
    words = _entries(binding, "verdicts")
    picks = [i for i, (_, sep, _) in enumerate(words) if sep == "="]
    assert R.check(text + "\n\nThe ordering holds.", binding, names), f"{rel}: an unbound verdict word passed"
    for i, (word, sep, _) in enumerate(words):  # a word marked as no verdict cannot be changed either
        if sep == "~":
            assert R.check(_replace_nth(text, R.VERDICT, i, OTHER_WORD[word.lower()]), binding, names)
    for i in ({picks[0], picks[-1]} if picks else ()):
        word, _, rule = words[i]
        other = OTHER_WORD[word.lower()]
        bad_text = _replace_nth(text, R.VERDICT, i, other)
        assert R.check(bad_text, binding, names), f"{rel}: {word} -> {other} in the reading passed"
        bad_binding = dict(binding, verdicts=list(binding["verdicts"]))
        bad_binding["verdicts"][i] = f"{other} = {rule}"
        problems = R.check(bad_text, bad_binding, names)
        assert any(p.startswith(f"{other} = ") for p in problems), \
            f"{rel}: {word} -> {other} in the reading and its binding passed the rule"


def test_the_check_on_a_synthetic_reading():
    """A made-up record and reading: the rules of the check, one by one."""
    names = {"rows": {"a": {"by_seed": {"0": 90.0, "1": 91.0, "2": 92.0}},
                      "b": {"by_seed": {"0": 80.0, "1": 80.5, "2": 81.0}}}, "acc": 0.8721}
    names["record"] = dict(names)
    binding = {"files": {}, "numbers": ["87.2 = 100 * acc", "10.5 = paired(rows.a.by_seed, rows.b.by_seed).mean",
                                        "0.01 ~ setting: an lr factor"],
               "verdicts": ["holds = ordering_word(rows.a.by_seed, rows.b.by_seed)", "level ~ prose: a noise level"]}
    good = "Accuracy 87.2%, `lr=0.123` is code; a - b = 10.5 at lr x 0.01: a > b holds above the noise level."
    assert R.check(good, binding, names) == []
    assert R.check(good.replace("87.2", "87.3"), binding, names)  # a stale number
    assert R.check(good.replace("holds", "level"), binding, names)  # a stale verdict
    assert R.check(good + " Also 1.5.", binding, names)  # an unbound number
    assert R.check(good + " Better.", binding, names)  # an unbound verdict word
    off = dict(binding, numbers=["87.2 = acc", *binding["numbers"][1:]])
    assert R.check(good, off, names)  # x 100 is not implied: the path must print the number
    assert R.check(good, binding, dict(names, acc=0.87251))  # 87.251 prints 87.3, not 87.2
    unsaid = dict(binding, numbers=[*binding["numbers"][:2], "0.01 ~ an lr factor"])
    assert R.check(good, unsaid, names)  # a number not read from a record says what it is
    firsts = dict(binding, numbers=["87.2 = 100 * acc", "10.5 = paired([90.0, 91.0, 70.0][:2], [80.0, 80.0]).mean",
                                       binding["numbers"][2]])
    assert R.check(good, firsts, names) == []  # the seeds both sides have: a list's first ones
    assert R.evaluate("[1, 2, 3][1:]", {}) == [2, 3]
    with pytest.raises(R.BindingError):
        R.evaluate("[1, 2, 3][::2]", {})  # a step is not a seed selection


# -- the readings left on the old check (R.UNBOUND) ---------------------------------------------------------

LONG = 64


def _json_numbers(obj, out):
    if isinstance(obj, bool) or obj is None:
        return out
    if isinstance(obj, (int, float)):
        out.append(float(obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k != "notes":
                _json_numbers(v, out)
    elif isinstance(obj, list) and len(obj) <= LONG:
        for v in obj:
            _json_numbers(v, out)
    elif isinstance(obj, str):
        out += [float(x) for x in R.DECIMAL.findall(obj)]
    return out


@pytest.mark.parametrize("rel", sorted(R.UNBOUND))
def test_unbound_reading_numbers_are_in_its_json(rel):
    """The old, weaker check (a number passes when any JSON number rounds to it, as it is or x 100), kept only
    for :data:`scripts.tables.readings.UNBOUND` until each is bound."""
    md, _, names = load(rel)
    values = sorted(set(_json_numbers(names["record"], [])))
    printed = set(R.DECIMAL.findall(md.split("## Reading", 1)[0]))
    bad = []
    for q in R.numbers(R.reading(md)):
        tol = 0.5 * 10 ** -len(q.split(".")[1]) + 1e-9
        if q not in printed and not any(abs(v - float(q)) <= tol or abs(100 * v - float(q)) <= tol
                                        for v in values):
            bad.append(q)
    assert not bad, f"{rel}: its reading quotes {bad}, which its JSON does not hold"


def test_binding_file_format(tmp_path):
    """The binding file as the module's docstring shows it: sections, entries as written, comment lines."""
    path = tmp_path / "x.reading.bind"
    path.write_text("# a comment\nfiles:\n  n256: seeds_n256.json\nnumbers:\n  - 0.01 ~ setting: an lr factor\n"
                    "  - 30.5 = paired(a.by_seed, b.by_seed).mean\nverdicts:\n"
                    "  - level ~ prose: \"at the 5% level\", a significance level\n")
    b = R.load_binding(str(path))
    assert b == {"files": {"n256": "seeds_n256.json"},
                 "numbers": ["0.01 ~ setting: an lr factor", "30.5 = paired(a.by_seed, b.by_seed).mean"],
                 "verdicts": ['level ~ prose: "at the 5% level", a significance level']}
    path.write_text("numbers:\n  77.5 = x\n")
    with pytest.raises(R.BindingError):
        R.load_binding(str(path))
