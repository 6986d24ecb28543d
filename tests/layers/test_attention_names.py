"""No code asks "which attention is this?" by its name outside the registry (mhla/registry.py): models, tasks,
scripts and the package, the attentions' own classes included, ask the attention (its ``supports``, its options,
what it says about itself in mhla/registry.py) or the model's contract (its native attentions) instead. A comparison of an attention's name
(``name == "mhla"``, ``attn in ("softmax", "linear")``, ``"gla" != kind``) anywhere else fails this test.

The check reads the source (Python's ``ast``): a comparison (``==``, ``!=``, ``in``, ``not in``) with a string
that names a registered attention, a native attention (``native``) or an fla baseline of the language models, on
either side or in a literal tuple / list / set. Comparisons whose other side is another vocabulary that shares a
word with the attentions (the output gate's kind ``"linear"``, the cosine learning-rate schedules, Python package
names) are not about an attention: :data:`OTHER_WORDS`, :data:`OTHER_FILES`. The benchmarks' ops (``"mhla"``,
``"linear"``, ...) are not exempt: the scripts ask an op's entry in ``scripts.bench_ops.BENCH_OPS`` what it is, and
the compile check calls its cases' ops through a table."""

import ast
import os
import re
from pathlib import Path

import mhla  # noqa: F401  (registers the package's attentions)
from mhla.registry import list_attentions

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("models", "tasks", "scripts", "mhla")
#: what may compare attention names: the registry alone (an attention's own class asks its options, not its name)
OWN = {"mhla/registry.py"}
#: the other side of a comparison that is another vocabulary, by a regex on its source
OTHER_WORDS = {
    r"gate": "the output gate's kind (swish | linear)",
    r"__module__": "a Python package name",
    r"\[\"results\"\]": "the rows of a benchmark's results, by row name",
}
#: files where another vocabulary shares a word with the attentions
OTHER_FILES = {"tasks/common/optim.py": "learning-rate schedules (cosine)"}


def attention_names() -> set[str]:
    import examples.cosine_attention  # noqa: F401, PLC0415  (the worked example registers "cosine")
    from models.lm.baselines import FLA_340M  # noqa: PLC0415

    return set(list_attentions()) | {"native"} | set(FLA_340M)


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def name_comparisons(path: Path, names: set[str]) -> list[str]:
    """``"path:line: source"`` of each comparison of an attention name in the file."""
    text = path.read_text()
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, operand in enumerate(operands):
            hit = [s for s in _strings(operand) if s in names]
            if not hit:
                continue
            others = " ".join(ast.get_source_segment(text, o) or "" for j, o in enumerate(operands) if j != i)
            if any(re.search(pattern, others) for pattern in OTHER_WORDS):
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(text, node)}")
            break
    return out


def test_no_attention_name_is_compared_outside_the_registry_and_its_class():
    names = attention_names()
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in OWN or rel in OTHER_FILES or "/dev/" in rel:
                continue
            found += name_comparisons(path, names)
    assert not found, ("attention names compared outside mhla/registry.py (ask "
                       "the attention or the model's contract instead):\n" + "\n".join(found))


def test_the_check_finds_a_comparison(tmp_path):
    """The check is not blind: each form of a name comparison is found (a benchmark op's name too), other
    vocabularies are not."""
    src = tmp_path / "example.py"
    src.write_text('if attn == "mhla":\n    pass\n'
                   'x = name in ("softmax", "linear")\n'
                   'y = "gla" != cfg["name"]\n'
                   'z = gate == "linear"\n'
                   'w = op in ("mhla", "linear")\n')
    rel = os.path.relpath(src, ROOT)
    found = name_comparisons(ROOT / rel, attention_names())
    assert [f.split(": ", 1)[1] for f in found] == ['attn == "mhla"', 'name in ("softmax", "linear")',
                                                    '"gla" != cfg["name"]', 'op in ("mhla", "linear")']
