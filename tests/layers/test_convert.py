"""``mhla.convert`` and the distillation stage (docs/conversion.md).

Per family (timm ViT with timm's own attention and with a registered one, our LM, transformers' Llama with
grouped k / v heads, diffusers' Wan with rotary tables and DiT): converting to ``attn="softmax"`` reproduces
the original's outputs (so every weight went where it belongs: a q / k / v split, a head order, a norm or RoPE
mapped wrongly fails here), the converted model keeps its library's API (timm forward, transformers generate,
diffusers forward), and the MHLA conversion runs forward and backward. Then the distillation stage (it lowers
the attention gap and trains only what it should) and the path through ``python -m tasks.conversion.distill``
and ``train.py trainer.init_from``."""

from __future__ import annotations

import os

import pytest
import torch

import mhla
from mhla.conversion import attention_modules, model_family
from mhla.distill import attention_gap, distill_attention

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def close(a, b, tol=1e-10):
    return torch.allclose(a, b, atol=tol, rtol=0)


def mixing_grads(model):
    grads = [p.grad for n, p in model.named_parameters() if "mixing" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    return grads


# ------------------------------------------------------------------------------------------- timm ViT
def timm_vit(**kw):
    from timm.models.vision_transformer import VisionTransformer  # noqa: PLC0415

    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                             num_heads=4, **kw).double().eval()


@pytest.mark.parametrize("kw", [dict(qk_norm=True), dict(class_token=False, global_pool="avg", reg_tokens=2)])
def test_timm_vit_softmax_reproduces_the_original(kw):
    vit = timm_vit(**kw)
    x = torch.randn(2, 1, 32, 32, dtype=torch.float64)
    ref = vit(x)
    conv = mhla.convert(vit, "softmax", copy=True).eval()
    assert model_family(vit) == "timm_vit"
    assert not hasattr(vit, "mhla_conversion")  # copy: the original untouched
    assert all(isinstance(m, mhla.SoftmaxAttention) for m in attention_modules(conv).values())
    assert close(conv(x), ref)
    assert close(conv.forward_head(conv.forward_features(x)), ref)  # timm's API
    assert conv.mhla_conversion["new_parameters"] == []


def test_timm_vit_mhla_layout_and_gradients():
    vit = timm_vit(qk_norm=True)
    conv = mhla.convert(vit, "mhla", copy=True)
    layer = conv.blocks[0].attn
    assert isinstance(layer, mhla.MultiHeadLinearAttention)
    assert layer.grid == (8, 8) and layer.num_prefix_tokens == 1 and layer.blocks == (2, 2)
    assert isinstance(layer.q_norm, torch.nn.LayerNorm)  # timm's own norm, kept (copied with the model)
    assert torch.equal(layer.qkv.weight, vit.blocks[0].attn.qkv.weight)
    conv.train()(torch.randn(2, 1, 32, 32, dtype=torch.float64)).sum().backward()
    mixing_grads(conv)
    assert conv.mhla_conversion["new_parameters"] == ["blocks.0.attn.mixing.raw", "blocks.1.attn.mixing.raw"]


def test_default_layout_is_num_blocks_auto():
    """Without a layout, a converted ViT's MHLA takes the blocks num_blocks=auto picks on its patch grid."""
    from mhla.layouts import auto_blocks  # noqa: PLC0415

    vit = timm_vit()  # 8 x 8 patches
    conv = mhla.convert(vit, "mhla", copy=True)
    assert conv.mhla_conversion["attn"]["blocks"] == list(auto_blocks((8, 8))) == [2, 2]


