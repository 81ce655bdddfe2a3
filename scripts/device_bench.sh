#!/usr/bin/env bash
# Issue 34's GPU figures in one device call, on a lent machine without internet whose image has torch
# and transformers (Python 3.12): the rest comes from .benchdata, made here by scripts/device_wheels.sh
# and carried (the device tool's carry: [".benchdata"], ~56 MB). Run from the repository root there:
#     bash scripts/device_bench.sh step startup        # ~330 s on an H100
# Parts, in the order given; each writes under $OUT (default /tmp/out):
#   gputests  the tests that need CUDA (skipped on the CPU): fast paths against the plain ones on the card
#   step      vlgrpo bench on configs/bench_h100.yaml (the 80 GB settings), 2 measured steps, profiled,
#             with the validation (bench_h100_<card>.json, .profile.txt, .eval.profile.txt)
#   h200      on an H200 (no cap): vlgrpo bench on configs/bench_h200.yaml, the seed recipe's own settings,
#             2 measured steps, profiled, with the validation (bench_h200.json, .profile.txt, .eval.profile.txt)
#   ab        the same bench without the profiler on this src and on .benchdata/prev/src, one after the
#             other (make it here: mkdir -p .benchdata/prev && git archive <commit> src | tar -x -C
#             .benchdata/prev): bench_h100_<card>_{now,prev}.json
#   decode    scripts/bench_decode_attention.py: the decode step's attention kernel against SDPA over
#             the masked cache (decode_attention_<card>.json)
#   startup   scripts/bench_startup.py --device cuda, and `import vlgrpo.trainer` timed with and without
#             a writable bytecode cache (PYTHONPYCACHEPREFIX): whether the host compiles at each start
#   torchrun1 the 80 GB bench without the validation, 3 steps, in one process and under torchrun as one
#             FSDP2 rank, one after the other (bench_torchrun1_<card>_{single,fsdp}.json)
#   rope      the 80 GB bench with its validation, model.fused_vision_rope off, then on and profiled
#             (bench_rope_<card>_{false,true}.json)
#   disk      10 GiB written and fsynced by 1 and by 8 writers, then removed: what a checkpoint's save can reach
#   segments  scripts/bench_segments.py: $SEGMENTS (default 2) segments of $SEGMENT_STEPS (default 3) steps under torchrun, the 80 GB
#             settings (bench_segments_torchrun1_<card>.json)
# On an H200, scripts/cap_gpu_memory holds every vlgrpo process to 78 GiB (an 80 GB card's share).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .benchdata/whl/*.whl 2>&1 | grep -v "already exists"
export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH
mkdir -p ../shared && ln -sfn "$PWD/.benchdata" ../shared/data  # the configs' ../shared/data paths
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
tag=h100
if [[ $card == *H200* ]]; then
    tag=h200cap78
    export VLGRPO_BENCH_MEMORY_GIB=78 PYTHONPATH=$PWD/scripts/cap_gpu_memory:$PYTHONPATH
