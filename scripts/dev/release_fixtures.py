#!/usr/bin/env python
"""Build the fixtures of tests/models/test_release_equivalence.py by running the authors' release once.

The release is github.com/DAGroup-PKU/MHLA. This script runs three of its modules on small fixed inputs with
fixed seeds and writes, for each, the inputs, the weights (in the release's state-dict naming) and the outputs
to ``tests/data/release/`` (safetensors), plus ``meta.json`` (the release commit, the command, the versions,
the shapes, and every stub this script had to put in place). It is a development tool: nothing in the package
imports it, the tests only read what it wrote, and none of the release's code is copied into this repository
(the script imports it from the checkout given on the command line).

    git clone https://github.com/DAGroup-PKU/MHLA /tmp/mhla_release          # commit ccf97b2148ad...
    pip install --no-deps --target /tmp/relpkgs timm==1.0.15 einops==0.8.1    # the release's pinned timm
    PYTHONPATH=/tmp/relpkgs TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 .venv/bin/python \\
        scripts/dev/release_fixtures.py --release /tmp/mhla_release --out tests/data/release

The committed fixtures were made with exactly that command from release commit
``ccf97b2148ada1133081303d9a9bf7bc7d29b00d`` (torch 2.14.1, CPU, fp32).

What runs (all on the CPU, fp32, eval mode):

- ``deit``: the release's DeiT-T MHLA classifier (``mhla_image_classification``: ``MHLA_ViT`` with
  ``MHLA_Uniform_Block`` / ``MHLA_Normed_Torch``, built as its registered ``deit_tiny_pla_1d_v6_6`` with the
  training script's ``piece_size=4 transform=linear --gp avg``) at a small size: depth 2, width 36, 3 heads,
  patch 4, 56 px images zero-padded by the model to 64 px (a 16 x 16 token grid in 4 x 4 blocks, the release's
  hard-coded ``embed_len=256``), 10 classes.
- ``lm``: the release's language-model attention layer (``mhla_nlp/fla/layers/mhla.py``, ``MHLA``) as its
  340M config builds it (relu feature map, swish output gate, ``norm_eps`` 1e-6, ``expand_k`` 0.5), width 64,
  4 heads, on 150 tokens (its chunk path: 3 chunks of 64, the last one padded) and on 40 tokens (its
  token-by-token path, which it takes for 64 tokens or fewer).
- ``wan``: the release's Wan2.1 MHLA self-attention (``mhla_videogen/diffusion/model/wan/mhla_utils.py``,
  ``MHLA_Video_Uni``) with its video config's options (``norm_output: false``, ``rope_after``, locality init
  ``transform=linear``, no LePE), width 32, 2 heads, a 2 x 4 x 4 token grid in 2 x 2 x 2 blocks; once without
  and once with its output gate (``is_gated``; the config sets it).

Weights: each module is built with the release's own init under a fixed seed; then every weight but the mixing
matrix gets a seeded perturbation (norm weights ``1 + 0.1 n``, biases ``0.1 n``, other weights ``+ 0.02 n``; the
LM's projections are first drawn from N(0, 0.02), the 340M config's ``initializer_range``), so a swapped or
dropped norm, bias or gain cannot go unnoticed. The mixing matrix keeps the release's init, which the test also
checks against ours.

The release's folders are not put on ``sys.path``: its top-level packages (``models`` of the classifier,
``fla``, ``diffusion``) are registered as empty package stubs over the checkout's folders, so their modules
import from there without running the packages' ``__init__`` (``PYTHONPATH`` only brings the release's timm).

Stubs (none changes what is computed):

- ``torch.compile`` decorators (DeiT, the LM's chunk op) run eagerly: ``TORCHDYNAMO_DISABLE=1``.
- LM: the release's ``fla`` package does not import as shipped (its ``__init__`` pulls ``fla.ops.common``,
  which the release lacks), so ``fla``, ``fla.ops``, ``fla.layers`` and ``fla.modules`` are empty package
  stubs over the release's folders, and the submodules the layer needs are the release's own files. Two
  Triton kernels are replaced by the release's / fla's torch formulas: ``fla.modules.rotary.rotary_embedding``
  by the release's ``rotary_embedding_ref`` (same file), and ``FusedRMSNormGated.forward`` by
  ``x * rsqrt(mean(x^2) + eps) * weight * g * sigmoid(g)`` in fp32 (what its kernel computes for
  ``activation='swish'``).
- Wan: ``diffusion/model/wan/model.py`` does not import without mmcv and the rest of the training stack, so the
  two things ``MHLA_Video_Uni`` takes from it, ``WanRMSNorm`` and ``rope_params``, are executed from that file's
  source (their definitions only, via ``ast``) into a stub module of the same name.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import subprocess
import sys
import types

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the release's @torch.compile functions run eagerly

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def stub_package(name: str, folder: str) -> None:
    """Register ``name`` as an empty package over ``folder``: its submodules import from there, its own
    ``__init__`` does not run."""
    mod = types.ModuleType(name)
    mod.__path__ = [folder]
    sys.modules[name] = mod


def perturb_(module: torch.nn.Module, gen: torch.Generator, skip=()) -> None:
    """Seeded perturbation of every parameter except those named in ``skip`` (module docstring)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(s in name for s in skip):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.add_(0.02 * noise)


