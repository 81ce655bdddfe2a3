"""Checkpoint benchmark: what a segment waits for a save, the whole save, and a load, in one process
or under torchrun with FSDP2 (each rank writing and reading its own rows).

    PYTHONPATH=src python3 scripts/bench_checkpoint.py --dir /tmp/ckpt --out /tmp/bench_checkpoint_1.json
    PYTHONPATH=src python3 -m torch.distributed.run --nproc-per-node 2 scripts/bench_checkpoint.py \
        --dir /tmp/ckpt --out benchmarks/results/bench_checkpoint_cpu2.json

A stack of --layers bf16 Linear(--width, --width) layers (24 x 4096: 0.8 GB of weights; torch AdamW
adds 1.6 GB of bf16 moments), on cuda:LOCAL_RANK when there is a GPU, else the CPU (gloo). Under
torchrun each layer and the stack are sharded with fully_shard, as vlgrpo shards a model. For each of
--reps: save_behind's foreground (what a segment waits before validating), the whole save (write,
fsync, manifest, rename), and a load of it into the same model and optimizer. Rank 0 prints them and
writes JSON. It calls only CheckpointStore.save_behind and load, so it also measures older commits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vlgrpo import distributed
from vlgrpo.checkpoint import CheckpointStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="the checkpoint store (emptied first); its disk is what is measured")
    parser.add_argument("--out", help="JSON of the figures (rank 0)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    device = distributed.init(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    if distributed.launched():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (distributed.world(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # the moments exist
    optimizer.zero_grad(set_to_none=True)

    def synchronized() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        return time.perf_counter()

    reps = []
    for _ in range(args.reps):
        if distributed.is_rank0():
            shutil.rmtree(args.dir, ignore_errors=True)
        store = CheckpointStore(args.dir)
        start = synchronized()
        saving = store.save_behind(1, model, optimizer, None, {"config_hash": "bench"})
        foreground = time.perf_counter() - start
        saving.result()
        saved = synchronized() - start
        start = synchronized()
        store.load(1, model, optimizer)
        loaded = synchronized() - start
        reps.append({"save_foreground_s": round(foreground, 3), "save_s": round(saved, 3), "load_s": round(loaded, 3)})
    if not distributed.is_rank0():
        return
    size = sum(f.stat().st_size for f in Path(args.dir).rglob("*") if f.is_file())
    result = {
        "what": "CheckpointStore.save_behind (foreground and whole) and load, per repetition",
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(["scripts/bench_checkpoint.py", *sys.argv[1:]]),
        "processes": distributed.world(), "torchrun": distributed.launched(), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_count": os.cpu_count(), "host": platform.node(), "torch": torch.__version__,
        "layers": args.layers, "width": args.width, "checkpoint_bytes": size, "checkpoint_gb": round(size / 1e9, 3),
        "dir": str(args.dir),
        "reps": reps,
    }
    for i, rep in enumerate(reps):
        print(f"rep {i + 1}: save waited {rep['save_foreground_s']:.2f} s, whole save {rep['save_s']:.2f} s, "
              f"load {rep['load_s']:.2f} s ({result['checkpoint_gb']} GB, {result['processes']} process(es) on {device.type})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
