#!/usr/bin/env bash
# Prepare .benchdata/ (gitignored via .git/info/exclude) for GPU runs on a machine without internet
# whose image has torch and transformers but not the workflow's other packages (the lent H200s:
# Python 3.12, torch 2.11, transformers 5.17). Run here, from the repository root, with internet:
#     bash scripts/device_wheels.sh
# It writes (~50 MB, under the 64 MiB a device call carries):
#   .benchdata/whl/            wheels for CPython 3.12 manylinux x86_64: snakemake 9.27.1 and its whole
#                              dependency closure, and vlgrpo's own packages missing there (datasets,
#                              jsonschema, mathruler ...); pure-Python sdists are built into wheels here
#   .benchdata/qwen2_5_vl_3b/  Qwen2.5-VL-3B's config, processor and tokenizer (no weights)
#   .benchdata/geometry3k/     Geometry3K's test split and the first 560 rows of its train split (raw:
#                              the workflow filters them on the device; 512+ rows stay, 16 steps an epoch)
#   .benchdata/<family>/       the config.json of the other families' folders (qwen2_vl_2b, qwen2_5_vl_7b,
#                              qwen3_vl_4b, qwen3_5_0_8b): tests/families.py shrinks them into the tiny
#                              towers of the CUDA tests (tests/test_vision_rope.py); no processor files
# On the device (carry .benchdata):
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .benchdata/whl/*.whl
#     export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.benchdata
SHARED=${SHARED:-../shared/data}
mkdir -p "$OUT/whl" "$OUT/geometry3k"
grep -qx "/.benchdata/" .git/info/exclude 2>/dev/null || echo /.benchdata/ >> "$(git rev-parse --git-path info/exclude)"

# Pure-Python packages published only as sdists: build their wheels (platform-independent) first.
python3 -m pip wheel -q --no-deps -w "$OUT/whl" "connection_pool>=0.0.3"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any)
python3 -m pip download -q -d "$OUT/whl" --find-links "$OUT/whl" "${TARGET[@]}" snakemake==9.27.1
# vlgrpo's own imports that the image lacks (jsonschema came with snakemake).
python3 -m pip download -q -d "$OUT/whl" --no-deps "${TARGET[@]}" datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    mathruler==0.1.0 pylatexenc==2.11

cp -r "$SHARED/qwen2_5_vl_3b" "$OUT/" && chmod -R u+w "$OUT/qwen2_5_vl_3b"
cp "$SHARED/geometry3k/test.parquet" "$OUT/geometry3k/"
for family in qwen2_vl_2b qwen2_5_vl_7b qwen3_vl_4b qwen3_5_0_8b; do
    mkdir -p "$OUT/$family" && cp "$SHARED/$family/config.json" "$OUT/$family/"
done
python3 -c "import pyarrow.parquet as pq; pq.write_table(pq.read_table('$SHARED/geometry3k/train.parquet').slice(0, 560), '$OUT/geometry3k/train.parquet')"
du -sh "$OUT"