def contiguous(d: dict) -> dict:
    return {k: v.detach().contiguous().clone() for k, v in d.items()}


# ------------------------------------------------------------------------------------------------ DeiT
DEIT = dict(embed_dim=36, depth=2, num_heads=3, patch_size=4, img_size=64, input_size=56, num_classes=10,
            piece_size=4, transform="linear", exp_sigma=1, batch=2)


def make_deit(release: str, out: str) -> dict:
    root = os.path.join(release, "mhla_image_classification")
    stub_package("models", os.path.join(root, "models"))  # the release's classifier package (not ours)
    from functools import partial

    from models.mhla_vit import MHLA_ViT  # the release's
    from models.modules.attention.mhla import MHLA_Normed_Torch
    from models.modules.timm_block.mhla import MHLA_Uniform_Block
    import timm

    if timm.__version__ != "1.0.15":
        raise SystemExit(f"the release pins timm 1.0.15, this python has {timm.__version__}: put a folder with "
                         "timm==1.0.15 first on PYTHONPATH (module docstring)")
    c = DEIT
    torch.manual_seed(0)
    # deit_tiny_pla_1d_v6_6 of models/timm_registers.py at a small size (its depth / width are literals there)
    attn_func = partial(MHLA_Normed_Torch, window_size=c["piece_size"] ** 2, embed_len=256,
                        transform=c["transform"], exp_sigma=c["exp_sigma"])
    model = MHLA_ViT(patch_size=c["patch_size"], embed_dim=c["embed_dim"], depth=c["depth"],
                     num_heads=c["num_heads"], img_size=c["img_size"], qk_norm=True, flatten=False,
                     piece_size=c["piece_size"], block_fn=partial(MHLA_Uniform_Block, attn_func=attn_func),
                     class_token=False, global_pool="avg", num_classes=c["num_classes"])
    model.eval()
    init_mixing = model.blocks[0].attn.piece_attn.get_weight_matrix().clone()
    gen = torch.Generator().manual_seed(1)
    perturb_(model, gen, skip=("piece_attn",))
    x = torch.randn(c["batch"], 3, c["input_size"], c["input_size"], generator=gen)
    with torch.no_grad():
        feats = model.forward_features(x)
        logits = model.forward_head(feats)
        # one attention layer alone, on block-major tokens [B, n, w, C] (as the release's blocks see them)
        t = torch.randn(1, 16, 16, c["embed_dim"], generator=gen)
        attn0 = model.blocks[0].attn(t)
        pooled = model.forward_head(feats, pre_logits=True)
    save_file(contiguous(model.state_dict()), os.path.join(out, "deit_weights.safetensors"))
    save_file(contiguous({"x": x, "pooled": pooled, "logits": logits, "attn_in": t, "attn_out": attn0,
                          "init_mixing": init_mixing}), os.path.join(out, "deit_io.safetensors"))
    for name in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
        del sys.modules[name]  # the release's `models` package
    return {"config": c, "timm": timm.__version__, "seeds": "torch.manual_seed(0) before the build, "
            "Generator(1) for the perturbation and the inputs",
            "model": "MHLA_ViT(block_fn=MHLA_Uniform_Block(attn_func=MHLA_Normed_Torch)), eval",
            "shapes": {"x": list(x.shape), "logits": list(logits.shape),
                       "attn_in": list(t.shape), "attn_out": list(attn0.shape)}}