def test_our_vit_converts_to_the_model_train_py_builds():
    """The registered-layer ViT (train.py's vit_mnist with softmax): softmax reproduces it; MHLA gives exactly
    the parameters of the MHLA ViT built from scratch (so train.py can load the converted weights)."""
    from models.vit import create_vit  # noqa: PLC0415

    kw = dict(img_size=32, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=4,
              qk_norm=True, class_token=False, global_pool="avg")
    torch.manual_seed(0)
    vit = create_vit("v", "softmax", **kw).double().eval()
    x = torch.randn(2, 1, 32, 32, dtype=torch.float64)
    assert close(mhla.convert(vit, "softmax", copy=True)(x), vit(x))
    conv = mhla.convert(vit, {"name": "mhla", "num_blocks": 4}, copy=True)
    fresh = create_vit("v", {"name": "mhla", "num_blocks": 4}, **kw)
    shapes = lambda m: {k: v.shape for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(conv) == shapes(fresh)
    assert torch.equal(conv.blocks[1].attn.q_norm.weight, vit.blocks[1].attn.q_norm.weight)


# ------------------------------------------------------------------------------------------- our LM
def our_lm(attn="softmax", **kw):
    from models.lm import MHLALMConfig, MHLALMForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = MHLALMConfig(attn=attn, vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2,
                       max_position_embeddings=64, **kw)
    return MHLALMForCausalLM(cfg).double().eval()


def test_our_lm_softmax_reproduces_and_mhla_saves_loads_generates(tmp_path):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    lm = our_lm()
    ids = torch.randint(0, 97, (2, 40))
    ref = lm(ids).logits
    assert close(mhla.convert(lm, "softmax", copy=True)(ids).logits, ref)
    conv = mhla.convert(lm, {"name": "mhla", "block_size": 16}, copy=True)
    assert conv.config.attn["name"] == "mhla" and conv.config.attn["block_size"] == 16
    assert conv.config.attn["gate"] == "swish"  # the softmax layer's gate weights are kept
    assert torch.equal(conv.model.layers[0].attn.gate.weight, lm.model.layers[0].attn.gate.weight)
    out = conv(ids, labels=ids)
    out.loss.backward()
    mixing_grads(conv)
    conv.save_pretrained(tmp_path)  # the converted model is the model its config builds
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    conv.eval()
    assert close(again(ids).logits, conv(ids).logits)
    gen = conv.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, 14)


def test_an_old_weight_without_a_place_is_refused():
    lm = our_lm()
    with pytest.raises(ValueError, match="no place for"):
        mhla.convert(lm, {"name": "mhla", "gate": False}, copy=True)
    conv = mhla.convert(lm, {"name": "mhla", "gate": False}, copy=True, strict=False)
    assert conv.model.layers[0].attn.gate is None


# ---------------------------------------------------------------------------------------------- Llama
def llama(kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, intermediate_size=64, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).double().eval()


def sample(model, prompt, n=10):
    torch.manual_seed(123)
    return model.generate(prompt, max_new_tokens=n, do_sample=True, top_k=0, temperature=1.0)


def test_llama_softmax_reproduces_forward_and_generate():
    model = llama()
    ids = torch.randint(0, 97, (2, 24))
    ref = model(ids).logits
    conv = mhla.convert(model, "softmax", copy=True)
    assert model_family(model) == "llama"
    assert type(conv.model.layers[0].self_attn).__name__ == "LlamaAttentionAdapter"
    assert conv.model.layers[0].self_attn.q_proj is not model.model.layers[0].self_attn.q_proj  # (a copy)
    assert close(conv(ids).logits, ref)
    prompt = ids[:1, :6]
    assert torch.equal(sample(conv, prompt), sample(model, prompt))  # decoding through the adapter's cache


def test_llama_mhla_decodes_as_the_full_forward():
    model = mhla.convert(llama(), {"name": "mhla", "block_size": 4})
    assert model.config.mhla_attention["name"] == "mhla" and model.config.mhla_attention["out_norm"] is True
    ids = torch.randint(0, 97, (1, 13))
    full = model(ids).logits
    out = model(ids[:, :7], use_cache=True)
    cache, steps = out.past_key_values, [out.logits]
    for t in range(7, 13):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits)
    assert close(torch.cat(steps, 1), full, 1e-9)
    gen = model.generate(ids[:, :5], max_new_tokens=8, do_sample=False)
    assert torch.equal(model(gen).logits[0, 4:-1].argmax(-1), gen[0, 5:])
    model.train()
    model(ids, labels=ids).loss.backward()
    mixing_grads(model)
    with pytest.raises(ValueError, match="no weights for gate"):
        mhla.convert(llama(), {"name": "mhla", "gate": True})


