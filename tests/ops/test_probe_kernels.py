"""scripts/probe_kernels.py: what it refuses, and a smoke run under the Triton interpreter."""

import json

import pytest
import torch

triton_backend = pytest.importorskip("mhla.ops.mhla.triton.backend")

from scripts import probe_kernels  # noqa: E402


def test_refuses_what_it_cannot_measure(capsys):
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            probe_kernels.parse_args(["--device", "cuda"])
        assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        probe_kernels.parse_args(["--device", "cpu"])
    assert e.value.code == 2 and "only --quick" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available() or not triton_backend.available(),
                    reason="the CPU smoke run needs the Triton interpreter")
def test_quick_run_writes_both_probes(tmp_path):
    assert probe_kernels.main(["--device", "cpu", "--quick", "--allow-busy", "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "probe_kernels_cpu_quick.json").read_text())
    assert [(r["tile_cap"], r["causal"]) for r in out["tiles"]] == [(64, False), (128, False), (64, True),
                                                                    (128, True)]
    assert all(r["max_abs_diff_to_torch"] < 1e-5 and r["fwdbwd_ms"] > 0 for r in out["tiles"])
    assert {(r["op"], r["pass"]) for r in out["per_call"]} == {
        (op, p) for op in probe_kernels.PER_CALL_OPS for p in ("fwd", "fwdbwd")}
    assert all(r["kernels_per_call"] is None for r in out["per_call"])  # no device kernels on a CPU
    md = (tmp_path / "probe_kernels_cpu_quick.md").read_text()
    assert "a CPU smoke run" in md and "## Feature tile cap" in md and "## Per-call cost" in md
    assert out["measurement"]["load_before"] is not None and out["command"].startswith("python scripts/")


def test_markdown_shows_a_tile_that_failed():
    out = {"header": {"device": "cuda", "gpu": "H100", "torch": "x", "date": "d", "loadavg_start": [0, 0, 0],
                      "loadavg_end": [0, 0, 0]},
           "settings": {"device": "cuda", "batch": 8, "heads": 16, "dtype": "bf16", "repeats": 20},
           "command": "python scripts/probe_kernels.py",
           "tiles": [{"D": 128, "causal": False, "T": 16384, "tile_cap": 128, "feature_tile": 128,
                      "failed": "out of resource: shared memory"}],
           "per_call": [{"T": 1024, "op": "mhla", "pass": "fwd", "ms": 0.8, "host_ms": 0.5, "kernels_per_call": 6,
                         "kernel_ms_per_call": 0.2, "kernel_share": 0.25}]}
    md = probe_kernels.to_markdown(out)
    assert "| 128 | False | 16384 | 128 | 128 | True | failed: out of resource: shared memory |" in md
    assert "| 1024 | mhla | fwd | 0.800 | 0.500 | 6 | 0.200 | 0.25 |" in md


def test_tile_probe_times_the_all_v_kernels_against_their_control():
    """Causal half inputs at D 128 take the all_v kernels: the probe times them and the per-V-tile kernels (its
    control) at the default cap; fp32, D 64 and non-causal calls have no such choice."""
    assert probe_kernels.tile_variants(128, True, torch.bfloat16) == [(64, True), (64, False), (128, True)]
    for dim, causal, dtype in ((128, True, torch.float32), (64, True, torch.bfloat16), (128, False, torch.bfloat16)):
        assert probe_kernels.tile_variants(dim, causal, dtype) == [(64, True), (128, True)]
    from mhla.ops.mhla.triton import chunk

    g = chunk.Geometry.make(torch.zeros(1, 8, 1, 128), torch.zeros(1, 8, 1, 128), 64)
    with probe_kernels.all_v_kernels(False):
        assert not chunk.all_v_tiles(g, torch.bfloat16)
    assert chunk.all_v_tiles(g, torch.bfloat16) and chunk.ALL_V_KERNELS
