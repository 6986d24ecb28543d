"""SANA sampler (tasks/image_gen/sana_*.py; the CLI is sana_sample.py) on tiny models, offline: a sana_tiny + MHLA
run trained two steps, shapes, seeded determinism, guidance, checkpoint reload, GenEval folder + npz, rank
sharding, Flow-DPM-Solver against diffusers' SanaPipeline (tiny Gemma-2 / DC-AE built here) and against its loop
written out here, DC-AE and CLIP from local folders, errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from tasks.common.checkpoint import find_checkpoint
from tasks.image_gen import sana_sample
from tasks.image_gen.sampling import to_uint8
from tasks.image_gen.sana_checkpoint import load_sana_checkpoint
from tasks.image_gen.sana_decode import dcae_decoder, load_dcae, preview_decoder
from tasks.image_gen.sana_generate import SampleRun, finalize, generate, make_jobs, write_metadata
from tasks.image_gen.sana_metrics import clip_score, load_clip_score, reference_npz
from tasks.image_gen.sana_prompts import FilePrompts, PipelinePrompts, encode_to_files, load_pipeline, read_prompt_list
from tasks.image_gen.sana_sampling import (SOLVERS, dpm_scheduler, initial_noise, make_velocity, sample_latents,
                                           sample_seed, sample_settings)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["task=sana_mini", "attn=mhla", "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false",
        "trainer.device=cpu", "trainer.max_steps=2", "data.batch_size=4", "task.train_size=8", "task.eval_size=4"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny SANA with MHLA trained two steps by the training task; returns (trainer, run_dir)."""
    from tasks.common.trainer import Trainer
    from tasks.image_gen.sana_task import SanaFinetuneTask

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=TINY)
    run_dir = tmp_path_factory.mktemp("sana_run")
    trainer = Trainer(cfg, SanaFinetuneTask(cfg), run_dir)
    trainer.fit()
    return trainer, run_dir


@pytest.fixture(scope="module")
def loaded(run):
    return load_sana_checkpoint(str(run[1]))


def _text(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, 32, generator=g), torch.zeros(n, 1, 32)


def test_trained_run_samples_latents_of_the_right_shape(run, loaded):
    trainer, _ = run
    model, cfg, step = loaded
    assert trainer.step == 2 and step == 2
    assert type(model.transformer_blocks[0].attn1.processor).__name__ == "AttentionProcessor"
    assert cfg.model.transformer_config.sample_size == 8          # recorded by the training task
    assert cfg.task.caption_dropout == 0.1                        # sana_mini trains with caption dropout
    text, neg = _text()
    seeds = [sample_seed(0, i, 0) for i in range(3)]
    z = sample_latents(model, text, neg_text=neg, seeds=seeds, steps=3, solver="euler")
    assert z.shape == (3, 8, 8, 8) and z.dtype == torch.float32 and torch.isfinite(z).all()
    noise = initial_noise(seeds, (8, 8, 8))
    assert (z - noise).abs().mean() > 0.1                        # the model moved the noise
    zd = sample_latents(model, text, neg_text=neg, seeds=seeds, steps=3, solver="dpm")
    assert zd.shape == z.shape and torch.isfinite(zd).all() and not torch.allclose(zd, z)


def test_sampling_is_deterministic_under_a_seed(loaded):
    model = loaded[0]
    text, neg = _text()
    kw = dict(neg_text=neg, steps=3, solver="euler", guidance_scale=4.5)
    a = sample_latents(model, text, seeds=[sample_seed(7, i, 0) for i in range(3)], **kw)
    b = sample_latents(model, text, seeds=[sample_seed(7, i, 0) for i in range(3)], **kw)
    c = sample_latents(model, text, seeds=[sample_seed(8, i, 0) for i in range(3)], **kw)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    # a row depends only on its own seed and caption, not on the rest of the batch
    alone = sample_latents(model, text[2:], seeds=[sample_seed(7, 2, 0)], neg_text=neg[2:], steps=3,
                              solver="euler", guidance_scale=4.5)
    torch.testing.assert_close(alone[0], a[2], rtol=1e-4, atol=1e-5)
    assert len({sample_seed(0, i, k) for i in range(2000) for k in range(4)}) == 8000


