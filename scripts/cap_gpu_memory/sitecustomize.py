"""Cap the GPU memory of vlgrpo processes, to see on a larger card whether a run fits a smaller one.

With this folder first on PYTHONPATH and VLGRPO_BENCH_MEMORY_GIB set, every Python process whose
command line names vlgrpo (the bench, a segment job, each torchrun rank) may allocate at most that
many GiB on its GPU: torch.cuda.set_per_process_memory_fraction, applied when CUDA initialises. The
allocator refuses beyond it and the static engine sizes its decode calls within it. Other processes
(Snakemake, grading workers) are left alone. On an H200, as an 80 GB card:

    export VLGRPO_BENCH_MEMORY_GIB=78 PYTHONPATH=$PWD/scripts/cap_gpu_memory:$PYTHONPATH
    vlgrpo bench --config configs/bench_h100.yaml --out $OUT/bench_h100_on_h200.json

Step times stay the larger card's.
"""

import os
import sys

_gib = os.environ.get("VLGRPO_BENCH_MEMORY_GIB")
if _gib and any("vlgrpo" in arg for arg in sys.orig_argv):
    import torch

    def _cap() -> None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(_gib) * 2**30 / total))
        print(f"cap_gpu_memory: {_gib} GiB of {total / 2**30:.1f} GiB", file=sys.stderr, flush=True)

    torch.cuda._lazy_call(_cap)  # no CUDA context before the process makes one
