"""scripts/bench_video.py: every attention variant builds and runs one denoiser step on a tiny Wan-shaped model
(the benchmark's own path: the attention options it passes must be ones each attention takes), and a CPU run on
a busy machine is refused before it times anything."""

import pytest
import torch

from scripts import bench_video

pytest.importorskip("diffusers")

TINY = dict(arch={**bench_video.WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 3,
                  "out_channels": 3, "text_dim": 8, "freq_dim": 8, "ffn_dim": 32, "num_layers": 3,
                  "rope_max_seq_len": 16},
            latent=(3, 8, 8), blocks=(1, 2, 2), text_len=2)


@pytest.mark.parametrize("variant", list(bench_video.VARIANTS))
def test_every_variant_runs_a_step(variant):
    r = bench_video.bench_variant(TINY, variant, torch.device("cpu"), torch.float32, warmup=1, iters=2)
    assert r["iters"] == 2 and 0 < r["min_s"] <= r["median_s"]


def test_busy_machine_is_refused_before_timing(tmp_path, monkeypatch, capsys):
    from tasks.common import records

    monkeypatch.setattr(records, "load_average", lambda: [100.0, 100.0, 100.0])
    monkeypatch.setattr(bench_video, "bench_variant", lambda *a: pytest.fail("timed on a busy machine"))
    with pytest.raises(SystemExit) as e:
        bench_video.main(["--preset", "cpu", "--device", "cpu", "--out", str(tmp_path)])
    assert e.value.code == 2 and "refusing to measure" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