# -------------------------------------------------------------------------------------------------- LM
LM = dict(hidden_size=64, num_heads=4, expand_k=0.5, expand_v=1.0, feature_map="relu", norm_eps=1e-6,
          long=150, short=40, batch=1)


def make_lm(release: str, out: str) -> dict:
    root = os.path.join(release, "mhla_nlp")
    for name in ("fla", "fla.ops", "fla.layers", "fla.modules"):  # package stubs over the release's folders
        stub_package(name, os.path.join(root, *name.split(".")))
    import fla.modules.rotary as rotary
    from fla.modules.fused_norm_gate import FusedRMSNormGated
    from fla.modules.layernorm import RMSNorm

    def rotary_torch(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None):
        assert cu_seqlens is None and seqlen_offsets == 0
        T = x.shape[1]
        return rotary.rotary_embedding_ref(x, cos[:T], sin[:T], interleaved)

    rotary.rotary_embedding = rotary_torch

    def norm_gate_torch(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        assert residual is None and self.activation == "swish"
        xf, gf = x.float(), g.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * gf * torch.sigmoid(gf)).to(x.dtype)

    FusedRMSNormGated.forward = norm_gate_torch
    sys.modules["fla.modules"].FusedRMSNormGated = FusedRMSNormGated
    sys.modules["fla.modules"].RMSNorm = RMSNorm
    sys.modules["fla.modules"].ShortConvolution = None  # use_short_conv=False in the 340M config
    from fla.layers.mhla import MHLA  # the release's layer

    c = LM
    torch.manual_seed(0)
    layer = MHLA(mode="chunk", hidden_size=c["hidden_size"], expand_k=c["expand_k"], expand_v=c["expand_v"],
                 num_heads=c["num_heads"], feature_map=c["feature_map"], use_output_gate=True, gate_fn="swish",
                 norm_eps=c["norm_eps"], fuse_norm=True, layer_idx=0)
    layer.eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))  # initializer_range 0.02
    perturb_(layer, gen, skip=("mixing_matrix", "proj"))
    x_long = torch.randn(c["batch"], c["long"], c["hidden_size"], generator=gen)
    x_short = torch.randn(c["batch"], c["short"], c["hidden_size"], generator=gen)
    with torch.no_grad():
        y_long = layer(x_long)[0]
        y_short = layer(x_short)[0]
    save_file(contiguous(layer.state_dict()), os.path.join(out, "lm_weights.safetensors"))
    save_file(contiguous({"x_long": x_long, "y_long": y_long, "x_short": x_short, "y_short": y_short}),
              os.path.join(out, "lm_io.safetensors"))
    return {"config": c, "layer": "fla.layers.mhla.MHLA(mode='chunk', use_output_gate=True, gate_fn='swish', "
                                  "fuse_norm=True), eval; x_long runs its chunk path, x_short (<= 64 tokens) its "
                                  "token-by-token path",
            "shapes": {"x_long": list(x_long.shape), "x_short": list(x_short.shape)}}


# ------------------------------------------------------------------------------------------------- Wan
WAN = dict(dim=32, num_heads=2, block_layout=[2, 2, 2], grid=[2, 4, 4], transform="linear", eps=1e-6, batch=2)


def load_defs(path: str, names: set[str], module_name: str) -> types.ModuleType:
    """A module holding only the top-level definitions ``names`` of the file ``path`` (executed from its
    source, with the file's imports)."""
    tree = ast.parse(open(path).read(), path)
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and all(
        (a.name.split(".")[0] in ("torch", "math", "einops")) for a in n.names) and (
        not isinstance(n, ast.ImportFrom) or (n.module or "").split(".")[0] in ("torch", "math", "einops"))]
    keep += [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    mod = types.ModuleType(module_name)
    mod.__file__ = path
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), mod.__dict__)
    return mod