def test_guidance_scale_one_equals_the_unguided_velocity_path(loaded):
    from tasks.common.flow_matching import sampling_times

    model = loaded[0]
    text, _ = _text(2)
    neg = torch.randn(2, 4, 32)
    noise = initial_noise([1, 2], (8, 8, 8))
    for solver in SOLVERS:
        plain = sample_latents(model, text, noise=noise, steps=3, solver=solver)
        g1 = sample_latents(model, text, neg_text=neg, noise=noise, steps=3, solver=solver, guidance_scale=1.0)
        g45 = sample_latents(model, text, neg_text=neg, noise=noise, steps=3, solver=solver, guidance_scale=4.5)
        assert torch.equal(plain, g1) and not torch.allclose(plain, g45, atol=1e-3)
    # one Euler step by hand: x1 = noise + (t1 - t0) (v_u + g (v_c - v_u)), the model at timestep t0 * 1000
    t = sampling_times(1, 3.0)
    v = lambda c: model(noise, encoder_hidden_states=c, timestep=torch.full((2,), float(t[0]) * 1000.0),  # noqa: E731
                        return_dict=False)[0]
    with torch.no_grad():
        want = noise + float(t[1] - t[0]) * (v(neg) + 4.5 * (v(text) - v(neg)))
    got = sample_latents(model, text, neg_text=neg, noise=noise, steps=1, shift=3.0, solver="euler",
                            guidance_scale=4.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dpm_solver_equals_the_flow_dpm_loop_written_out(loaded):
    """solver="dpm" runs SanaPipeline, which stacks both guidance branches into one batch (captions padded to one
    length, the padding masked out); the Flow-DPM-Solver loop written out (two calls, unpadded) is the same."""
    from tasks.common.flow_matching import guided_velocity

    model = loaded[0]
    text, neg1 = _text(3)                                      # neg1: the zeros negative, one token, no mask
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 7 + [0]])
    neg3, nm3 = torch.randn(3, 3, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([[1, 1, 0]] * 3)
    noise = initial_noise([1, 2, 3], (8, 8, 8))
    velocity = make_velocity(model)

    @torch.no_grad()
    def loop(cond, uncond, g):
        sched = dpm_scheduler(3.0)
        sched.set_timesteps(4)
        x = noise.clone()
        for ts in sched.timesteps:
            v = guided_velocity(velocity, x, (ts.float() / 1000.0).expand(3), cond, uncond, g)
            x = sched.step(v, ts, x, return_dict=False)[0]
        return x

    for m, (nt, nm), g in ((mask, (neg1, None), 4.5), (None, (neg3, nm3), 4.5), (mask, (neg3, nm3), 0.5),
                           (None, (neg1, None), 0.0), (mask, (None, None), 4.5)):
        got = sample_latents(model, text, mask=m, neg_text=nt, neg_mask=nm, noise=noise, steps=4, shift=3.0,
                             guidance_scale=g, solver="dpm")
        torch.testing.assert_close(got, loop((text, m), None if nt is None else (nt, nm), g), rtol=1e-5, atol=1e-5)


def test_checkpoint_reload_samples_identical_latents(run, loaded, tmp_path):
    trainer, run_dir = run
    text, neg = _text()
    kw = dict(neg_text=neg, seeds=[3, 4, 5], steps=3, solver="dpm", guidance_scale=4.5)
    live = sample_latents(trainer.model.eval(), text, **kw)
    again, _, _ = load_sana_checkpoint(str(run_dir / "checkpoints" / "last.pt"), weights="model")
    assert torch.equal(sample_latents(loaded[0], text, **kw), live)
    assert torch.equal(sample_latents(again, text, **kw), live)
    # an EMA copy in the checkpoint is what weights="ema" (the default) loads
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    state["ema"] = {**{f"module.{k}": v + 0.01 for k, v in state["model"].items()}, "num_updates": torch.tensor(2)}
    torch.save(state, tmp_path / "ema.pt")
    ema, _, _ = load_sana_checkpoint(str(tmp_path / "ema.pt"))
    raw, _, _ = load_sana_checkpoint(str(tmp_path / "ema.pt"), weights="model")
    k = "proj_out.weight"
    torch.testing.assert_close(ema.state_dict()[k], state["model"][k] + 0.01)
    torch.testing.assert_close(raw.state_dict()[k], state["model"][k])
    with pytest.raises(FileNotFoundError, match="run folder"):
        find_checkpoint(str(tmp_path))


def _prompt_files(folder, n=3):
    """GenEval-like prompts as pre-extracted .pt files with varying caption lengths and a negative.pt."""
    g = torch.Generator().manual_seed(0)
    os.makedirs(folder, exist_ok=True)
    metas = []
    for i in range(n):
        meta = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": f"a photo of cat {i}"}
        metas.append(meta)
        torch.save({"text": torch.randn(5 + i, 32, generator=g), "prompt": meta["prompt"], "id": f"p{i}",
                    "metadata": meta}, os.path.join(folder, f"{i:05d}.pt"))
    torch.save({"text": torch.zeros(1, 32)}, os.path.join(folder, "negative.pt"))
    return metas


def test_cli_writes_the_geneval_layout_and_an_adm_npz(run, tmp_path, capsys):
    from PIL import Image

    from tasks.image_gen.npz import load_npz

    _, run_dir = run
    metas = _prompt_files(tmp_path / "prompts")
    argv = ["--ckpt", str(run_dir), "--prompts", str(tmp_path / "prompts"), "--out", str(tmp_path / "out"),
            "--vae", "preview", "--images-per-prompt", "2", "--batch-size", "4", "--steps", "2", "--seed", "5",
            "--device", "cpu"]
    assert sana_sample.main(argv) == 0
    printed = capsys.readouterr().out
    (name,) = os.listdir(tmp_path / "out")
    assert name == "sana_tiny-mhla-0000002-euler2-cfg4.5-shift3-seed5"
    d = tmp_path / "out" / name
    assert "evaluation/evaluate_images.py " + str(d) in printed
    arr = load_npz(d / "samples.npz")
    assert arr.dtype == np.uint8 and arr.shape == (6, 32, 32, 3)   # 3 prompts x 2, 8 x 8 latents x 4 (preview)
    rows = [json.loads(line) for line in open(d / "samples.jsonl")]
    assert [(r["prompt_index"], r["k"]) for r in rows] == [(i, k) for i in range(3) for k in range(2)]
    assert rows[3]["prompt"] == metas[1]["prompt"] and rows[3]["id"] == "p1"
    prompts = FilePrompts(str(tmp_path / "prompts"))
    model = load_sana_checkpoint(str(run_dir))[0]
    for i in range(3):
        assert json.loads(open(d / f"{i:05d}" / "metadata.jsonl").read()) == metas[i]
        assert sorted(os.listdir(d / f"{i:05d}" / "samples")) == ["0000.png", "0001.png"]
        for k in range(2):
            png = np.asarray(Image.open(d / f"{i:05d}" / "samples" / f"{k:04d}.png"))
            np.testing.assert_array_equal(png, arr[2 * i + k])
    # row (prompt 1, image 1) is the latent of seed sample_seed(5, 1, 1) through the decoder
    (text, mask), (nt, nm) = prompts.encode([1], "cpu")
    z = sample_latents(model, text, mask=mask, neg_text=nt, neg_mask=nm, seeds=[sample_seed(5, 1, 1)],
                          steps=2, solver="euler", guidance_scale=4.5)
    diff = np.abs(to_uint8(preview_decoder(z)).numpy()[0].astype(int) - arr[3].astype(int))
    assert diff.max() <= 1
    with pytest.raises(SystemExit):                             # guidance without a negative embedding
        os.unlink(tmp_path / "prompts" / "negative.pt")
        sana_sample.main(argv)
    assert "unconditional embedding" in capsys.readouterr().err


def test_sharding_over_ranks_gives_the_same_samples(loaded, tmp_path):
    model = loaded[0]
    _prompt_files(tmp_path / "prompts", n=3)
    prompts = FilePrompts(str(tmp_path / "prompts"))
    s = sample_settings(loaded[1], steps=2)
    outs = []
    for ranks in ([(0, 1)], [(1, 2), (0, 2)]):
        run = SampleRun(str(tmp_path / f"w{len(ranks)}"), make_jobs(3, 1, 0), batch_size=2)
        os.makedirs(run.out_dir)
        write_metadata(run.out_dir, prompts)
        for rank, world in ranks:
            generate(model, prompts, run, s, decode=preview_decoder, rank=rank, world=world, npz_size=16,
                        progress=False)
        outs.append(np.load(finalize(run, prompts, s)["npz"])["arr_0"])
    assert outs[0].shape == (3, 16, 16, 3)                      # resized 32 -> 16 for the npz
    np.testing.assert_array_equal(outs[0], outs[1])
    # without a decoder: the latents themselves
    run = SampleRun(str(tmp_path / "lat"), make_jobs(3, 1, 0), batch_size=2)
    os.makedirs(run.out_dir)
    generate(model, prompts, run, s, progress=False)
    assert np.load(finalize(run, prompts, s)["latents"]).shape == (3, 8, 8, 8)


# ---------------------------------------------------------------------- a tiny diffusers SANA pipeline
@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    from diffusers import SanaPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizerFast

    from models.sana import build_sana

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + "a photo of cat dog red blue two on the left right".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    torch.manual_seed(0)
    encoder = Gemma2Model(Gemma2Config(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0))
    pipe = SanaPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=_tiny_dcae(),
                        transformer=build_sana({"config": "sana_tiny"}, {"name": "native"}),
                        scheduler=dpm_scheduler(3.0))
    path = tmp_path_factory.mktemp("pipe")
    pipe.save_pretrained(path)
    return str(path)