def test_llama_converted_model_saves_and_reloads(tmp_path):
    """``save_pretrained`` keeps the options in ``config.mhla_attention``; a plain Llama built from that
    config, converted with them, takes the saved weights (mixing matrices included) and computes the same
    logits."""
    from safetensors.torch import load_file  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    model = mhla.convert(llama(), {"name": "mhla", "block_size": 8})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mixing" in name:
                p.mul_(0.5)
    ids = torch.randint(0, 97, (1, 20))
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    config = LlamaConfig.from_pretrained(tmp_path)
    again = mhla.convert(LlamaForCausalLM(config).double(), config.mhla_attention)
    missing, unexpected = again.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert close(again(ids).logits, ref)


def test_llama_padding_is_refused():
    model = mhla.convert(llama(), "mhla")
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="unpadded"):
        model(ids, attention_mask=mask)


# ------------------------------------------------------------------------------------------ diffusers
def tiny_wan():
    from diffusers import WanTransformer3DModel  # noqa: PLC0415

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=4, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=32,
                                 num_layers=2,
                                 rope_max_seq_len=32).double().eval()


def test_diffusers_wan_softmax_reproduces_and_mhla_trains():
    wan = tiny_wan()
    x, t, ctx = (torch.randn(1, 4, 2, 8, 8, dtype=torch.float64), torch.tensor([10]),
                 torch.randn(1, 5, 8, dtype=torch.float64))
    ref = wan(x, t, ctx).sample
    conv = mhla.convert(wan, "softmax", copy=True)
    assert conv.mhla_conversion["attn"]["rope"] == "after_feature_map"  # Wan's tables reach the layer
    assert close(conv(x, t, ctx).sample, ref)
    with pytest.raises(ValueError, match="blocks"):
        mhla.convert(wan, "mhla", copy=True)  # no grid in Wan's config: the layout must be given
    conv = mhla.convert(wan, {"name": "mhla", "blocks": [1, 2, 2]}, copy=True).train()
    conv(x, t, ctx).sample.sum().backward()
    mixing_grads(conv)


def test_diffusers_dit_softmax_reproduces():
    from diffusers import DiTTransformer2DModel  # noqa: PLC0415

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    dit = dit.double().eval()
    x, t, c = torch.randn(2, 4, 8, 8, dtype=torch.float64), torch.tensor([3, 5]), torch.tensor([1, 2])
    ref = dit(x, timestep=t, class_labels=c).sample
    assert close(mhla.convert(dit, "softmax", copy=True)(x, timestep=t, class_labels=c).sample, ref)
    conv = mhla.convert(dit, "mhla", copy=True)
    assert conv.mhla_conversion["attn"]["blocks"] == [2, 2]  # from sample_size / patch_size: a 4 x 4 grid