def make_wan(release: str, out: str) -> dict:
    root = os.path.join(release, "mhla_videogen")
    wan_dir = os.path.join(root, "diffusion", "model", "wan")
    stub = load_defs(os.path.join(wan_dir, "model.py"), {"WanRMSNorm", "rope_params"},
                     "diffusion.model.wan.model")
    for name in ("diffusion", "diffusion.model", "diffusion.model.wan"):
        stub_package(name, os.path.join(root, *name.split(".")))
    sys.modules["diffusion.model.wan.model"] = stub
    spec = importlib.util.spec_from_file_location("diffusion.model.wan.mhla_utils",
                                                  os.path.join(wan_dir, "mhla_utils.py"))
    mhla_utils = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mhla_utils
    spec.loader.exec_module(mhla_utils)

    c = WAN
    F_, H_, W_ = c["grid"]
    d = c["dim"] // c["num_heads"]
    # WanModel.__init__ (model.py): the complex rotary table of one head
    freqs = torch.cat([stub.rope_params(1024, d - 4 * (d // 6)), stub.rope_params(1024, 2 * (d // 6)),
                       stub.rope_params(1024, 2 * (d // 6))], dim=1)
    grid_sizes = torch.tensor([c["grid"]] * c["batch"], dtype=torch.long)
    seq_lens = torch.full((c["batch"],), F_ * H_ * W_, dtype=torch.long)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(c["batch"], F_ * H_ * W_, c["dim"], generator=gen)
    result, tensors = {"variants": {}}, {"x": x}
    for gated in (False, True):
        torch.manual_seed(0)
        # the options of configs/Wan_1300M_mhla.yaml (norm_output: false -> normalize_out, rope_after, no LePE)
        layer = mhla_utils.MHLA_Video_Uni(c["dim"], num_heads=c["num_heads"], qk_norm=True,
                                          block_layout=tuple(c["block_layout"]), transform=c["transform"],
                                          eps=c["eps"], is_gated=gated, is_lepe=False, normalize_out=False,
                                          rope_after=True, out_rmsnorm=True)
        layer.eval()
        tag = "gated" if gated else "plain"
        init_mixing = layer.block_attn.get_weight_matrix().clone()
        perturb_(layer, torch.Generator().manual_seed(4), skip=("block_attn",))
        with torch.no_grad():
            y = layer(x, seq_lens, grid_sizes, freqs)
        save_file(contiguous(layer.state_dict()), os.path.join(out, f"wan_{tag}_weights.safetensors"))
        tensors[f"y_{tag}"] = y
        tensors["init_mixing"] = init_mixing
        result["variants"][tag] = {"is_gated": gated, "shape_y": list(y.shape)}
    # the argument slip of model.py (MHLA_Video_Uni(dim, num_heads, window_size, qk_norm, eps, ...) fills
    # dim_head, dropout and fixed_weight_value positionally): what it leaves in the mixing matrix
    slip = mhla_utils.MHLA_Video_Uni(c["dim"], c["num_heads"], (-1, -1), True, c["eps"],
                                     block_layout=tuple(c["block_layout"]), normalize_out=False)
    w = slip.block_attn.get_weight_matrix()
    result["argument_slip_mixing"] = {"min": float(w.min()), "max": float(w.max())}
    save_file(contiguous(tensors), os.path.join(out, "wan_io.safetensors"))
    result.update(config=c, shapes={"x": list(x.shape)})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", required=True, help="a checkout of github.com/DAGroup-PKU/MHLA")
    ap.add_argument("--out", default="tests/data/release")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "-C", args.release, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    meta = {
        "release": "https://github.com/DAGroup-PKU/MHLA",
        "release_commit": commit,
        "command": "PYTHONPATH=<folder with timm==1.0.15 einops==0.8.1> TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 "
                   ".venv/bin/python scripts/dev/release_fixtures.py --release <checkout of the release> "
                   "--out tests/data/release",
        "torch": torch.__version__, "python": platform.python_version(), "device": "cpu", "dtype": "float32",
        "stubs": "see scripts/dev/release_fixtures.py (torch.compile off; fla package stubs, rotary and fused "
                 "norm-gate Triton kernels replaced by their torch formulas; Wan's WanRMSNorm / rope_params "
                 "executed from model.py's source)",
        "files": {},
    }
    meta["deit"] = make_deit(args.release, args.out)
    meta["lm"] = make_lm(args.release, args.out)
    meta["wan"] = make_wan(args.release, args.out)
    for f in sorted(os.listdir(args.out)):
        if f.endswith(".safetensors"):
            meta["files"][f] = os.path.getsize(os.path.join(args.out, f))
    with open(os.path.join(args.out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.write("\n")
    print(json.dumps(meta["files"], indent=1))


if __name__ == "__main__":
    main()
