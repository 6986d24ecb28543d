"""lm-evaluation-harness really run on our model: ``lm_eval.simple_evaluate`` with ``--model mhla`` on the local
tasks (tasks/language/lm_eval_tasks/) over held-out gensim text, parity with our own scorer (eval_ppl.py) and
with the harness's own HF model, a stock task read from a local dataset folder, and Table 6 through the harness.

Everything is offline: a tiny randomly initialised MHLA LM and a small BPE tokenizer (trained here) saved with
``save_pretrained`` into a temporary folder; the data are jsonl files written from the gensim corpus.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("models.lm")

from lm_eval.tasks import TaskManager  # noqa: E402

from helpers.lm_configs import lm_config  # noqa: E402
from tasks.language import lm_eval_adapter as A  # noqa: E402
from tasks.language.eval_ppl import (  # noqa: E402
    EvalSettings,
    encode,
    evaluate_documents,
    evaluate_lambada,
    rolling_windows,
    score_continuations,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 32   # the harness's max_length: every document spans several rolling windows
STOCK_LAMBADA_DIR = Path(lm_eval.__file__).parent / "tasks" / "lambada"


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache", raising=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from models.lm import MHLALMForCausalLM
    from tasks.language.data import EOS, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    docs = A.heldout_documents()                      # lm_mini's validation documents of the gensim corpus
    files = A.write_local_task_data(root / "data", docs=docs[:6], max_chars=1200, lambada_words=40)
    train_bpe_tokenizer(docs[6:40], 384, root / "bpe" / "tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "bpe" / "tokenizer.json"), eos_token=EOS)
    torch.manual_seed(0)
    cfg = lm_config("mhla", vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_heads=2,
                       block_size=8, max_position_embeddings=64, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.eos_token_id)
    model = MHLALMForCausalLM(cfg).eval()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    read = {k: [json.loads(line)["text"] for line in open(v)] for k, v in files.items()}
    return SimpleNamespace(root=root, files=files, tok=tok, model=model, model_dir=str(root / "model"),
                           texts=read["text_file"], passages=read["lambada_file"])


def local_task_manager(files):
    return TaskManager(include_path=str(A.LOCAL_TASKS_DIR), include_defaults=False, metadata=files)


@pytest.fixture(scope="module")
def harness_mhla(setup):
    """``simple_evaluate`` through the registry: ``--model mhla --model_args pretrained=DIR,...``, batch 4."""
    out = lm_eval.simple_evaluate(model="mhla", model_args=f"pretrained={setup.model_dir},max_length={MAX_LEN}",
                                  batch_size=4, device="cpu", tasks=["mhla_local"],
                                  task_manager=local_task_manager(setup.files), log_samples=True, bootstrap_iters=0)
    return out


# --------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("n,max_len,context_len", [(1, 4, 1), (4, 4, 1), (5, 4, 1), (37, 8, 1), (64, 32, 1),
                                                   (37, 8, 3), (20, 5, 5)])
def test_rolling_windows_are_lm_evals(n, max_len, context_len):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    toks = list(range(100, 100 + n))
    theirs = [tuple(map(list, make_disjoint_window(w)))
              for w in get_rolling_token_windows(toks, prefix_token=7, max_seq_len=max_len, context_len=context_len)]
    assert [tuple(w) for w in rolling_windows(toks, 7, max_len, context_len)] == theirs


# ------------------------------------------------------------------------------ the local tasks, parity


def test_local_tasks_via_simple_evaluate_equal_eval_ppl(setup, harness_mhla):
    """What is compared: the harness's ``mhla_ppl_local`` (loglikelihood_rolling: disjoint windows of
    ``max_length`` = 32 tokens, the first conditioned on the prefix token, EOS here as the tokenizer has no BOS;
    word_perplexity = exp(-sum LL / sum words), words = len(re.split(r"\\s+", text)); byte_perplexity,
    bits_per_byte on UTF-8 bytes) against ``eval_ppl.evaluate_documents(max_len=32, context_len=1)`` on the same
    documents and model, scored one window at a time (no batching, no padding); and ``mhla_lambada_local``
    (last-word acc and perplexity) against ``eval_ppl.evaluate_lambada``."""
    res = harness_mhla["results"]
    ours = evaluate_documents(setup.model, setup.tok, setup.texts, EvalSettings(max_len=MAX_LEN, batch_size=1))
    ppl = res["mhla_ppl_local"]
    assert ppl["sample_len"] == len(setup.texts) == 6
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ppl[f"{key},none"] == pytest.approx(ours[key], rel=1e-5), key
    # token perplexity from the per-document log-likelihoods the harness logged
    samples = harness_mhla["samples"]["mhla_ppl_local"]
    ll = sum(float(s["filtered_resps"][0]) for s in samples)
    n_tok = sum(len(encode(setup.tok, s["doc"]["text"])) for s in samples)
    assert math.exp(-ll / n_tok) == pytest.approx(ours["token_perplexity"], rel=1e-5)
    assert ours["tokens"] > 4 * MAX_LEN and ours["words"] == sum(len(t.split()) for t in setup.texts)

    lam = res["mhla_lambada_local"]
    ours_lam = evaluate_lambada(setup.model, setup.tok, setup.passages, EvalSettings(max_len=MAX_LEN, batch_size=1))
    assert lam["sample_len"] == len(setup.passages) > 0
    assert lam["perplexity,none"] == pytest.approx(ours_lam["ppl"], rel=1e-5)
    assert lam["acc,none"] == ours_lam["acc"]
    assert harness_mhla["config"]["model_class"] == "MHLALMForCausalLM"


def test_harness_hf_model_agrees(setup, harness_mhla):
    """The harness's own HF model (``HFLM``, its right-padded batches, its windows and prefix token) on the same
    model object gives the same numbers as ``--model mhla``."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=setup.model, tokenizer=setup.tok, backend="causal", batch_size=4, max_length=MAX_LEN,
              device="cpu")
    res = lm_eval.simple_evaluate(model=hf, tasks=["mhla_local"], task_manager=local_task_manager(setup.files),
                                  bootstrap_iters=0)["results"]
    ours = harness_mhla["results"]
    for task, key in (("mhla_ppl_local", "word_perplexity"), ("mhla_ppl_local", "bits_per_byte"),
                      ("mhla_lambada_local", "perplexity")):
        assert res[task][f"{key},none"] == pytest.approx(ours[task][f"{key},none"], rel=1e-4), (task, key)
    assert res["mhla_lambada_local"]["acc,none"] == ours["mhla_lambada_local"]["acc,none"]


