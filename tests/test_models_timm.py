"""``import models`` registers every timm model the package defines (not only ``import models.deit``).

Run in a fresh interpreter: in the test process another test may already have imported ``models.deit``.
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = r"""
import json
import os
import models  # only the package: no submodule imported by hand
import mhla
import timm
import torch
from timm.models import model_entrypoint

ours = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("models."))
built = {}
for name in ("deit_tiny_patch16_224_mhla", "deit_tiny_patch16_224_softmax"):
    model = timm.create_model(name, pretrained=False, num_classes=10).eval()
    with torch.no_grad():
        built[name] = list(model(torch.randn(1, 3, 224, 224)).shape)
print(json.dumps({"ours": ours, "attentions": mhla.list_attentions(), "built": built}))
"""


def test_import_models_registers_every_timm_model():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {f"deit_{v}_patch16_224_{a}" for v in ("tiny", "small", "base") for a in out["attentions"]}
    assert set(out["ours"]) == expected
    assert len(expected) == 21  # 3 sizes x 7 attentions (mhla, linear, softmax, the four Table 2 baselines)
    assert out["built"] == {"deit_tiny_patch16_224_mhla": [1, 10], "deit_tiny_patch16_224_softmax": [1, 10]}
