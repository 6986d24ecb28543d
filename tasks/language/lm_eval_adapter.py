"""lm-evaluation-harness adapter: run the harness's tasks (Table 6: MMLU, WinoGrande, PIQA, ARC-c/e, OpenBookQA,
BoolQ, wikitext, lambada_openai) on our models, from local task data.

``MHLAEvalLM`` implements the harness's ``LM`` interface (requests carry their arguments in ``.args``):

* ``loglikelihood(requests)``: ``args = (context, continuation)`` -> ``[(log p(continuation | context), is_greedy)]``
* ``loglikelihood_rolling(requests)``: ``args = (text,)`` -> ``[log p(text)]`` over the harness's rolling windows
* ``generate_until(requests)``: ``args = (context, {"until": [...], "max_gen_toks": N, ...})`` -> ``[text]``
  (greedy; the text stops before the first stop string)

It works standalone (``lm_eval`` is not a dependency: scoring lives in :mod:`tasks.language.eval_ppl`), and when
``lm_eval`` is installed it subclasses ``lm_eval.api.model.LM`` and registers itself as ``--model mhla``::

    pip install lm_eval==0.4.*                  # not in requirements.lock
    export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_DATASETS_CACHE=/data/hf_datasets   # pre-filled cache
    python -m tasks.language.lm_eval_adapter --model mhla --model_args pretrained=/ckpt/mhla-340m \\
        --tasks mmlu,winogrande,piqa,arc_challenge,arc_easy,openbookqa,boolq,wikitext,lambada_openai \\
        --batch_size 16 --output_path results/lm_eval/mhla

(``python -m tasks.language.lm_eval_adapter`` imports this module, so the registration happens, then runs the
harness's own CLI; ``lm_eval --include_path`` does not load model classes.) ``pretrained`` is a folder written
by ``save_pretrained`` (config + weights + tokenizer); ``tokenizer=PATH`` overrides the tokenizer folder.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from .eval_ppl import encode, encode_pair, model_max_length, rolling_loglikelihood, score_continuations

try:  # the harness is optional
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


@torch.no_grad()
def greedy_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, *, eos_token_ids: Sequence[int] = (),
                    pad_token_id: int = 0) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (at most ``max_new_tokens`` new tokens, stops after an EOS id).

    Uses the model's ``generate`` (cached decoding for our model, every HF causal LM) and returns only the new
    tokens, EOS excluded.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    eos = [int(e) for e in eos_token_ids if e is not None]
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(max_new_tokens),
                         do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=pad_token_id)
    model.train(was_training)
    new = out[0, ids.shape[1]:].tolist()
    for i, t in enumerate(new):
        if t in eos:
            return new[:i]
    return new


class MHLAEvalLM(_HarnessLM):
    """The harness's ``LM`` interface over a Hugging Face-style causal LM and tokenizer.

    Args:
        pretrained: folder with ``config.json`` + weights (``AutoModelForCausalLM``; importing :mod:`models.lm`
            registers ``MHLALMForCausalLM``). Or pass ``model=`` and ``tokenizer=`` objects directly.
        tokenizer: tokenizer object or folder (default: ``pretrained``).
        batch_size: windows per forward pass. max_length: context (default: the model config's).
        device: ``"cpu"``, ``"cuda"``, ... dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"``.
        max_gen_toks: default generation budget of ``generate_until``.
    """

    def __init__(self, pretrained: str | None = None, model=None, tokenizer=None, batch_size: int | str = 8,
                 max_length: int | None = None, device: str | None = None, dtype: str = "float32",
                 max_gen_toks: int = 256, **kwargs):
        if HAVE_LM_EVAL:
            super().__init__()
        else:
            self._rank, self._world_size = 0, 1
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            if pretrained is None:
                raise ValueError("give pretrained=PATH (a save_pretrained folder) or a model object")
            import models.lm  # noqa: F401, PLC0415  (registers MHLALMForCausalLM with AutoModelForCausalLM)
            from transformers import AutoModelForCausalLM  # noqa: PLC0415

            model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=getattr(torch, dtype))
        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer  # noqa: PLC0415

            path = tokenizer or pretrained
            if path is None:
                raise ValueError("give tokenizer=PATH or a tokenizer object")
            tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length) if max_length else model_max_length(self.model)
        self.max_gen_toks = int(max_gen_toks)
        self.device = torch.device(device)

    # ------------------------------------------------------------------ harness plumbing (lm_eval >= 0.4)
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """``"pretrained=/ckpt,batch_size=16"`` -> instance (the harness's ``--model_args`` syntax)."""
        kwargs = {}
        for part in filter(None, (arg_string or "").split(",")):
            key, _, value = part.partition("=")
            kwargs[key.strip()] = value.strip()
        for key, value in (additional_config or {}).items():
            if value is not None and key in ("batch_size", "device", "max_length"):
                kwargs.setdefault(key, value)
        return cls(**kwargs)

    @property
    def eot_token_id(self) -> int:
        for name in ("eos_token_id", "bos_token_id"):
            v = getattr(self.tokenizer, name, None)
            if isinstance(v, int):
                return v
        raise ValueError("the tokenizer has neither an EOS nor a BOS token")

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__).replace("/", "__")

    # ---------------------------------------------------------------------------------- the interface
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = _args(req)[:2]
            if context == "":  # unconditional: the EOT token is the context
                ctx, cont = [self.eot_token_id], encode(self.tokenizer, continuation)
            else:
                ctx, cont = encode_pair(self.tokenizer, context, continuation)
            pairs.append((ctx, cont[-self.max_length:]))
        scores = score_continuations(self.model, pairs, max_len=self.max_length, batch_size=self.batch_size,
                                     device=self.device)
        return [(ll, greedy) for ll, greedy, _ in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [encode(self.tokenizer, _args(req)[0]) for req in requests]
        res = rolling_loglikelihood(self.model, docs, prefix_token=self.eot_token_id, max_len=self.max_length,
                                    batch_size=self.batch_size, device=self.device)
        return [ll for ll, _ in res]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outs = []
        for req in requests:
            context, gen_kwargs = (_args(req) + ({},))[:2]
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise NotImplementedError("MHLAEvalLM generates greedily; the request asks for sampling")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = encode(self.tokenizer, context)[-max(1, self.max_length - max_new):]
            new = greedy_generate(self.model, ids, max_new, eos_token_ids=[self.eot_token_id],
                                  pad_token_id=self.eot_token_id)
            outs.append(cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), until))
        return outs