def _tiny_dcae():
    from diffusers import AutoencoderDC

    torch.manual_seed(0)
    return AutoencoderDC(in_channels=3, latent_channels=8, attention_head_dim=8, encoder_block_out_channels=(8, 16),
                         decoder_block_out_channels=(8, 16), encoder_layers_per_block=(1, 1),
                         decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()),
                         decoder_qkv_multiscales=((), ()), upsample_block_type="interpolate",
                         downsample_block_type="Conv", scaling_factor=0.41407)


def test_pipeline_prompts_and_dpm_solver_match_diffusers_sana_pipeline(loaded, tiny_pipeline, tmp_path):
    model = loaded[0]
    pipe = load_pipeline(tiny_pipeline, model)
    assert pipe.transformer is model
    records = [{"prompt": p, "id": str(i), "metadata": {"prompt": p}}
               for i, p in enumerate(["a red cat", "two dog on the left"])]
    prompts = PipelinePrompts(pipe, records, max_sequence_length=8, use_chi=False)
    (text, mask), (nt, nm) = prompts.encode([0, 1])
    assert text.shape == (2, 8, 32) and mask[:, 0].all() and not mask[:, -1].any() and nm.sum() == 2  # <bos> only
    noise = initial_noise([11, 12], (8, 8, 8))
    ours = sample_latents(model, text, mask=mask, neg_text=nt, neg_mask=nm, noise=noise, steps=4, shift=3.0,
                             guidance_scale=4.5, solver="dpm")
    with torch.no_grad():
        ref = pipe(prompt=[r["prompt"] for r in records], latents=noise.clone(), num_inference_steps=4,
                   guidance_scale=4.5, height=32, width=32, use_resolution_binning=False, output_type="latent",
                   max_sequence_length=8, complex_human_instruction=None).images
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # encode once to .pt files (padding cut, masked), sample from the files: the same latents
    encode_to_files(prompts, str(tmp_path / "emb"), batch_size=1, progress=False)
    files = FilePrompts(str(tmp_path / "emb"))
    assert files.records[1]["prompt"] == "two dog on the left" and files.texts[0].shape == (int(mask[0].sum()), 32)
    (ft, fm), (fnt, fnm) = files.encode([0, 1])
    again = sample_latents(model, ft, mask=fm, neg_text=fnt, neg_mask=fnm, noise=noise, steps=4, shift=3.0,
                              guidance_scale=4.5, solver="dpm")
    torch.testing.assert_close(again, ours, rtol=1e-4, atol=1e-4)
    # the pipeline's own DC-AE decodes with its scaling factor
    images = dcae_decoder(pipe.vae)(ours)
    assert images.shape == (2, 3, 16, 16) and images.abs().max() <= 1


