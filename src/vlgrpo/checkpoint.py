"""The checkpoint store: resumable training state that Snakemake does not manage.

Layout under results/<experiment>/checkpoints/:
    global_step_000005/model/     Hugging Face folder (from_pretrained-able): config, processor and the
                                  weights as model-0000i-of-0000n.safetensors + model.safetensors.index.json
    global_step_000005/optim/     optimizer state: optim-0000i-of-0000n.safetensors (one tensor per
                                  parameter and state key, e.g. `state/<param name>/exp_avg`, and the RNG
                                  state) + optim.json (param groups, scalar state, each tensor's device)
    global_step_000005/state.json step, config hash, data position, W&B run id
    global_step_000005/manifest.json  bytes and CRC-32 of every file above
    latest.json                   the tracker: which checkpoint is the latest (without it, the newest
                                  intact one is resumed from)
    refused/                      corrupt checkpoints set aside, each with a .reason.txt

Every tensor is stored whole under its parameter's name, so the format does not depend on how many
processes wrote it. Each process writes its own pieces into the files at their offsets, straight from
the model's and optimizer's tensors: in one process every byte; under FSDP2 each rank the rows of
the parameters and optimizer state it holds (torch.chunk's split on dim 0), rank 0 the rest, so no
rank gathers another's. Files are written by a pool of threads (GPU tensors go through a small
pinned buffer per thread), the CRC-32 of each piece taken from its bytes as they are written, and
rank 0 combines the pieces' CRC-32s into the file's (they must cover it once). Loading is the same
in reverse on any number of processes: each reads its pieces once, in parallel, straight into the
model's and optimizer's tensors, and the CRC-32s of what they read must combine into the manifest's.
A checkpoint is written into a temporary folder, fsynced, renamed, and only then is the tracker
replaced atomically (the writing runs behind the segment's validation, which only reads the model:
save_behind), so a process killed at any moment leaves the previous checkpoint and tracker intact;
a checkpoint that fails its sizes or checksums at load is refused, set aside into refused/ (so it
counts no more toward keep_checkpoints) and the previous one used, said on the console (restore).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from vlgrpo import atomic, console, distributed, lora, paths, plan
from vlgrpo.config import experiment_dir
from vlgrpo.errors import VlgrpoError

log = logging.getLogger(__name__)
TRACKER, MANIFEST, STATE, OPTIM_JSON = "latest.json", "manifest.json", "state.json", "optim.json"
REFUSED = "refused"  # corrupt checkpoints set aside, with why
CHUNK = 64 << 20  # bytes staged through pinned memory at a time, per thread
SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def step_dir_name(step: int) -> str:
    return f"global_step_{step:06d}"


def io_threads() -> int:
    """Writer and reader threads: parallel files keep a local NVMe disk busy (8 measured on an H200 host)."""
    return max(1, min(8, os.cpu_count() or 1))


class CheckpointError(VlgrpoError, RuntimeError):
    pass


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, truncated or fail their checksums (not one that does not
    fit the model: that is a config mistake, and the checkpoint stays)."""


# --- tensor files: safetensors layout; each process writes and reads its own rows ---------------------
_local = threading.local()


def _pinned() -> torch.Tensor:
    """This thread's pinned staging buffer (CHUNK bytes), allocated once."""
    if getattr(_local, "buffer", None) is None:
        _local.buffer = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
    return _local.buffer


def _stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's CUDA stream on `device`: a checkpoint written behind a validation copies off the
    default stream, where the validation's kernels run."""
    streams = _local.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)  # a view: the tensor must be contiguous


