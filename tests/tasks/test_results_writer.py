"""The one results writer (tasks/common/results.py) and the load guard of benchmarks (tasks/common/records.py):
md + json + png written whole, a busy measurement refused unless allowed and then marked BUSY, and the rule."""

import json

import pytest

from tasks.common import results
from tasks.common import records


def test_busy_rule():
    # 2 cores: busy before the run when the 1-minute load is above 1; after it, above its own threads + 1
    assert records.is_busy([0.9, 2, 2], [2.9, 1, 1], 2, threads=2) is False
    assert records.is_busy([1.1, 0, 0], [1.0, 0, 0], 2, threads=2) is True
    assert records.is_busy([0.2, 0, 0], [3.1, 0, 0], 2, threads=2) is True
    assert records.is_busy([0.2, 0, 0], [2.1, 0, 0], 2, threads=1) is True  # a 1-thread run adds at most 1
    assert records.is_busy(None, [0.1], 2) is None


def test_measurement_records_commit_and_load(monkeypatch):
    loads = iter([[0.1, 0.2, 0.3], [1.5, 0.5, 0.4]])
    monkeypatch.setattr(records, "load_average", lambda: next(loads))
    monkeypatch.setattr(records.os, "cpu_count", lambda: 4)
    with records.Measurement(threads=2) as m:
        pass
    r = m.record
    assert r["load_before"] == [0.1, 0.2, 0.3] and r["load_after"] == [1.5, 0.5, 0.4]
    assert r["cpu_count"] == 4 and r["threads"] == 2 and r["busy"] is False and r["busy_rule"] == records.BUSY_RULE
    assert set(r) >= {"commit", "dirty", "seconds"}


def test_write_result_writes_md_json_png(tmp_path):
    drawn = []
    stem = results.write_result(str(tmp_path / "sub" / "x"), "# Title\n\nbody\n", {"rows": [1, 2]},
                                lambda png: drawn.append(png) or open(png, "wb").write(b"png"))
    assert (tmp_path / "sub" / "x.md").read_text() == "# Title\n\nbody\n"
    assert json.loads((tmp_path / "sub" / "x.json").read_text()) == {"rows": [1, 2]}
    assert drawn == [stem + ".png"] and (tmp_path / "sub" / "x.png").read_bytes() == b"png"
    assert not [p for p in (tmp_path / "sub").iterdir() if p.name.startswith(".")]  # no temp file left


def test_busy_measurement_refused_unless_allowed(tmp_path):
    busy = {"load_before": [3.0, 1, 1], "load_after": [3.5, 1, 1], "cpu_count": 2, "threads": 1, "busy": True}
    with pytest.raises(results.BusyMachine, match="not written: the machine was busy"):
        results.write_result(str(tmp_path / "b"), "# Bench\n\nrows\n", {"rows": []}, measurement=busy)
    assert not list(tmp_path.iterdir())
    results.write_result(str(tmp_path / "b"), "# Bench\n\nrows\n", {"rows": []}, measurement=busy, allow_busy=True)
    md = (tmp_path / "b.md").read_text()
    assert md.startswith("# Bench - BUSY\n\n**BUSY**: measured while the machine was busy (1-minute load average "
                         "3.00 before, 3.50 after, on 2 CPUs with 1 thread(s) of its own")
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["measurement"] == busy
    # rewritten from its .json (no new measurement): kept, and still marked, once
    results.write_result(str(tmp_path / "b"), "# Bench\n\nrows\n", saved)
    assert (tmp_path / "b.md").read_text() == md
    idle = {**busy, "busy": False}
    results.write_result(str(tmp_path / "i"), "# Bench\n", {"rows": []}, measurement=idle)
    assert "BUSY" not in (tmp_path / "i.md").read_text()


def test_code_version_is_dirty_for_changed_code_and_not_for_changed_records(tmp_path):
    """A checkout whose only change is a record under results/ (a seed grid's table, rewritten after each run) is
    clean; a changed tracked file elsewhere makes it dirty."""
    import subprocess
    from tasks.common.records import code_version

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "table.md").write_text("a\n")
    (tmp_path / "train.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    assert code_version(tmp_path)["dirty"] is False
    (tmp_path / "results" / "table.md").write_text("b\n")
    assert code_version(tmp_path)["dirty"] is False
    (tmp_path / "train.py").write_text("x = 2\n")
    assert code_version(tmp_path)["dirty"] is True


def test_code_version_outside_git_reads_mhla_commit(tmp_path, monkeypatch):
    """A copy of the tree without .git (a rented GPU machine) records the commit it was told, dirty unknown."""
    from tasks.common.records import code_version

    monkeypatch.delenv("MHLA_COMMIT", raising=False)
    assert code_version(tmp_path) == {"commit": None, "dirty": None}
    monkeypatch.setenv("MHLA_COMMIT", "abc123")
    assert code_version(tmp_path) == {"commit": "abc123", "dirty": None}
    assert code_version()["commit"] != "abc123"  # inside git, git wins


def test_wait_until_settled_waits_for_the_load_average(monkeypatch):
    """A driver that times right after its own training waits for the lagging load average, within a limit."""
    loads = iter([[1.4], [1.2], [0.9], [0.5]])
    slept = []
    monkeypatch.setattr(records, "load_average", lambda: next(loads))
    monkeypatch.setattr(records.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(records.time, "sleep", slept.append)
    # 0.9 is under half of 2 cores: two waits
    assert records.wait_until_settled(max_wait_s=60, poll_s=5) == 10 and slept == [5, 5]
    monkeypatch.setattr(records, "load_average", lambda: [3.0])  # never settles: gives up at the limit
    assert records.wait_until_settled(max_wait_s=12, poll_s=5) == 15
    monkeypatch.setattr(records, "load_average", lambda: None)  # no load average on this OS: no wait
    assert records.wait_until_settled() == 0


def test_read_notes_drops_a_leading_reading_heading(tmp_path):
    """The scripts write the "## Reading" heading above the notes; notes that start with it do not get it twice."""
    from tasks.common.launch import read_notes

    (tmp_path / "n.md").write_text("## Reading\n\n**A** reading.\n")
    assert read_notes(f"@{tmp_path / 'n.md'}") == "**A** reading.\n"
    assert read_notes("**A** reading, then\n## Reading") == "**A** reading, then\n## Reading"
    assert read_notes("") == ""