# ------------------------------------------------------------------------------------- batching, padding


def test_batches_with_padding_equal_one_at_a_time(setup):
    tok, model = setup.tok, setup.model
    reqs = [SimpleNamespace(args=(p.rsplit(" ", 1)[0], " " + p.rsplit(" ", 1)[1])) for p in setup.passages[:5]]
    reqs.append(SimpleNamespace(args=("", setup.passages[0].split(" ")[0])))        # empty context: prefix
    single = A.MHLAEvalLM(model=model, tokenizer=tok, batch_size=1, max_length=MAX_LEN, device="cpu")
    ref = single.loglikelihood(reqs)
    lengths = {len(encode(tok, r.args[0])) for r in reqs}
    assert len(lengths) > 2                                                         # the batches are padded
    for side in ("right", "left"):
        lm = A.MHLAEvalLM(model=model, tokenizer=tok, batch_size=4, max_length=MAX_LEN, device="cpu",
                          padding_side=side)
        out = lm.loglikelihood(reqs)
        for (ll, greedy), (ll1, greedy1) in zip(out, ref):
            assert ll == pytest.approx(ll1, abs=1e-4) and greedy == greedy1, side
    # the model reads the attention mask: garbage under the padding changes nothing
    pairs = [(encode(tok, r.args[0])[-20:] or [tok.eos_token_id], encode(tok, r.args[1])) for r in reqs]
    a = score_continuations(model, pairs, max_len=MAX_LEN, batch_size=6, padding_side="left", pad_id=0)
    b = score_continuations(model, pairs, max_len=MAX_LEN, batch_size=6, padding_side="left", pad_id=5)
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-5)
    # batched greedy generation (left padding + mask) equals one prompt at a time
    gen = [SimpleNamespace(args=(p[:n], {"until": ["\n\n"], "max_gen_toks": 6}))
           for p, n in zip(setup.passages, (40, 15, 90, 60))]
    batched = A.MHLAEvalLM(model=model, tokenizer=tok, batch_size=4, device="cpu").generate_until(gen)
    assert batched == single.generate_until(gen)
    assert all(isinstance(t, str) for t in batched)


