"""scripts/bench_generation.py on a tiny preset: the decoding benchmark runs in one process, writes its json /
md / png, marks or refuses a busy machine, and its synthetic cache has the layout and size of a real
prefill's."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import bench_generation as bg
from tasks.common import records

pytestmark = pytest.mark.usefixtures("one_thread")


def _states(cache):
    """Per layer: the type, shapes and fields of its state (not the values)."""
    out = []
    for layer in cache.layers:
        st = layer.state
        attn = st.attn
        if isinstance(attn, tuple):
            desc = ("tuple", [tuple(t.shape) for t in attn], [t.dtype for t in attn])
        else:
            desc = (type(attn).__name__, attn.num_tokens, attn.window, tuple(attn.block_summaries.shape),
                    tuple(attn.far_summary.shape), attn.current_summary.dtype)
        out.append((desc, None if st.conv is None else tuple(st.conv.shape),
                    None if st.short_conv is None else tuple(st.short_conv.shape)))
    return out


@pytest.mark.parametrize("attn", bg.ATTNS)
def test_synthetic_cache_has_the_layout_and_size_of_a_real_prefill(attn):
    from models.lm import MHLALMCache  # noqa: PLC0415

    model = bg.build_model("tiny", attn, "cpu", torch.float32)
    for L in (13, 40):  # inside a block, and 10 blocks (past the 4 learned mixing rows: blocks are folded)
        real, synth = MHLALMCache(model.config), MHLALMCache(model.config)
        with torch.no_grad():
            bg.prefill(model, real, L, 2, chunk=16)
            bg.fill_cache(model, synth, L, 2)
        assert real.get_seq_length() == synth.get_seq_length() == L
        assert real.nbytes() == synth.nbytes() > 0
        assert _states(real) == _states(synth)


def test_tiny_run_writes_json_md_png(tmp_path):
    argv = ["--presets", "tiny", "--contexts", "16", "40", "--new-tokens", "4", "--repeats", "2",
            "--warmup", "1", "--allow-busy", "--out", str(tmp_path)]
    assert bg.main(argv) == 0
    data = json.loads((tmp_path / "generation_cpu.json").read_text())
    rows = data["rows"]
    assert {(r["attn"], r["context"]) for r in rows} == {(a, L) for a in bg.ATTNS for L in (16, 40)}
    assert all(r["ms_per_token"] > 0 and r["cache_bytes"] > 0 and r["seen_after"] == r["context"] + 1 + 2 * 4
               for r in rows)
    by = {(r["attn"], r["context"]): r for r in rows}
    assert by[("linear", 16)]["cache_bytes"] == by[("linear", 40)]["cache_bytes"]
    assert by[("softmax", 40)]["cache_bytes"] > by[("softmax", 16)]["cache_bytes"]
    m = data["measurement"]  # tasks.common.records.Measurement
    assert m["load_before"] is not None and m["load_after"] is not None and "commit" in m
    md = (tmp_path / "generation_cpu.md").read_text()
    assert bg.GPU_COMMAND in md and "| tiny | mhla | 40 |" in md and ("BUSY" in md) == bool(m["busy"])
    assert (tmp_path / "generation_cpu.png").stat().st_size > 5000
    (tmp_path / "generation_cpu.png").unlink()
    assert bg.main(["--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "generation_cpu.png").exists()


def test_real_prefill_fill(tmp_path):
    argv = ["--presets", "tiny", "--attns", "mhla", "--contexts", "24", "--new-tokens", "2", "--repeats", "1",
            "--warmup", "0", "--fill", "prefill", "--prefill-chunk", "10", "--allow-busy", "--out",
            str(tmp_path)]
    assert bg.main(argv) == 0
    (row,) = json.loads((tmp_path / "generation_cpu.json").read_text())["rows"]
    assert row["prefill_s"] > 0 and row["fill"] == "prefill"
    assert "prefill s" in (tmp_path / "generation_cpu.md").read_text()


def test_busy_machine_is_refused(tmp_path, monkeypatch):
    argv = ["--presets", "tiny", "--attns", "linear", "--contexts", "8", "--new-tokens", "1", "--repeats",
            "1", "--warmup", "0", "--out", str(tmp_path)]
    monkeypatch.setattr(records, "load_average", lambda: [100.0, 100.0, 100.0])
    assert bg.main(argv) == 2  # refused before measuring
    assert not (tmp_path / "generation_cpu.json").exists()
    monkeypatch.setattr(records, "load_average", lambda: [0.0, 0.0, 0.0])
    monkeypatch.setattr(records, "MIN_WATCH_S", 0.0)
    clock = iter([0.0, 1e6])  # other processes used every CPU during the run
    monkeypatch.setattr(records, "busy_cpu_s", lambda: next(clock))
    assert bg.main(argv) == 2  # measured, not written
    assert not (tmp_path / "generation_cpu.json").exists()
    clock = iter([0.0, 1e6])
    assert bg.main([*argv, "--allow-busy"]) == 0  # written, marked
    data = json.loads((tmp_path / "generation_cpu.json").read_text())
    assert data["measurement"]["busy"] and data["measurement"]["other_cpu_frac"] > 0.5
    md = (tmp_path / "generation_cpu.md").read_text()
    assert "BUSY" in md and "other processes used" in md
