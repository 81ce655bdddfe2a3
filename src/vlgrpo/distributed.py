"""Many processes, one device each: the process group, the split of work between ranks, FSDP2.

A training segment with trainer.n_gpus_per_node x trainer.nnodes > 1 runs under torchrun (vlgrpo
train launches it); each process is one rank. On CUDA the ranks talk through NCCL, each on the GPU of
its LOCAL_RANK; on the CPU (trainer.device cpu, how CI tests it) through gloo. Without torchrun
nothing here is initialised and every helper answers as for one process: rank 0 of 1, no sharding.

Policy and reference are sharded with FSDP2 (fully_shard): each vision block and decoder layer is a
unit, the model the root (embeddings, lm_head tied to them, final norm, patch embedding, merger).
FSDP averages gradients over ranks; the trainer normalises each rank's loss by the whole mini-batch's
token count and scales it by the world size, so the result is the sum over ranks: the 1-process
gradient.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import types

import torch
import torch.distributed as dist

def launched() -> bool:
    """True in a process that torchrun started (it sets WORLD_SIZE and the rendezvous variables)."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init(device: torch.device) -> torch.device:
    """Join torchrun's process group (once) and return this rank's device: cuda:LOCAL_RANK or the CPU.

    Without torchrun: `device` unchanged, no process group."""
    if not launched():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # A long timeout: ranks legitimately wait for each other through a validation or a checkpoint
        # write; a rank that hangs for good is the watchdog's business (its heartbeat goes stale).
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    return device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def share(count: int, r: int | None = None, w: int | None = None) -> range:
    """Rank r's contiguous share of `count` items (the first count % w ranks take one more)."""
    r, w = rank() if r is None else r, world() if w is None else w
    base, extra = divmod(count, w)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


def gather_objects(obj) -> list:
    """`obj` of every rank, in rank order (picklable, small: token ids, texts, scores)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place across ranks; a no-op for one process. CPU tensors go through the GPU under NCCL."""
    if not dist.is_initialized():
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        moved = tensor.cuda()
        dist.all_reduce(moved, op=op)
        return tensor.copy_(moved.cpu())
    dist.all_reduce(tensor, op=op)
    return tensor


def over_ranks(values: dict[str, float], op=dist.ReduceOp.SUM) -> dict[str, float]:
    """Each value reduced over ranks (SUM: metrics summed over the ranks' rows; MAX: per-rank peaks)."""
    if not dist.is_initialized() or not values:
        return values
    keys = sorted(values)
    t = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64), op)
    return dict(zip(keys, t.tolist()))


def balanced_split(rows: list[int], seqlens: list[int], w: int) -> list[list[int]]:
    """`rows` into w parts of equal size (within one) and about equal tokens: longest first, each to
    the lightest part that still has room (EasyR1 balances its ranks' tokens the same way). Each part
    in batch order."""
    cap = -(-len(rows) // w)
    parts: list[list[int]] = [[] for _ in range(w)]
    tokens = [0] * w
    for row in sorted(rows, key=lambda i: -seqlens[i]):
        k = min((k for k in range(w) if len(parts[k]) < cap), key=lambda k: tokens[k])
        parts[k].append(row)
        tokens[k] += seqlens[row]
    return [sorted(p) for p in parts]


def padded(batches: list[list[int]], filler: list[int]) -> list[tuple[list[int], bool]]:
    """(rows, real) micro-batches, padded with (filler, False) to the largest count on any rank:
    FSDP's all-gathers and reduce-scatters run once per forward and backward of each unit, so every
    rank must run as many forwards and backwards as every other."""
    count = torch.tensor([len(batches)], dtype=torch.int64)
    most = int(all_reduce(count, dist.ReduceOp.MAX)[0])
    return [(b, True) for b in batches] + [(filler, False)] * (most - len(batches))


# --- FSDP2 --------------------------------------------------------------------------------------------
def is_sharded(model) -> bool:
    if not dist.is_initialized():  # one process: never sharded (and no FSDP import)
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model, device: torch.device, offload: bool = False):
    """FSDP2 over the ranks: each vision block and decoder layer a unit, then the root.

    bf16 models keep bf16 parameters (the optimizers hold fp32 masters or Kahan compensation, as in
    one process) and reduce gradients in fp32. offload (trainer.fsdp_cpu_offload): sharded parameters,
    gradients and optimizer state live in host memory (CUDA only; on the CPU they are there anyway).
    The model gains `root_call`, which runs a function of the model inside the root's forward hooks
    (response_logprobs calls the inner model and lm_head directly, not model.forward: the root's
    parameters must be gathered around both).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

    dtype = next(model.parameters()).dtype  # model.dtype, as loaded
    mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else MixedPrecisionPolicy()
    kwargs = {
        "mesh": init_device_mesh(device.type, (world(),)),
        "mp_policy": mixed,
        "offload_policy": CPUOffloadPolicy() if offload and device.type == "cuda" else OffloadPolicy(),
    }
    from vlgrpo.models import text_model, vision_tower

    for block in getattr(vision_tower(model), "blocks", []):  # a text-only model has no tower
        fully_shard(block, **kwargs)
    for layer in text_model(model).layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP takes the first unit to run forward for the root; generate runs the vision tower before the
    # model's forward, so the root is settled here (private API: there is no public one).
    model._get_fsdp_state()._lazy_init()
    # FSDP keeps the root gathered after its forward by default; so kept through the step's no-grad
    # forwards (generation, old and ref log-probs), the root's parameters got no gradients in the update
    # (None on 2 gloo ranks). Resharded after each forward like every unit, it gathers afresh each time.
    model.set_reshard_after_forward(True, recurse=False)
    model.root_call = types.MethodType(lambda self, fn, *args, **kw: fn(self, *args, **kw), model)
    register_fsdp_forward_method(model, "root_call")
    return model


def root_call(model, fn, *args, **kwargs):
    """fn(model, *args, **kwargs), inside the root's FSDP forward hooks when the model is sharded."""
    call = getattr(model, "root_call", None)
    return fn(model, *args, **kwargs) if call is None else call(fn, *args, **kwargs)


@contextlib.contextmanager
def gathered(model):
    """Every unit of a sharded model gathered for the whole block, so that its forwards run no
    collectives: ranks generate different numbers of tokens (each stops at its own EOS). A no-op for
    a model that is not sharded."""
    if model is None or not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
        if unit is not model:
            unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            if unit is not model:
                unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()