# --------------------------------------------------------------------------------- stock tasks, Table 6


def _fake_lambada_repo(root: Path, passages_file: str) -> Path:
    """A local copy of the dataset repository EleutherAI/lambada_openai (its layout: README configs + data)."""
    repo = root / "EleutherAI" / "lambada_openai"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "test.jsonl").write_text(Path(passages_file).read_text())
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: test\n"
                                    "    path: data/test.jsonl\n---\n")
    return root


def test_stock_task_reads_a_local_dataset_folder(setup, tmp_path):
    """lm-eval's own ``lambada_openai`` YAML, its dataset redirected to a local folder: same numbers as our local
    LAMBADA task on the same file."""
    root = _fake_lambada_repo(tmp_path / "lm_eval_data", setup.files["lambada_file"])
    lm = A.MHLAEvalLM(model=setup.model, tokenizer=setup.tok, batch_size=4, max_length=MAX_LEN, device="cpu")
    tm = TaskManager(include_path=str(STOCK_LAMBADA_DIR), include_defaults=False)
    res = A.run_lm_eval(lm, ["lambada_openai"], data_root=str(root), task_manager=tm)["results"]
    ours = A.run_lm_eval(lm, ["mhla_lambada_local"], task_manager=local_task_manager(setup.files))["results"]
    assert res["lambada_openai"]["sample_len"] == len(setup.passages)
    assert res["lambada_openai"]["perplexity,none"] == pytest.approx(ours["mhla_lambada_local"]["perplexity,none"],
                                                                     rel=1e-9)
    with pytest.raises(Exception):  # without the folder (offline, no cache) the stock task cannot load
        A.run_lm_eval(lm, ["lambada_openai"], data_root=str(tmp_path / "empty"),
                      task_manager=TaskManager(include_path=str(STOCK_LAMBADA_DIR), include_defaults=False))


def test_table6_runs_through_lm_eval(setup, tmp_path, monkeypatch):
    """``scripts/tables/lm_tables.py table6`` (``make reproduce-table6``): a cell with a model goes through the
    harness (here its stock lambada_openai task on a local folder), a cell without one stays 'not trained'."""
    from scripts.tables import lm_tables
    from tasks.language import evaluate

    root = _fake_lambada_repo(tmp_path / "lm_eval_data", setup.files["lambada_file"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "mhla").symlink_to(setup.model_dir, target_is_directory=True)
    monkeypatch.setattr(lm_tables, "table_cells", lambda table: [("mhla", {"row": "MHLA"}), ("gla", {"row": "GLA"})])
    monkeypatch.setattr(evaluate, "TABLE6_TASKS", ("lambada_openai",))
    monkeypatch.setattr(evaluate, "run_lm_eval", partial(
        A.run_lm_eval, task_manager=TaskManager(include_path=str(STOCK_LAMBADA_DIR), include_defaults=False)))
    assert lm_tables.main(["table6", "--ckpt-dir", str(ckpt), "--lm-eval-data", str(root), "--device", "cpu",
                           "--batch-size", "4", "--out", str(tmp_path / "out"),
                           "--results-dir", str(tmp_path / "results")]) == 0
    rows = {r["cell"]: r for r in json.load(open(tmp_path / "results" / "table6.json"))["rows"]}
    direct = evaluate_lambada(setup.model, setup.tok, setup.passages, EvalSettings(max_len=64, batch_size=1))
    assert rows["mhla"]["status"] == "ok"
    assert rows["mhla"]["ours"]["lambada_ppl"] == pytest.approx(direct["ppl"], rel=1e-5)
    assert rows["mhla"]["ours"]["lambada_acc"] == pytest.approx(100 * direct["acc"])
    assert rows["gla"]["status"].startswith("not trained") and rows["gla"]["ours"] == {}
    raw = json.load(open(tmp_path / "out" / "mhla" / "lm_eval_results.json"))
    assert raw["lm_eval"] == lm_eval_version() and "lambada_openai" in raw["results"]
    md = (tmp_path / "results" / "table6.md").read_text()
    assert "lm-evaluation-harness" in md and f"LM_EVAL_DATA={root}" in md


def lm_eval_version():
    from importlib.metadata import version

    return version("lm_eval")