if HAVE_LM_EVAL:  # pragma: no cover - depends on the environment
    MHLAEvalLM = _register_model("mhla")(MHLAEvalLM)


TABLE6_TASKS = ("mmlu", "winogrande", "piqa", "arc_challenge", "arc_easy", "openbookqa", "boolq", "wikitext",
                "lambada_openai")

INSTALL_HELP = (
    "lm-evaluation-harness is not installed (it is not in requirements.lock). To run Table 6's tasks:\n"
    "  .venv/bin/pip install 'lm_eval==0.4.*'\n"
    "  # on a machine with internet, fill a datasets cache once:\n"
    "  HF_DATASETS_CACHE=/data/hf_datasets .venv/bin/python -m tasks.language.lm_eval_adapter --model mhla \\\n"
    "      --model_args pretrained=PATH --tasks " + ",".join(TABLE6_TASKS) + " --limit 1\n"
    "  # then offline, with the cache copied to this machine:\n"
    "  HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_DATASETS_CACHE=/data/hf_datasets make reproduce-table6 "
    "CKPT_DIR=/ckpt")


def main(argv=None) -> int:  # pragma: no cover - thin wrapper over the harness CLI
    """Run the harness's CLI with ``--model mhla`` registered."""
    if not HAVE_LM_EVAL:
        print(INSTALL_HELP, file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    sys.argv = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