# --------------------------------------------------------------------------------------- distillation
def test_distillation_lowers_the_gap_and_trains_only_the_attention():
    teacher = timm_vit(qk_norm=True).float()
    student = mhla.convert(teacher, "mhla", copy=True)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    torch.manual_seed(0)
    xs = [torch.randn(8, 1, 32, 32) for _ in range(4)]
    gap0 = attention_gap(teacher, student, xs, num_batches=4)
    hist = distill_attention(teacher, student, xs, steps=40, lr=3e-3, log=None)
    gap1 = attention_gap(teacher, student, xs, num_batches=4)
    assert set(gap0) == {"blocks.0.attn", "blocks.1.attn"}
    assert all(gap1[k] < 0.6 * gap0[k] for k in gap0), (gap0, gap1)
    assert hist["loss"][-1] < hist["loss"][0]
    after = student.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("blocks.0.attn.", "blocks.1.attn.")) for k in changed), changed
    assert all(torch.equal(teacher_before[k], v) for k, v in teacher.state_dict().items())
    assert all(p.requires_grad for p in student.parameters())  # unfrozen after the stage
    # train="new": only the mixing matrices move; inputs="student": the student's own hidden states
    before = {k: v.clone() for k, v in student.state_dict().items()}
    distill_attention(teacher, student, xs, steps=3, lr=1e-2, train="new", inputs="student", log=None)
    changed = {k for k, v in student.state_dict().items() if not torch.equal(before[k], v)}
    assert changed == {"blocks.0.attn.mixing.raw", "blocks.1.attn.mixing.raw"}


def test_distillation_adds_and_reads_the_students_budget_every_step():
    """A student whose layers carry a write gate with a budget (``regularization_loss``, :mod:`mhla.hooks`): the
    distillation loop adds it to the loss and reads it every step, so no step's terms are kept; a large budget
    closes the gates (their mean falls below the start's 1)."""
    from mhla.layers import WriteGate  # noqa: PLC0415
    teacher = timm_vit(qk_norm=True).float()
    student = mhla.convert(teacher, {"name": "linear", "normalize": False, "out_norm": True, "write_gate": "relu",
                                     "write_gate_penalty": 10.0}, copy=True)
    gates = [m for m in student.modules() if isinstance(m, WriteGate)]
    assert len(gates) == 2
    torch.manual_seed(0)
    xs = [torch.randn(4, 1, 32, 32) for _ in range(2)]
    distill_attention(teacher, student, xs, steps=5, lr=1e-2, log=None)
    assert all(not g._written for g in gates)
    seen = []
    hooks = [g.register_forward_hook(lambda m, a, out: seen.append(out.mean().item())) for g in gates]
    with torch.no_grad():
        student.eval()(xs[0])
    for h in hooks:
        h.remove()
    assert len(seen) == 2 and all(v < 0.9 for v in seen), seen


def test_distillation_of_llama_and_wan_runs():
    teacher = llama().float()
    student = mhla.convert(teacher, "mhla", copy=True)
    ids = [torch.randint(0, 97, (2, 16)) for _ in range(2)]
    h = distill_attention(teacher, student, ids, steps=3, log=None,
                          forward=lambda m, b: m(input_ids=b, use_cache=False))
    assert len(h["rel_mse"]) == 2 and all(torch.isfinite(torch.tensor(v)) for v in h["loss"])
    wan = tiny_wan().float()
    student = mhla.convert(wan, {"name": "mhla", "blocks": [1, 2, 2]}, copy=True)
    batch = [dict(hidden_states=torch.randn(1, 4, 2, 8, 8), timestep=torch.tensor([10]),
                  encoder_hidden_states=torch.randn(1, 5, 8))]
    h = distill_attention(wan, student, batch, steps=2, log=None)
    assert len(h["rel_mse"]) == 2


# ----------------------------------------------------------------------- the entry point and train.py
TINY = ["logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "data.limit=128",
        "data.eval_limit=64", "data.batch_size=32", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "trainer.max_epochs=null"]