def test_dcae_from_a_local_folder_and_missing_paths_are_clear_errors(tmp_path):
    vae = _tiny_dcae()
    vae.save_pretrained(tmp_path / "dcae")
    loaded_vae = load_dcae(str(tmp_path / "dcae"))
    z = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        want = vae.decode(z / 0.41407).sample.clamp(-1, 1)
    torch.testing.assert_close(dcae_decoder(loaded_vae)(z), want)
    with pytest.raises(FileNotFoundError, match="mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers"):
        load_dcae(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="openai/clip-vit-large-patch14"):
        load_clip_score(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="Sana_600M_1024px_diffusers"):
        load_pipeline(str(tmp_path / "nope"), None)
    with pytest.raises(FileNotFoundError, match="prompt embeddings"):
        FilePrompts(str(tmp_path / "nope"))


def test_prompt_lists_txt_geneval_mjhq(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\na dog\n")
    lines = [{"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"}]
    (tmp_path / "evaluation_metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "meta_data.json").write_text(json.dumps({"abc": {"category": "animals", "prompt": "a fox"}}))
    assert [r["prompt"] for r in read_prompt_list(str(tmp_path / "p.txt"))] == ["a cat", "a dog"]
    assert read_prompt_list(str(tmp_path / "evaluation_metadata.jsonl"))[0]["metadata"] == lines[0]
    (r,) = read_prompt_list(str(tmp_path / "meta_data.json"))
    assert r["prompt"] == "a fox" and r["id"] == "abc" and r["metadata"]["category"] == "animals"


def _tiny_clip(folder):
    """A random 1-layer CLIP with a byte-level tokenizer (no merges) and 32 px image processor, saved locally."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    os.makedirs(folder, exist_ok=True)
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = [chr(b) for b in keep] + [chr(256 + n) for n in range(256 - len(keep))]
    vocab = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    tok = CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"))
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                            crop_size={"height": 32, "width": 32}), tokenizer=tok)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=77, bos_token_id=len(vocab) - 2,
                                      eos_token_id=len(vocab) - 1),
                     vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=8), projection_dim=8)
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(os.path.join(folder, "clip"))
    proc.save_pretrained(os.path.join(folder, "clip"))
    return os.path.join(folder, "clip")


def test_clip_score_through_torchmetrics_with_a_local_clip(tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    path = _tiny_clip(str(tmp_path))
    images = np.random.default_rng(0).integers(0, 256, (4, 40, 40, 3), dtype=np.uint8)
    texts = ["a red cat", "two dogs", "x", "a photo of a " + "very " * 30 + "long caption"]   # > 77 tokens
    score = clip_score(images, texts, path, batch_size=3)
    model, proc = CLIPModel.from_pretrained(path), CLIPProcessor.from_pretrained(path)
    with torch.no_grad():
        inp = proc(text=texts, images=list(images), return_tensors="pt", padding=True, truncation=True, max_length=77)
        img = model.get_image_features(pixel_values=inp["pixel_values"]).pooler_output
        txt = model.get_text_features(input_ids=inp["input_ids"], attention_mask=inp["attention_mask"]).pooler_output
    want = max(float(100 * torch.nn.functional.cosine_similarity(img, txt).mean()), 0.0)
    assert score == pytest.approx(want, rel=1e-4, abs=1e-4)
    shuffled = clip_score(images, texts[::-1], path)
    assert shuffled != pytest.approx(score, abs=1e-3)           # pairs matter


def test_cli_with_a_local_pipeline_geneval_prompts_and_encode_to(run, tiny_pipeline, tmp_path, capsys):
    from tasks.image_gen.npz import load_npz

    lines = [{"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "two dog"},
             {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}], "prompt": "a red cat"}]
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(m) + "\n" for m in lines))
    common = ["--pipeline", tiny_pipeline, "--prompts", str(meta), "--max-sequence-length", "8", "--no-chi",
              "--device", "cpu"]
    assert sana_sample.main(["--ckpt", str(run[1]), *common, "--out", str(tmp_path / "out"), "--steps", "2"]) == 0
    (d,) = (tmp_path / "out").iterdir()
    assert "evaluation/evaluate_images.py" in capsys.readouterr().out
    assert load_npz(d / "samples.npz").shape == (8, 16, 16, 3)   # GenEval: 4 images per prompt, tiny DC-AE x 2
    assert json.loads((d / "00001" / "metadata.jsonl").read_text()) == lines[1]
    assert sorted(os.listdir(d / "00001" / "samples")) == [f"{k:04d}.png" for k in range(4)]
    assert sana_sample.main([*common, "--encode-to", str(tmp_path / "emb")]) == 0
    files = FilePrompts(str(tmp_path / "emb"))
    assert [r["metadata"] for r in files.records] == lines and files.negative is not None


def test_reference_folder_becomes_an_npz_at_the_sample_size(tmp_path):
    from PIL import Image

    os.makedirs(tmp_path / "mjhq" / "animals")
    for i in range(3):
        Image.fromarray(np.full((48, 64, 3), 40 * i, np.uint8)).save(tmp_path / "mjhq" / "animals" / f"{i}.jpg")
    path = reference_npz(str(tmp_path / "mjhq"), str(tmp_path), 16)
    assert path == str(tmp_path / "reference-mjhq-16.npz")
    arr = np.load(path)["arr_0"]
    assert arr.shape == (3, 16, 16, 3) and arr.dtype == np.uint8 and abs(int(arr[2].mean()) - 80) <= 2
    assert reference_npz(path, str(tmp_path), 16) == path
