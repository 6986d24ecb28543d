"""lm-evaluation-harness adapter: run the harness's tasks (Table 6: MMLU, WinoGrande, PIQA, ARC-c/e, OpenBookQA,
BoolQ, wikitext, lambada_openai) and our local tasks (``tasks/language/lm_eval_tasks/``) on our models.

``MHLAEvalLM`` implements the harness's ``LM`` interface (requests carry their arguments in ``.args``):

* ``loglikelihood(requests)``: ``args = (context, continuation)`` -> ``[(log p(continuation | context), is_greedy)]``
* ``loglikelihood_rolling(requests)``: ``args = (text,)`` -> ``[log p(text)]`` over the harness's rolling windows
* ``generate_until(requests)``: ``args = (context, {"until": [...], "max_gen_toks": N, ...})`` -> ``[text]``
  (greedy; the text stops before the first stop string)

Conventions are those of the harness's own HF model (``--model hf``, lm-eval 0.4): contexts are encoded with
:func:`~tasks.language.eval_ppl.encode_pair`, an empty context is the ``prefix_token_id`` (the tokenizer's BOS,
else EOS), rolling documents are cut into disjoint windows of ``max_length`` tokens
(:func:`~tasks.language.eval_ppl.rolling_windows` = ``get_rolling_token_windows`` + ``make_disjoint_window``, the
first window conditioned on the prefix token). Batches (``batch_size`` windows / requests per forward pass,
longest first) carry the 2-D ``attention_mask`` of their padding: right padding for scoring (``padding_side``
model arg; as the harness's HF model, and exact for any causal model), left padding for batched generation.

``lm_eval`` (0.4.x, pinned in requirements.lock) is installed by ``make install``; importing this module
registers the class as ``--model mhla``. The module still imports without lm_eval (then it is a plain class)::

    export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1      # nothing is downloaded at run time
    python -m tasks.language.lm_eval_adapter --model mhla --model_args pretrained=/ckpt/mhla-340m \\
        --tasks mmlu,winogrande,piqa,arc_challenge,arc_easy,openbookqa,boolq,wikitext,lambada_openai \\
        --batch_size 16 --output_path results/lm_eval/mhla
    # the local tasks (jsonl files; write them from the gensim corpus with write_local_task_data()):
    python -m tasks.language.lm_eval_adapter --model mhla --model_args pretrained=/ckpt/mhla-340m \\
        --include_path tasks/language/lm_eval_tasks --tasks mhla_local \\
        --metadata '{"lambada_file": "/data/lambada.jsonl", "text_file": "/data/docs.jsonl"}'

(``python -m tasks.language.lm_eval_adapter`` imports this module, so the registration happens, then runs the
harness's own CLI; ``lm_eval --include_path`` does not load model classes.) ``pretrained`` is a folder written
by ``save_pretrained`` (config + weights + tokenizer); ``tokenizer=PATH`` overrides the tokenizer folder.

Stock tasks read their Hugging Face datasets; offline they come from a local copy: either a filled HF cache
(``HF_HOME``, with ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``) or plain folders, one per dataset repository
(``DIR/cais/mmlu``, ``DIR/EleutherAI/lambada_openai``, ...; :func:`local_datasets` redirects the harness's
``datasets.load_dataset`` calls to them; ``make reproduce-table6 LM_EVAL_DATA=DIR``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .data import gensim_documents, is_validation
from .eval_ppl import (
    encode,
    model_max_length,
    pad_batch,
    prefix_token_id,
    request_tokens,
    rolling_loglikelihood,
    score_continuations,
)

try:  # the harness (a dependency in requirements.lock); this module also works without it
    from lm_eval.api.model import LM as _HarnessLM
    from lm_eval.api.registry import register_model as _register_model

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - depends on the environment
    _HarnessLM, _register_model, HAVE_LM_EVAL = object, None, False


def _args(request) -> tuple:
    return tuple(request.args) if hasattr(request, "args") else tuple(request)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    end = len(text)
    for s in stops:
        if s:
            i = text.find(s)
            if i != -1:
                end = min(end, i)
    return text[:end]


def _cut_at_eos(new: Sequence[int], eos: Sequence[int]) -> list[int]:
    for i, t in enumerate(new):
        if t in eos:
            return list(new[:i])
    return list(new)


@torch.no_grad()
def greedy_generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                          eos_token_ids: Sequence[int] = (), pad_token_id: int = 0) -> list[list[int]]:
    """Greedy continuations of several prompts in one ``generate`` call: left padding and the 2-D attention mask
    (our LM runs every row alone, so each row equals its one-prompt generation). Returns only the new tokens of
    each prompt, up to (not including) its first EOS id."""
    device = next(model.parameters()).device
    eos = [int(e) for e in eos_token_ids if e is not None]
    ids, mask, _ = pad_batch(prompts, pad_token_id, side="left")
    if mask is None:
        mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=int(max_new_tokens), do_sample=False, num_beams=1,
                         eos_token_id=eos or None, pad_token_id=pad_token_id)
    model.train(was_training)
    return [_cut_at_eos(row[ids.shape[1]:].tolist(), eos) for row in out]


def greedy_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, *, eos_token_ids: Sequence[int] = (),
                    pad_token_id: int = 0) -> list[int]:
    """Greedy continuation of one prompt (at most ``max_new_tokens`` new tokens, stops after an EOS id).

    Uses the model's ``generate`` (cached decoding for our model, every HF causal LM) and returns only the new
    tokens, EOS excluded.
    """
    return greedy_generate_batch(model, [list(prompt_ids)], max_new_tokens, eos_token_ids=eos_token_ids,
                                 pad_token_id=pad_token_id)[0]


class MHLAEvalLM(_HarnessLM):
    """The harness's ``LM`` interface over a Hugging Face-style causal LM and tokenizer.

    Args:
        pretrained: folder with ``config.json`` + weights (``AutoModelForCausalLM``; importing :mod:`models.lm`
            registers ``MHLALMForCausalLM``). Or pass ``model=`` and ``tokenizer=`` objects directly.
        tokenizer: tokenizer object or folder (default: ``pretrained``).
        batch_size: windows / requests per forward pass (``auto``: 8). max_length: context (default: the model
            config's).
        device: ``"cpu"``, ``"cuda"``, ... dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"``.
        max_gen_toks: default generation budget of ``generate_until``.
        padding_side: padding of scoring batches, ``right`` (default) or ``left`` (both pass the attention mask;
            see :func:`~tasks.language.eval_ppl.score_continuations`). Generation always pads left.
    """

    def __init__(self, pretrained: str | None = None, model=None, tokenizer=None, batch_size: int | str = 8,
                 max_length: int | None = None, device: str | None = None, dtype: str = "float32",
                 max_gen_toks: int = 256, padding_side: str = "right", **kwargs):
        if HAVE_LM_EVAL:
            super().__init__()
        else:
            self._rank, self._world_size = 0, 1
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            if pretrained is None:
                raise ValueError("give pretrained=PATH (a save_pretrained folder) or a model object")
            from transformers import AutoModelForCausalLM  # noqa: PLC0415

            import models.lm  # noqa: F401, PLC0415  (registers MHLALMForCausalLM with AutoModelForCausalLM)

            model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=getattr(torch, dtype))
        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer  # noqa: PLC0415

            path = tokenizer or pretrained
            if path is None:
                raise ValueError("give tokenizer=PATH or a tokenizer object")
            tokenizer = AutoTokenizer.from_pretrained(path)
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be left or right, got {padding_side!r}")
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.tokenizer = tokenizer
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length) if max_length else model_max_length(self.model)
        self.max_gen_toks = int(max_gen_toks)
        self.padding_side = padding_side
        self.pretrained = pretrained

    # ------------------------------------------------------------------ harness plumbing (lm_eval >= 0.4)
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """``"pretrained=/ckpt,batch_size=16"`` -> instance (the harness's ``--model_args`` syntax)."""
        kwargs = {}
        for part in filter(None, (arg_string or "").split(",")):
            key, _, value = part.partition("=")
            kwargs[key.strip()] = value.strip()
        return cls(**cls._with_harness_config(kwargs, additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """``{"pretrained": "/ckpt", ...}`` -> instance (``simple_evaluate(model="mhla", model_args={...})``)."""
        return cls(**cls._with_harness_config(dict(arg_dict), additional_config))

    @staticmethod
    def _with_harness_config(kwargs: dict, additional_config: dict | None) -> dict:
        for key, value in (additional_config or {}).items():
            if value is not None and key in ("batch_size", "device", "max_length"):
                kwargs.setdefault(key, value)
        return kwargs

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        for name in ("eos_token_id", "bos_token_id"):
            v = getattr(self.tokenizer, name, None)
            if isinstance(v, int):
                return v
        raise ValueError("the tokenizer has neither an EOS nor a BOS token")

    @property
    def prefix_token_id(self) -> int:
        """Conditions rolling documents and empty contexts: BOS, else EOS (the harness's HF model)."""
        return prefix_token_id(self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__).replace("/", "__")

    def get_model_info(self) -> dict:
        """Recorded in the harness's results (``config``)."""
        cfg = getattr(self.model, "config", None)
        return {"model_class": type(self.model).__name__, "pretrained": self.pretrained,
                "attn_type": getattr(cfg, "attn_type", None), "max_length": self.max_length,
                "padding_side": self.padding_side,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters())}

    # ---------------------------------------------------------------------------------- the interface
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        prefix = self.prefix_token_id
        pairs = []
        for req in requests:
            context, continuation = _args(req)[:2]
            ctx, cont = request_tokens(self.tokenizer, context, continuation, prefix)
            pairs.append((ctx, cont[-self.max_length:]))
        scores = score_continuations(self.model, pairs, max_len=self.max_length, batch_size=self.batch_size,
                                     device=self.device, padding_side=self.padding_side,
                                     pad_id=self.eot_token_id)
        return [(ll, greedy) for ll, greedy, _ in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [encode(self.tokenizer, _args(req)[0]) for req in requests]
        res = rolling_loglikelihood(self.model, docs, prefix_token=self.prefix_token_id, max_len=self.max_length,
                                    batch_size=self.batch_size, device=self.device,
                                    padding_side=self.padding_side)
        return [ll for ll, _ in res]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation, ``batch_size`` prompts per ``generate`` call (left padding + attention mask);
        requests with the same generation arguments are batched together, longest prompt first."""
        outs: list = [None] * len(requests)
        groups: dict[str, list] = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = (_args(req) + ({},))[:2]
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise NotImplementedError("MHLAEvalLM generates greedily; the request asks for sampling")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = encode(self.tokenizer, context)[-max(1, self.max_length - max_new):]
            key = json.dumps([max_new, until])
            groups.setdefault(key, []).append((i, ids, until, max_new))
        for items in groups.values():
            items.sort(key=lambda it: -len(it[1]))
            for b in range(0, len(items), self.batch_size):
                chunk = items[b:b + self.batch_size]
                news = greedy_generate_batch(self.model, [ids for _, ids, _, _ in chunk], chunk[0][3],
                                             eos_token_ids=[self.eot_token_id], pad_token_id=self.eot_token_id)
                for (i, _, until, _), new in zip(chunk, news):
                    outs[i] = cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), until)
        return outs


if HAVE_LM_EVAL:  # pragma: no cover - depends on the environment
    MHLAEvalLM = _register_model("mhla")(MHLAEvalLM)


TABLE6_TASKS = ("mmlu", "winogrande", "piqa", "arc_challenge", "arc_easy", "openbookqa", "boolq", "wikitext",
                "lambada_openai")

# The Hugging Face dataset repository each Table 6 task reads (lm-eval 0.4.13's task YAMLs).
TABLE6_DATASETS = {
    "mmlu": "cais/mmlu", "winogrande": "allenai/winogrande", "piqa": "baber/piqa", "arc_challenge": "allenai/ai2_arc",
    "arc_easy": "allenai/ai2_arc", "openbookqa": "allenai/openbookqa", "boolq": "aps/super_glue",
    "wikitext": "EleutherAI/wikitext_document_level", "lambada_openai": "EleutherAI/lambada_openai",
}

INSTALL_HELP = (
    "lm-evaluation-harness is not importable: run `make install` (requirements.lock pins lm_eval==0.4.13).\n"
    "Table 6's tasks read Hugging Face datasets; nothing is downloaded at run time. Either fill a cache once on a "
    "machine with internet and copy it:\n"
    "  HF_HOME=/data/hf .venv/bin/python -m tasks.language.lm_eval_adapter --model mhla \\\n"
    "      --model_args pretrained=PATH --tasks " + ",".join(TABLE6_TASKS) + " --limit 1\n"
    "  HF_HOME=/data/hf HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 make reproduce-table6 CKPT_DIR=/ckpt\n"
    "or download the dataset repositories as plain folders (hf download --repo-type dataset REPO --local-dir "
    "/data/lm_eval/REPO for " + ", ".join(sorted(set(TABLE6_DATASETS.values()))) + ") and run\n"
    "  HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 make reproduce-table6 CKPT_DIR=/ckpt LM_EVAL_DATA=/data/lm_eval")


# ------------------------------------------------------------------------------- local data and tasks

LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
LOCAL_TASKS = ("mhla_lambada_local", "mhla_ppl_local")   # the tag mhla_local names both


def heldout_documents(val_fraction: float = 0.05, split_seed: int = 0) -> list[str]:
    """The gensim corpus's validation documents under lm_mini's split (``configs/data/text_gensim.yaml``:
    ``val_fraction`` 0.05, ``split_seed`` 0): text that ``task=lm_mini`` never trains on."""
    return [d for i, d in enumerate(gensim_documents()) if is_validation(i, val_fraction, split_seed)]


def lambada_passage(doc: str, n_words: int) -> str | None:
    """A LAMBADA-style passage from ``doc``: its first ``n_words`` words, the punctuation around the last word
    removed (the target is a bare word, as in LAMBADA); ``None`` when no word is left."""
    words = doc.split()[:n_words]
    while words:
        last = words[-1].strip(".,;:!?\"'()[]{}")
        if any(c.isalnum() for c in last):
            return " ".join(words[:-1] + [last])
        words = words[:-1]
    return None


def write_local_task_data(out_dir: str | os.PathLike, docs: Sequence[str] | None = None, n_docs: int = 16,
                          max_chars: int | None = 2000, lambada_words: int = 48) -> dict[str, str]:
    """Write the two local tasks' jsonl files (``text.jsonl``: whole documents, cut at a word boundary to at most
    ``max_chars`` characters; ``lambada.jsonl``: LAMBADA-style passages of their first ``lambada_words`` words)
    from ``docs`` (default: the first ``n_docs`` held-out gensim documents, :func:`heldout_documents`).
    Returns ``{"lambada_file": ..., "text_file": ...}``: the tasks' metadata (``run_lm_eval(metadata=...)``,
    ``--metadata`` of the harness's CLI)."""
    docs = list(docs) if docs is not None else heldout_documents()[:n_docs]
    texts = []
    for d in docs:
        d = d.strip()
        if max_chars and len(d) > max_chars:
            d = d[:max_chars].rsplit(" ", 1)[0]
        if d:
            texts.append(d)
    passages = [p for p in (lambada_passage(d, lambada_words) for d in docs) if p and " " in p]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"lambada_file": out / "lambada.jsonl", "text_file": out / "text.jsonl"}
    for key, rows in (("lambada_file", passages), ("text_file", texts)):
        with open(files[key], "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"text": r}, ensure_ascii=False) + "\n")
    return {k: str(v) for k, v in files.items()}


@contextlib.contextmanager
def local_datasets(root: str | os.PathLike | None):
    """Within the block, ``datasets.load_dataset(path=REPO, ...)`` reads ``root/REPO`` when that folder exists
    (a dataset repository downloaded as plain files, e.g. ``hf download --repo-type dataset cais/mmlu
    --local-dir root/cais/mmlu``): the harness's stock tasks run on local copies without a hub cache. Other
    paths are left alone. ``root=None``: no change."""
    if not root:
        yield
        return
    import datasets  # noqa: PLC0415

    root = Path(os.path.expanduser(str(root)))
    original = datasets.load_dataset

    def load_dataset(path=None, *args, **kwargs):
        if isinstance(path, str) and (root / path).is_dir():
            path = str(root / path)
        return original(path, *args, **kwargs)

    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original


def run_lm_eval(lm, tasks: Sequence, *, include_local: bool = True, data_root: str | None = None,
                metadata: dict | None = None, task_manager=None, **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` of ``lm`` (an ``LM`` object) on ``tasks`` (names, task dicts or Task objects)
    with our local tasks on the search path, ``metadata`` given to every task (our local tasks read
    ``lambada_file`` / ``text_file`` from it, :func:`write_local_task_data`) and the stock tasks' datasets
    redirected to ``data_root`` (:func:`local_datasets`). ``task_manager`` replaces the one built here.
    ``kwargs`` go to ``simple_evaluate`` (``limit``, ``log_samples``, ``bootstrap_iters`` (default 0: no
    bootstrap standard errors), ...)."""
    import lm_eval  # noqa: PLC0415
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    if task_manager is None:
        task_manager = TaskManager(include_path=str(LOCAL_TASKS_DIR) if include_local else None, metadata=metadata)
    kwargs.setdefault("bootstrap_iters", 0)
    with local_datasets(data_root):
        return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager, **kwargs)


def main(argv=None) -> int:  # pragma: no cover - thin wrapper over the harness CLI
    """Run the harness's CLI with ``--model mhla`` registered; ``--local-data DIR`` (ours, removed before the
    harness sees the arguments) redirects the stock tasks' datasets to ``DIR/REPO`` folders."""
    if not HAVE_LM_EVAL:
        print(INSTALL_HELP, file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    args = list(argv if argv is not None else sys.argv[1:])
    root = None
    if "--local-data" in args:
        i = args.index("--local-data")
        root = args[i + 1]
        del args[i:i + 2]
    sys.argv = [sys.argv[0], *args]
    with local_datasets(root):
        cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
