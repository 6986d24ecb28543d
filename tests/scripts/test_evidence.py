"""docs/evidence.md is rendered from the committed records, and its verdicts follow the data, not the page."""

from __future__ import annotations

import json
import os
import shutil

from scripts.tables import evidence


def test_evidence_page_matches_the_records():
    with open(os.path.join(evidence.ROOT, evidence.OUT)) as f:
        assert f.read() == evidence.render(), "docs/evidence.md is stale: run python -m scripts.tables.evidence"


def test_a_changed_record_changes_the_verdict_and_the_convergence(tmp_path):
    """Inject a wrong number into a copy of a record: the rendered verdict and convergence move with it."""
    claim = evidence.CLAIMS[0]  # mhla vs softmax on the Table 2 proxy: "reversed" today
    src = os.path.join(evidence.ROOT, claim.record)
    dst = tmp_path / claim.record
    dst.parent.mkdir(parents=True)
    shutil.copy(src, dst)
    before = evidence.row(claim, {claim.record: evidence.load(claim.record, str(tmp_path))})

    rec = json.loads(dst.read_text())
    rec["variants"][claim.a]["by_seed"] = {k: v + 1.0 for k, v in rec["variants"][claim.a]["by_seed"].items()}
    rec["variants"][claim.baseline]["last_gain"]["by_seed"] = {
        k: 0.0 for k in rec["variants"][claim.baseline]["last_gain"]["by_seed"]}
    dst.write_text(json.dumps(rec))
    after = evidence.row(claim, {claim.record: evidence.load(claim.record, str(tmp_path))})

    assert before[4] == "reversed" and after[4] == "holds"
    assert before[6].endswith("still gaining") and after[6].endswith("converged")