@pytest.mark.slow
def test_distill_entry_point_and_init_from(tmp_path):
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    from tasks.common.checkpoint import load_run_checkpoint  # noqa: PLC0415
    from tasks.conversion.distill import run as distill_run  # noqa: PLC0415
    from train import run as train_run  # noqa: PLC0415

    configs = os.path.join(ROOT, "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        teacher_cfg = compose(config_name="train", overrides=TINY + ["attn=softmax", "trainer.max_steps=2"])
    train_run(teacher_cfg, str(tmp_path / "teacher"))
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="distill", overrides=[f"teacher={tmp_path / 'teacher'}", "distill.steps=2",
                                                        "evaluate=[teacher,converted,distilled]"])
    metrics = distill_run(cfg, str(tmp_path / "distill"))
    wanted = {"teacher_top1", "converted_top1", "distilled_top1", "rel_mse_before", "rel_mse_after"}
    assert wanted <= set(metrics)
    state = load_run_checkpoint(tmp_path / "distill" / "checkpoints" / "last.pt")
    assert state["config"]["attn"]["name"] == "mhla" and state["step"] == 2
    assert (tmp_path / "distill" / "run.json").is_file()
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        ft = compose(config_name="train", overrides=TINY + ["attn=mhla", "trainer.max_steps=1",
                                                            f"trainer.init_from={tmp_path / 'distill'}",
                                                            "trainer.eval_every_steps=1"])
    from tasks.classification.task import ClassificationTask  # noqa: PLC0415
    from tasks.common.init_from import init_model_from  # noqa: PLC0415

    task = ClassificationTask(ft)
    model = task.build_model()
    init_model_from(model, tmp_path / "distill", task.attention.options)
    assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())
    train_run(ft, str(tmp_path / "finetune"))
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        wrong = compose(config_name="train", overrides=TINY + ["attn=linear", "trainer.max_steps=1",
                                                               f"trainer.init_from={tmp_path / 'distill'}"])
    from tasks.common.config import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="do not fit"):
        train_run(wrong, str(tmp_path / "wrong"))


# ------------------------------------------------------------------------------ the experiment's summary
def test_experiment_summary_pairs_seeds_and_writes_the_report(tmp_path):
    from argparse import Namespace  # noqa: PLC0415

    from scripts.tables.conversion import summarize  # noqa: PLC0415
    from scripts.tables.conversion_report import markdown  # noqa: PLC0415

    def rec(**metrics):
        return {"command": "python train.py ...", "run_dir": "nowhere", "seconds": 1.0, "metrics": metrics,
                "run": {"load_before": [1.0, 1.0, 1.0], "config": {"seed": 0}}}

    a, b, c = {0: 0.95, 1: 0.96, 2: 0.97}, {0: 0.94, 1: 0.95, 2: 0.96}, {0: 0.90, 1: 0.97, 2: 0.93}
    records = {"teacher": [rec(top1=0.98)], "b_convert": [rec(converted_top1=0.5, rel_mse_before=0.4)]}
    for s in a:
        records[f"a{s}"] = [rec(distilled_top1=0.9, rel_mse_after=0.1), rec(top1=a[s])]
        records[f"b{s}"], records[f"c{s}"] = [rec(top1=b[s])], [rec(top1=c[s])]
    args = Namespace(task="mnist", seeds=[0, 1, 2], distill_steps=10, finetune_steps=20, distill_lr=1e-3)
    summary = summarize(records, args)
    ab = summary["paired"]["a-b"]
    assert ab["diffs"] == pytest.approx([1.0, 1.0, 1.0]) and not ab["level"]  # the same gap every seed
    ac = summary["paired"]["a-c"]
    assert ac["diffs"] == pytest.approx([5.0, -1.0, 4.0]) and ac["level"]  # the interval contains 0
    assert summary["arms"]["a"]["mean"] == pytest.approx(96.0)
    assert summary["teacher"]["value"] == pytest.approx(98.0)
    summary.update(command="python -m scripts.tables.conversion ...", machine={"cpu": "x", "cpu_count": 2},
                   code={"commit": "abc"}, seconds=60.0)
    text = markdown(summary, str(tmp_path / "mnist"))
    assert "(a) is better than (b)" in text and "(a) vs (c): level" in text
    # the 2-pooled-std rule: a-b's gap of 1 point is under 2 x its pooled std of 1 (level, though the paired
    # interval excludes 0); the teacher is one run (no spread)
    row = next(line for line in text.splitlines() if line.startswith("| a-b |"))
    assert row.endswith("| level |") and "level (one teacher run: no spread)" in text