fi
echo "card: $card; setup $(( $(date +%s) - start )) s"
quiet() { grep -v -e pylatexenc -e "generate:" -e "Generating" -e "datasets INFO"; }
import_time() {
    python3 -c "import time; t = time.perf_counter(); import vlgrpo.trainer; print('$1: import vlgrpo.trainer', round(time.perf_counter() - t, 2), 's')"
}
for part in "$@"; do
    echo "== $part $(date +%T)"
    case $part in
        gputests)
            python3 -c "import torch.nn.attention.varlen as v, inspect; print('varlen_attn', inspect.signature(v.varlen_attn))"
            timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_fast_paths.py \
                tests/test_decode_attention.py tests/test_vision_rope.py -k cuda 2>&1 | tail -8 ;;
        step)
            timeout -s ABRT 400 python3 -m vlgrpo.cli bench --config configs/bench_h100.yaml --warmup 1 --steps 2 \
                --plain-steps 0 --profile --out "$OUT/bench_h100_$tag.json" 2>&1 | quiet | tail -30
            cat "$OUT/bench_h100_$tag.eval.profile.txt" 2>/dev/null | head -30 ;;
        h200)
            [[ $tag == h200cap78 ]] || { echo "h200: this card is not an H200 ($card)"; continue; }
            VLGRPO_BENCH_MEMORY_GIB= PYTHONPATH=/tmp/site:$PWD/src timeout -s ABRT 420 python3 -m vlgrpo.cli bench \
                --config configs/bench_h200.yaml --warmup 1 --steps 2 --plain-steps 0 --profile --out "$OUT/bench_h200.json" 2>&1 | quiet | tail -30
            head -30 "$OUT/bench_h200.eval.profile.txt" 2>/dev/null ;;
        ab)
            for code in now prev; do
                src=$PWD/src; [[ $code == prev ]] && src=$PWD/.benchdata/prev/src
                PYTHONPATH=/tmp/site:$src timeout -s ABRT 300 python3 -m vlgrpo.cli bench --config configs/bench_h100.yaml \
                    --warmup 1 --steps 2 --plain-steps 0 --out "$OUT/bench_h100_${tag}_$code.json" 2>&1 | quiet | tail -14
            done ;;
        rope)
            for rope in false true; do
                profile=(); [[ $rope == true ]] && profile=(--profile)
                timeout -s ABRT 280 python3 -m vlgrpo.cli bench --config configs/bench_h100.yaml --warmup 1 --steps 2 \
                    --plain-steps 0 --set model.fused_vision_rope=$rope "${profile[@]}" --out "$OUT/bench_rope_${tag}_$rope.json" 2>&1 | quiet | tail -6
            done
            head -30 "$OUT/bench_rope_${tag}_true.eval.profile.txt" 2>/dev/null ;;
        disk)
            df -h /tmp | tail -1
            for writers in 1 8; do
                t=$EPOCHREALTIME
                for i in $(seq $writers); do dd if=/dev/zero of=/tmp/dd_$i bs=64M count=$((160 / writers)) conv=fsync status=none & done; wait
                echo "disk: 10 GiB by $writers writers, fsynced: $(awk "BEGIN {print $EPOCHREALTIME - $t}") s"
                t=$EPOCHREALTIME; rm -f /tmp/dd_*; sync; echo "disk: removed in $(awk "BEGIN {print $EPOCHREALTIME - $t}") s"
            done ;;
        decode)
            timeout -s ABRT 200 python3 scripts/bench_decode_attention.py --out "$OUT/decode_attention_$tag.json" 2>&1 | tail -8 ;;
        startup)
            import_time plain; import_time plain-again
            PYTHONPYCACHEPREFIX=/tmp/pyc import_time cache-first; PYTHONPYCACHEPREFIX=/tmp/pyc import_time cache-again
            timeout -s ABRT 150 python3 scripts/bench_startup.py --device cuda --repeats 2 \
                --out "$OUT/bench_startup_$tag.json" 2>&1 | quiet | tail -25 ;;
        torchrun1)
            for launch in single fsdp; do
                run=(python3); [[ $launch == fsdp ]] && run=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)
                timeout -s ABRT 240 "${run[@]}" -m vlgrpo.cli bench --config configs/bench_h100.yaml --warmup 1 --steps 3 \
                    --plain-steps 0 --no-eval --out "$OUT/bench_torchrun1_${tag}_$launch.json" 2>&1 | quiet | grep -e "step [0-9]*:" -e "static engine" -e Error | tail -8
            done ;;
        segments)
            timeout -s ABRT 540 python3 scripts/bench_segments.py --torchrun --segments ${SEGMENTS:-2} --steps ${SEGMENT_STEPS:-3} \
                --set model.gradient_checkpointing=true --set worker.actor.micro_batch_size_per_device_for_update=32 \
                --out "$OUT/bench_segments_torchrun1_$tag.json" 2>&1 | quiet | tail -20
            grep -h -A25 "in-process validation of step" /tmp/vlgrpo_bench_segments/results/bench_segments/logs/train_*.log | tail -40 ;;
        *) echo "unknown part $part (gputests, step, h200, rope, disk, torchrun1, ab, decode, startup, segments)"; exit 2 ;;
    esac
done
echo "== done in $(( $(date +%s) - start )) s"