def _piece(t: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(local tensor, byte offset of its first element in t's data, counted) of what this process holds
    of `t`. A DTensor sharded on dim 0 (FSDP2's parameters and optimizer state): its own rows, at the
    offset torch.chunk gives them, counted by the process that holds them. Any other tensor: whole, on
    every process, counted (written, and its bytes checksummed) by rank 0 only."""
    if not isinstance(t, DTensor):
        return t.detach(), 0, distributed.is_rank0()
    local = t.to_local().detach()
    if t.placements == (Replicate(),):
        return local, 0, distributed.is_rank0()
    if t.placements != (Shard(0),):
        raise CheckpointError(f"a tensor placed as {t.placements} on {t.device_mesh}: only Shard(0) (FSDP2) or Replicate")
    rows = t.shape[0]
    first, count = _my_rows(rows, t.device_mesh)
    if local.shape[0] != count:
        raise CheckpointError(f"a shard of {local.shape[0]} rows of {rows}: not FSDP2's torch.chunk layout")
    return local, first * (t.nbytes // max(rows, 1)), True


def _my_rows(rows: int, mesh) -> tuple[int, int]:
    """(first row, row count) of this process's Shard(0) piece of `rows` rows over a 1-D mesh, as
    torch.chunk splits them (FSDP2 and DTensor both do): ceil(rows / size) each, the last ones short."""
    chunk = -(-rows // mesh.size())
    first = min(rows, mesh.get_local_rank() * chunk)
    return first, min(rows, first + chunk) - first


def _empty_placed_as(param: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """An empty tensor of global `shape` on `param`'s device; a DTensor of this process's rows when
    `param` is sharded (the optimizer state of an FSDP2 parameter), so a load reads only those."""
    if not isinstance(param, DTensor) or not shape:
        return torch.empty(shape, dtype=dtype, device=param.device)
    local = list(shape)
    if param.placements == (Shard(0),):
        local[0] = _my_rows(shape[0], param.device_mesh)[1]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(torch.empty(local, dtype=dtype, device=param.to_local().device), param.device_mesh,
                              param.placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[int], int]:
    """A safetensors file of `tensors` (global shapes): its header bytes, each tensor's file offset, its size."""
    header, offset = {}, 0
    for name, t in tensors:
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    starts = [len(head) + e["data_offsets"][0] for name, e in header.items() if name != "__metadata__"]
    return head, starts, len(head) + offset


def _add_range(ranges: list, offset: int, data: memoryview) -> None:
    """Extend the CRC-32 of `ranges` (sorted (offset, length, crc) of bytes handled) with `data` at `offset`."""
    if not data.nbytes:
        return  # an empty piece (a rank past a short tensor's last row) covers nothing
    if ranges and sum(ranges[-1][:2]) == offset:
        first, length, crc = ranges.pop()
    else:
        first, length, crc = offset, 0, 0
    ranges.append((first, length + data.nbytes, zlib.crc32(data, crc)))


def _write_pieces(path: Path, tensors: list[tuple[str, torch.Tensor]], head: bytes, starts: list[int]) -> list[tuple[int, int, int]]:
    """Write this process's pieces of `tensors` into `path` (rank 0 made it with its header `head` and
    its size; `starts`: the tensors' file offsets) and fsync; return the (offset, length, CRC-32)
    ranges of the bytes written."""
    ranges: list = [(0, len(head), zlib.crc32(head))] if distributed.is_rank0() else []
    with open(path, "r+b") as f:
        for (name, t), start in zip(tensors, starts):
            local, offset, counted = _piece(t)
            if not counted:
                continue
            flat = _bytes_of(local.contiguous())
            f.seek(start + offset)
            if flat.device.type == "cpu":
                chunk = memoryview(flat.numpy())
                f.write(chunk)
                _add_range(ranges, start + offset, chunk)
                continue
            buffer = _pinned()
            for first in range(0, flat.numel(), CHUNK):
                n = min(CHUNK, flat.numel() - first)
                with torch.cuda.stream(_stream(flat.device)):
                    buffer[:n].copy_(flat[first : first + n])  # synchronous: waits for this stream only
                chunk = memoryview(buffer[:n].numpy())
                f.write(chunk)
                _add_range(ranges, start + offset + first, chunk)
        f.flush()
        os.fsync(f.fileno())
    return ranges


def _readinto(f, view: memoryview) -> None:
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise CorruptCheckpoint(f"{f.name} ends early")
        view = view[n:]


def _read_pieces(path: Path, target: Callable[[str, torch.dtype, list[int]], torch.Tensor]) -> list[tuple[int, int, int]]:
    """Read this process's pieces of the tensors of `path` into target(name, dtype, shape) (a DTensor
    receives its own rows); return the (offset, length, CRC-32) ranges of the bytes it counted."""
    ranges: list = []
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8 or struct.unpack("<Q", head)[0] > size - 8:
            raise CorruptCheckpoint(f"{path} has a corrupt header")
        (length,) = struct.unpack("<Q", head)
        raw = f.read(length)
        if distributed.is_rank0():
            _add_range(ranges, 0, memoryview(head + raw))
        try:
            header = json.loads(raw)
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            specs = [(name, TORCH_DTYPES[e["dtype"]], e["shape"], e["data_offsets"]) for name, e in entries]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise CorruptCheckpoint(f"{path} has a corrupt header ({e})") from None
        for name, dtype, shape, (begin, end) in specs:
            dest = target(name, dtype, shape)
            if dest.dtype != dtype or list(dest.shape) != list(shape) or dest.nbytes != end - begin:
                raise CheckpointError(f"{path}: {name} is {dtype} {shape} in the file, the model has {dest.dtype} {list(dest.shape)}")
            local, offset, counted = _piece(dest)
            if not local.is_contiguous():
                raise CheckpointError(f"{name}: this model holds it in a non-contiguous tensor")
            flat = _bytes_of(local)
            at = 8 + length + begin + offset
            f.seek(at)
            if flat.device.type == "cpu":
                view = memoryview(flat.numpy())
                _readinto(f, view)
                if counted:
                    _add_range(ranges, at, view)
                continue
            buffer = _pinned()
            for first in range(0, flat.numel(), CHUNK):
                n = min(CHUNK, flat.numel() - first)
                view = memoryview(buffer[:n].numpy())
                _readinto(f, view)
                if counted:
                    _add_range(ranges, at + first, view)
                flat[first : first + n].copy_(buffer[:n])  # synchronous: the buffer is reused next
    return ranges


def _check_ranges(path: Path, ranges: list[tuple[int, int, int]], size: int) -> int:
    """The CRC-32 of file `path` from the (offset, length, crc) ranges that every process handled,
    which must cover its `size` bytes once each."""
    crc, end = 0, 0
    for offset, length, part in sorted(ranges):
        if offset != end:
            raise CheckpointError(f"{path}: bytes {min(offset, end)}..{max(offset, end)} were "
                                  f"{'handled twice' if offset < end else 'handled by no process'}")
        crc, end = crc32_combine(crc, part, length), end + length
    if end != size:
        raise CheckpointError(f"{path}: {end} of its {size} bytes were handled")
    return crc


# CRC-32 of two concatenated byte strings from theirs (zlib's crc32_combine, which Python's zlib lacks):
# crc(A+B) = crc(A) * x^(8 len(B)) + crc(B) over GF(2) modulo the CRC-32 polynomial (reflected bits).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial (a nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=4096)
def _shift(length: int) -> int:
    """x^(8 length) modulo the polynomial: the product of x^(2^k) over the bits of 8 length (the
    pieces of a sharded checkpoint come in few distinct lengths: one per layer shape)."""
    p, k = 1 << 31, 3  # p = x^0
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(A + B) from crc1 = zlib.crc32(A), crc2 = zlib.crc32(B) and len2 = len(B)."""
    return _multmodp(_shift(len2), crc1) ^ crc2


def _crc_of_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _groups(tensors: dict[str, torch.Tensor], count: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`tensors` in up to `count` groups of about equal bytes (largest first into the lightest group).
    Ties go by name: the layout is the same whatever order the optimizer holds its state in (a resumed
    optimizer holds it in the order it was loaded), so a resumed run writes the files the straight one does."""
    groups: list[list] = [[] for _ in range(max(1, min(count, len(tensors))))]
    sizes = [0] * len(groups)
    for name, t in sorted(tensors.items(), key=lambda item: (-item[1].nbytes, item[0])):
        i = sizes.index(min(sizes))
        groups[i].append((name, t))
        sizes[i] += t.nbytes
    return groups


# --- what is saved: state dicts by parameter name --------------------------------------------------
def model_tensors(model) -> dict[str, torch.Tensor]:
    """The model's saved tensors by name (DTensors when FSDP2 shards it: the parameters themselves);
    tied aliases (lm_head = embeddings) left out, as save_pretrained does."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if lora.has_adapters(model):  # the adapters only, under peft's names; the base model is referenced
        return lora.adapter_tensors(model)
    unique = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: v for k, v in get_model_state_dict(model).items() if k in unique}


def optimizer_state(model, optimizer) -> dict:
    """{"state": {param name: {key: value}}, "param_groups": [... "params": [param names]]}: the
    optimizer's own tensors (DTensors for FSDP2's parameters), not copies."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqn = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]  # state_dict()'s numbering
    sd = optimizer.state_dict()
    return {"state": {fqn[i]: v for i, v in sd["state"].items()},
            "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_optimizer_state(model, optimizer, osd: dict) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    index = {names[id(p)]: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    try:
        optimizer.load_state_dict({"state": {index[n]: v for n, v in osd["state"].items()},
                                   "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"the optimizer state does not fit this model's trainable parameters ({e})") from None


def _optimizer_tensors(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer state's tensors by file name (`state/<param>/<key>`, and `rng/torch`), and optim.json:
    param groups, the scalar state, and where each tensor belongs (with its parameter, or on the host)."""
    tensors, scalars, devices = {"rng/torch": torch.get_rng_state()}, {}, {}
    for name, values in osd["state"].items():
        for key, value in values.items():
            if torch.is_tensor(value):
                tensors[f"state/{name}/{key}"] = value
                on_param = isinstance(value, DTensor) or value.device.type != "cpu"
                devices[f"state/{name}/{key}"] = "param" if on_param else "cpu"
            else:
                scalars.setdefault(name, {})[key] = value
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars, "devices": devices}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value):
    """Rank 0's `value` on every rank (a collective, so also a barrier); `value` in one process."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_behind(work: Callable[[], Any], name: str) -> Future:
    """`work` on a thread of its own (named `name`); the future's result() waits for it and raises what
    it raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(work)
    pool.shutdown(wait=False)
    return future


class PendingSave:
    """A checkpoint being saved. `write` (this process's pieces of the files; no collectives) runs on a
    background thread and reads the model's and optimizer's own tensors: the caller keeps them unchanged
    until result(). `publish(written)` (collectives when distributed) runs behind it in one process,
    else in the thread that calls result(), as collectives must: there every process learns whether all
    of them wrote their pieces (publish raises CheckpointError naming those that did not), so none
    waits for one that failed. result() waits until the checkpoint is published (raising what failed)
    and returns its folder; seconds: the whole save."""

    def __init__(self, write: Callable[[], None], publish: Callable[[bool], Path], publish_behind: bool):
        self.seconds = 0.0
        self._start, self._final = time.perf_counter(), None
        self._publish = None if publish_behind else publish  # left for result()

        def behind() -> Path | None:
            write()
            return publish(True) if publish_behind else None

        self._future = run_behind(behind, "checkpoint")

    def result(self) -> Path:
        if self._final is None:
            try:
                if self._publish is None:
                    self._final = self._future.result()
                else:
                    error = self._future.exception()
                    try:
                        self._final = self._publish(error is None)
                    except CheckpointError:
                        if error is not None:  # this process's own failure says more
                            raise error from None
                        raise
            finally:
                self.seconds = time.perf_counter() - self._start
        return self._final


class CheckpointStore:
    def __init__(self, root: str | os.PathLike, threads: int | None = None):
        self.root = Path(root)
        self.threads = threads or io_threads()

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def model_dir(self, step: int) -> Path:
        return self.path(step) / "model"

    @contextlib.contextmanager
    def _locked(self):
        """Serialises publishing and pruning between processes that share the store."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    # --- writing -------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, processor, state: dict, before_publish: Callable | None = None) -> Path:
        """Write checkpoint `step` and point the tracker at it; return its folder.

        before_publish: called when every file is written and fsynced, before the rename (fault tests).
        """
        return self.save_behind(step, model, optimizer, processor, state, before_publish).result()

    def save_behind(self, step: int, model, optimizer, processor, state: dict,
                    before_publish: Callable | None = None) -> PendingSave:
        """Start saving checkpoint `step`; its result() is the folder, once the tracker names it.

        A background thread in each process writes its pieces of the tensor files while the caller goes
        on (a segment validates meanwhile), straight from the model's and optimizer's own tensors (the
        caller must not change them before result()), GPU tensors copied on the writer threads' own
        CUDA streams: in one process every byte; under FSDP2 each rank its own rows, and rank 0 the
        tensors that are not sharded, so no rank gathers another's. First, here, rank 0 writes the small
        files and makes the tensor files at their size (a collective). One process publishes in the
        thread too; several publish in result(): rank 0 combines every rank's checksums into the
        manifest and renames the folder, and the other ranks wait for it.
        """
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        weights = model_tensors(model)
        tensors, meta = _optimizer_tensors(optimizer_state(model, optimizer))
        files = self._files(weights, tensors, lora.has_adapters(model))
        layouts = {f: _layout(group) for f, group in files.items()}  # (header, tensor offsets, size) of each
        if distributed.is_rank0():
            self._stage(tmp, step, model, processor, weights, meta, state, files, layouts)
        _barrier()  # the files exist, at their size, before any rank writes into them
        order = sorted(files, key=lambda f: -sum(t.nbytes for _, t in files[f]))  # largest first
        ranges: dict[str, list] = {}

        def write() -> None:
            with ThreadPoolExecutor(self.threads) as pool:
                ranges.update(zip(order, pool.map(lambda f: _write_pieces(tmp / f, files[f], *layouts[f][:2]), order)))
            if before_publish is not None and distributed.is_rank0():
                before_publish()

        def publish(written: bool) -> Path:
            reports = distributed.gather_objects(ranges if written else None)
            failed = [str(r) for r, report in enumerate(reports) if report is None]
            if failed:
                raise CheckpointError(f"rank {', '.join(failed)} could not write the checkpoint (its log says why)")
            final, error = self.path(step), None
            if distributed.is_rank0():
                try:
                    self._finish(tmp, {f: [r for report in reports for r in report[f]] for f in files})
                    self._publish(tmp, final, step)
                except Exception as e:
                    error = e
            message = _from_rank0(None if error is None else f"{type(error).__name__}: {error}")  # also a barrier
            if error is not None:
                raise error
            if message is not None:
                raise CheckpointError(f"rank 0 could not publish the checkpoint ({message})")
            return final

        for device in {t.device for group in files.values() for _, t in group if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)  # the writers' streams see the caller's last updates
        return PendingSave(write, publish, publish_behind=not dist.is_initialized())

    def _files(self, weights: dict, tensors: dict, adapters: bool = False) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """{relative path: [(name, tensor)]} of the tensor files, as rank 0 groups them (every rank must
        lay the files out alike, and the writer threads may differ between nodes). adapters: the model's
        tensors are LoRA adapters, in one file named as peft names it."""
        names = None
        if distributed.is_rank0():
            names = {}
            if adapters:
                names[lora.ADAPTER_FILE] = sorted(weights)
            for prefix, part in (("model/model", {} if adapters else weights), ("optim/optim", tensors)):
                groups = _groups(part, self.threads) if part else []
                for i, group in enumerate(groups):
                    names[f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors"] = [name for name, _ in group]
        every = {**weights, **tensors}
        return {f: [(name, every[name]) for name in group] for f, group in _from_rank0(names).items()}

    def _stage(self, tmp: Path, step: int, model, processor, weights: dict, meta: dict, state: dict, files: dict,
               layouts: dict) -> None:
        """The small files of checkpoint `step` written into `tmp`, and its tensor files made with their
        header at their full size, for every rank to write its pieces into."""
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "model").mkdir(parents=True)
        (tmp / "optim").mkdir()
        adapters = lora.has_adapters(model)
        for part in (processor,) if adapters else (getattr(model, "config", None), getattr(model, "generation_config", None), processor):
            if part is not None:  # a Hugging Face model and processor: the folder loads with from_pretrained
                part.save_pretrained(tmp / "model")
        atomic.write_json(tmp / "optim" / OPTIM_JSON, meta)
        atomic.write_json(tmp / STATE, {**state, "step": step})
        if adapters:  # a peft adapter folder (PeftModel.from_pretrained on the base model it names)
            lora.write_adapter_folder(model, tmp / "model")
        else:
            index = {"metadata": {"total_size": sum(t.nbytes for t in weights.values())},
                     "weight_map": {name: Path(f).name for f, group in files.items() if f.startswith("model/") for name, _ in group}}
            atomic.write_json(tmp / "model" / "model.safetensors.index.json", index)
        for f, (head, _, size) in layouts.items():
            with open(tmp / f, "wb") as out:
                out.write(head)
                out.truncate(size)

    def _finish(self, tmp: Path, ranges: dict[str, list]) -> None:
        """The manifest of every file in `tmp` (a tensor file's CRC-32 combined from the ranges every
        rank wrote, which must cover it), then everything fsynced."""
        manifest = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name, size = str(path.relative_to(tmp)), path.stat().st_size
            crc = _check_ranges(path, ranges[name], size) if name in ranges else _crc_of_file(path)
            manifest[name] = {"bytes": size, "crc32": crc}
        atomic.write_json(tmp / MANIFEST, manifest)
        atomic.fsync_tree(tmp)

    def _publish(self, tmp: Path, final: Path, step: int) -> None:
        with self._locked():
            shutil.rmtree(final, ignore_errors=True)  # a refused leftover of an earlier try
            os.rename(tmp, final)
            atomic.fsync_path(self.root)
            atomic.write_json(self.root / TRACKER, {"step": step, "path": final.name})

    # --- reading -------------------------------------------------------------------------
    def _manifest(self, step: int) -> dict:
        path = self.path(step) / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{self.path(step)} has no {MANIFEST}") from None
        except json.JSONDecodeError as e:
            raise CorruptCheckpoint(f"{path} is not valid JSON ({e})") from None
        for name, want in manifest.items():
            file = self.path(step) / name
            if not file.is_file():
                raise CorruptCheckpoint(f"{file} is missing")
            if file.stat().st_size != want["bytes"]:
                raise CorruptCheckpoint(f"{file} has {file.stat().st_size} bytes, its manifest says {want['bytes']} (truncated?)")
        return manifest

    def _small_file(self, step: int, name: str, manifest: dict) -> bytes:
        data = (self.path(step) / name).read_bytes()
        if zlib.crc32(data) != manifest[name]["crc32"]:
            raise CorruptCheckpoint(f"{self.path(step) / name} does not match its checksum")
        return data

    def load(self, step: int, model, optimizer=None) -> dict:
        """Load checkpoint `step` into `model` (and `optimizer`, and the torch RNG); return its state.

        Each process reads its pieces straight into the model's own tensors (under FSDP2 each rank its
        rows, whatever the number of ranks that wrote the checkpoint; a tensor that is not sharded, on
        every rank) and the optimizer's, once; the CRC-32 of every file, combined from what the ranks
        read, and every size are checked against the manifest, and every rank refuses the checkpoint
        or none does: CheckpointError on any mismatch (the model and optimizer are then partly
        overwritten: load another checkpoint).
        """
        manifest = self._manifest(step)
        state = json.loads(self._small_file(step, STATE, manifest))
        for name in manifest:
            if not name.endswith(".safetensors"):
                self._small_file(step, name, manifest)  # config, processor, index, optim.json: small
        if lora.has_adapters(model):  # adapters of another base model are refused by name (not a corrupt checkpoint)
            lora.check_base(self.model_dir(step), model.peft_config[lora.ADAPTER].base_model_name_or_path)
        model_targets = {k: v.detach() for k, v in model_tensors(model).items()}
        meta = json.loads((self.path(step) / "optim" / OPTIM_JSON).read_text()) if optimizer is not None else {}
        params = dict(model.named_parameters())
        optim_tensors: dict[str, torch.Tensor] = {}
        read: set[str] = set()

        def target(name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
            read.add(name)
            if name.startswith(("state/", "rng/")):
                param = params.get(name.split("/")[1]) if name.startswith("state/") else None
                if name.startswith("state/") and param is None:
                    raise CheckpointError(f"optimizer state {name} names no parameter of this model")
                # With its parameter (sharded as it is): what was saved there, and anything of its shape.
                on_param = param is not None and (meta["devices"].get(name) == "param" or list(shape) == list(param.shape))
                optim_tensors[name] = _empty_placed_as(param, dtype, shape) if on_param else torch.empty(shape, dtype=dtype)
                return optim_tensors[name]
            if name not in model_targets:
                raise CheckpointError(f"{self.path(step)} holds {name}, which this model does not have")
            return model_targets[name]

        files = sorted((n for n in manifest if n.endswith(".safetensors")), key=lambda n: -manifest[n]["bytes"])
        files = [n for n in files if optimizer is not None or n.startswith("model/")]
        error, ranges = None, {}
        try:
            with ThreadPoolExecutor(self.threads) as pool:
                ranges = dict(zip(files, pool.map(lambda n: _read_pieces(self.path(step) / n, target), files)))
            missing = set(model_targets) - read
            if missing:
                raise CheckpointError(f"{self.path(step)} lacks {len(missing)} model tensors, e.g. {sorted(missing)[:3]}")
        except CheckpointError as e:
            error = (type(e), str(e))
        reports = distributed.gather_objects((error, ranges))
        error = next((e for e, _ in reports if e is not None), None)
        if error is None and distributed.is_rank0():
            try:
                for n in files:
                    if _check_ranges(self.path(step) / n, [r for _, got in reports for r in got[n]], manifest[n]["bytes"]) != manifest[n]["crc32"]:
                        raise CorruptCheckpoint(f"{self.path(step) / n} does not match its checksum")
            except CheckpointError as e:
                error = (type(e), str(e))
        error = _from_rank0(error)  # every rank refuses the checkpoint, or none does
        if error is not None:
            kind, message = error
            raise kind(message)
        if optimizer is not None:
            osd = {"state": {}, "param_groups": meta["param_groups"]}
            for name, tensor in sorted(optim_tensors.items()):  # not the reading threads' order: alike on every rank
                if name.startswith("state/"):
                    _, param, key = name.split("/", 2)
                    osd["state"].setdefault(param, {})[key] = tensor
            for param, values in meta["scalars"].items():
                osd["state"].setdefault(param, {}).update(values)
            for group, current in zip(osd["param_groups"], optimizer.param_groups):  # JSON made tuples lists
                group.update({k: tuple(v) for k, v in group.items() if isinstance(current.get(k), tuple)})
            load_optimizer_state(model, optimizer, osd)
            if "rng/torch" in optim_tensors:
                torch.set_rng_state(optim_tensors["rng/torch"])
        return state

    def verify(self, step: int) -> str | None:
        """None if checkpoint `step` is complete and intact (every byte read), else what is wrong."""
        try:
            manifest = self._manifest(step)
            with ThreadPoolExecutor(self.threads) as pool:
                for name, crc in zip(manifest, pool.map(lambda n: _crc_of_file(self.path(step) / n), manifest)):
                    if crc != manifest[name]["crc32"]:
                        return f"{self.path(step) / name} does not match its checksum"
        except CheckpointError as e:
            return str(e)
        return None

    def steps(self) -> list[int]:
        """Steps of all finished checkpoint folders, oldest first (verified or not)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name.rsplit("_", 1)[1]) for p in self.root.glob("global_step_*") if p.is_dir())

    def tracked(self) -> int | None:
        tracker = self.root / TRACKER
        if not tracker.is_file():
            return None
        try:
            return int(json.loads(tracker.read_text())["step"])
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint tracker {tracker} is unreadable ({e}); delete it to start over") from None

    def candidates(self) -> list[int]:
        """Checkpoints to resume from, newest first: the tracker's and the older ones; without a
        tracker (deleted, or lost), every published one. Folders pruned to their weights (no
        manifest) are not checkpoints to resume from."""
        tracked = self.tracked()
        steps = [s for s in self.steps() if (self.path(s) / MANIFEST).is_file() and (tracked is None or s <= tracked)]
        if tracked is None and steps:
            log.warning("no tracker %s: resuming from the newest intact checkpoint of %s", self.root / TRACKER, steps)
        return steps[::-1]

    def latest(self) -> int | None:
        """The newest checkpoint whose files are all there at their recorded sizes (checksums are
        checked when it is loaded); None when there is none yet."""
        for step in self.candidates():
            try:
                self._manifest(step)
            except CheckpointError as e:
                log.error("refusing checkpoint %d: %s", step, e)
                continue
            return step
        if self.tracked() is not None:
            raise CheckpointError(f"no checkpoint in {self.root} is complete (tracker says step {self.tracked()}); "
                                  f"delete {self.root} to train from step 0")
        return None

    def set_aside(self, step: int, reason: str) -> Path:
        """Move corrupt checkpoint `step` out of the store into refused/ (kept for a look, no longer
        resumed from, pruned or counted toward keep_checkpoints); its new folder."""
        refused = self.root / REFUSED
        with self._locked():
            refused.mkdir(exist_ok=True)
            dest = refused / step_dir_name(step)
            for n in range(1, 1000):
                if not dest.exists():
                    break
                dest = refused / f"{step_dir_name(step)}.{n}"
            os.rename(self.path(step), dest)
            atomic.fsync_path(self.root)
            (refused / f"{dest.name}.reason.txt").write_text(reason + "\n")
        return dest

    def restore(self, model, optimizer, upto: int | None = None) -> tuple[int, dict]:
        """Load the newest checkpoint (at most `upto`) that loads intact; (step, state), (0, {}) if none.
        A corrupt one is set aside (set_aside) and the one before it tried; each fallback is said on
        the console (vlgrpo.console) as well as in the log."""
        tracked = self.tracked()
        refused, tried = [], [s for s in self.candidates() if upto is None or s <= upto]
        for step in tried:
            try:
                state = self.load(step, model, optimizer)
            except CorruptCheckpoint as e:
                where = self.set_aside(step, str(e)) if distributed.is_rank0() else None
                _barrier()  # moved before any rank looks at the next one
                console.say(f"refusing checkpoint {step}: {e}; set aside as {where}")
                refused.append(step)
                continue
            except CheckpointError as e:
                log.error("refusing checkpoint %d: %s", step, e)
                continue
            if refused or step != tracked:
                console.say(f"resuming from checkpoint {step}" + (f" instead of the tracker's {tracked}" if tracked else ""))
            return step, state
        if tracked is not None or tried:
            raise CheckpointError(f"no checkpoint in {self.root} loads intact (tracker says step {tracked}); "
                                  f"delete {self.root} to train from step 0")
        return 0, {}

    def state(self, step: int) -> dict:
        return json.loads((self.path(step) / STATE).read_text())

    # --- retention -----------------------------------------------------------------------
    def prune(self, keep: int, keep_weights_of: set[int]) -> None:
        """Keep the newest `keep` checkpoints whole; of older ones keep only the model folder of the
        steps in `keep_weights_of` (validations still to run, or kept by config)."""
        with self._locked():
            steps = self.steps()
            for step in steps[: max(0, len(steps) - keep)]:
                folder = self.path(step)
                if step in keep_weights_of:  # the manifest first: a folder with one is a whole checkpoint
                    for name in (MANIFEST, STATE):
                        (folder / name).unlink(missing_ok=True)
                    shutil.rmtree(folder / "optim", ignore_errors=True)
                else:
                    shutil.rmtree(folder, ignore_errors=True)


def apply_retention(cfg: dict, total_steps: int, validated: Callable[[int], bool]) -> None:
    """trainer.keep_checkpoints newest checkpoints stay whole; older ones keep their weights only while
    their validation is pending (or for good with trainer.keep_validated_weights). The trainer's save
    path is the only caller, so retention is decided in one place."""
    exp = experiment_dir(cfg)
    keep = set(plan.validation_steps(cfg, total_steps))
    if not cfg["trainer"]["keep_validated_weights"]:
        keep = {s for s in keep if not validated(s)}
    CheckpointStore(paths.path(paths.CHECKPOINTS, exp)).prune(cfg["trainer"]["keep_checkpoints"], keep)
