"""The checkpoint store: resumable training state that Snakemake does not manage.

Layout under results/<experiment>/checkpoints/:
    global_step_000005/model/     Hugging Face folder (from_pretrained-able): config, processor and the
                                  weights as model-0000i-of-0000n.safetensors + model.safetensors.index.json
    global_step_000005/optim/     optimizer state: optim-0000i-of-0000n.safetensors (one tensor per
                                  parameter and state key, e.g. `state/<param name>/exp_avg`, and the RNG
                                  state) + optim.json (param groups, scalar state, each tensor's device)
    global_step_000005/state.json step, config hash, data position, W&B run id
    global_step_000005/manifest.json  bytes and CRC-32 of every file above
    latest.json                   the tracker: which checkpoint is the latest

Every tensor is stored whole under its parameter's name (the full state dict), so the format does not
depend on how many processes wrote it. Tensor files are written by a pool of threads (GPU tensors go
through a small pinned buffer per thread), their CRC-32 computed from the bytes as they are written;
loading reads each file once, in parallel, straight into the model's and optimizer's tensors, and
checks the CRC-32 of the bytes it read. A checkpoint is written into a temporary folder, fsynced,
renamed, and only then is the tracker replaced atomically (the writing runs behind the segment's
validation, which only reads the model: save_behind), so a process killed at any moment leaves
the previous checkpoint and tracker intact; a checkpoint that fails its sizes or checksums at load is
refused with a message and the previous one is used (restore).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from vlgrpo import atomic, paths, plan
from vlgrpo.config import experiment_dir
from vlgrpo.errors import VlgrpoError

log = logging.getLogger(__name__)
TRACKER, MANIFEST, STATE, OPTIM_JSON = "latest.json", "manifest.json", "state.json", "optim.json"
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


# --- tensor files: safetensors layout, written and read with their checksum in one pass ---------------
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


def _write_file(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """One safetensors file of `tensors`, fsynced; returns its size and the CRC-32 of its bytes."""
    header, offset = {}, 0
    for name, t in tensors:
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    crc = zlib.crc32(head)
    with open(path, "wb") as f:
        f.write(head)
        for _, t in tensors:
            flat = _bytes_of(t.contiguous())
            if flat.device.type == "cpu":
                chunk = memoryview(flat.numpy())
                f.write(chunk)
                crc = zlib.crc32(chunk, crc)
                continue
            buffer = _pinned()
            for start in range(0, flat.numel(), CHUNK):
                n = min(CHUNK, flat.numel() - start)
                with torch.cuda.stream(_stream(flat.device)):
                    buffer[:n].copy_(flat[start : start + n])  # synchronous: waits for this stream only
                chunk = memoryview(buffer[:n].numpy())
                f.write(chunk)
                crc = zlib.crc32(chunk, crc)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(head) + offset, "crc32": crc}


def _readinto(f, view: memoryview) -> None:
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise CheckpointError(f"{f.name} ends early")
        view = view[n:]


def _read_file(path: Path, want: dict, target: Callable[[str, torch.dtype, list[int]], torch.Tensor]) -> None:
    """Read a tensor file once into target(name, dtype, shape) tensors, checking size and CRC-32."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, its manifest says {want['bytes']} (truncated?)")
        head = f.read(8)
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise CheckpointError(f"{path} has a corrupt header")
        raw = f.read(length)
        crc = zlib.crc32(raw, zlib.crc32(head))
        try:
            header = json.loads(raw)
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            specs = [(name, TORCH_DTYPES[e["dtype"]], e["shape"], e["data_offsets"][1] - e["data_offsets"][0]) for name, e in entries]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"{path} has a corrupt header ({e})") from None
        for name, dtype, shape, nbytes in specs:
            dest = target(name, dtype, shape)
            if dest.dtype != dtype or list(dest.shape) != list(shape) or dest.nbytes != nbytes:
                raise CheckpointError(f"{path}: {name} is {dtype} {shape} in the file, the model has {dest.dtype} {list(dest.shape)}")
            flat = _bytes_of(dest)
            if flat.device.type == "cpu":
                view = memoryview(flat.numpy())
                _readinto(f, view)
                crc = zlib.crc32(view, crc)
                continue
            buffer = _pinned()
            for start in range(0, flat.numel(), CHUNK):
                n = min(CHUNK, flat.numel() - start)
                view = memoryview(buffer[:n].numpy())
                _readinto(f, view)
                crc = zlib.crc32(view, crc)
                flat[start : start + n].copy_(buffer[:n])  # synchronous: the buffer is reused next
    if crc != want["crc32"]:
        raise CheckpointError(f"{path} does not match its checksum")


def _crc_of_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _groups(tensors: dict[str, torch.Tensor], count: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`tensors` in up to `count` groups of about equal bytes (largest first into the lightest group)."""
    groups: list[list] = [[] for _ in range(max(1, min(count, len(tensors))))]
    sizes = [0] * len(groups)
    for name, t in sorted(tensors.items(), key=lambda item: -item[1].nbytes):
        i = sizes.index(min(sizes))
        groups[i].append((name, t))
        sizes[i] += t.nbytes
    return groups


# --- what is saved: full state dicts by parameter name ------------------------------------------------
def _options() -> StateDictOptions:
    """Full (unsharded) tensors on rank 0 when distributed: the files do not depend on the world size."""
    distributed = dist.is_initialized()
    return StateDictOptions(full_state_dict=distributed, cpu_offload=distributed, broadcast_from_rank0=distributed)


def model_tensors(model) -> dict[str, torch.Tensor]:
    """The model's saved tensors by name; tied aliases (lm_head = embeddings) left out, as save_pretrained does."""
    unique = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: v for k, v in get_model_state_dict(model, options=_options()).items() if k in unique}


def tied_aliases(model) -> dict[str, str]:
    """{alias: name} of parameters that are another's (lm_head.weight -> the embeddings): saved once."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def optimizer_state(model, optimizer) -> dict:
    """{"state": {param name: {key: value}}, "param_groups": [... "params": [param names]]}."""
    if dist.is_initialized():
        return get_optimizer_state_dict(model, optimizer, options=_options())
    names = {id(p): n for n, p in model.named_parameters()}
    fqn = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]  # state_dict()'s numbering
    sd = optimizer.state_dict()
    return {"state": {fqn[i]: v for i, v in sd["state"].items()},
            "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_optimizer_state(model, optimizer, osd: dict) -> None:
    if dist.is_initialized():
        set_optimizer_state_dict(model, optimizer, osd, options=_options())
        return
    names = {id(p): n for n, p in model.named_parameters()}
    index = {names[id(p)]: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    try:
        optimizer.load_state_dict({"state": {index[n]: v for n, v in osd["state"].items()},
                                   "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"the optimizer state does not fit this model's trainable parameters ({e})") from None


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


class PendingSave:
    """A checkpoint being saved: `write` (files only, no collectives) runs on a background thread;
    `publish(written)` (collectives when distributed) runs behind it in one process, else in the thread
    that calls result(), as collectives must: there every rank learns whether rank 0 wrote the files
    (publish returns None where it did not), so none waits for a rank 0 that failed. result() waits until
    the checkpoint is published (raising what failed) and returns its folder; seconds: the whole save.
    in_place: the writer reads the model's and optimizer's own tensors (one process): keep them till then."""

    def __init__(self, write: Callable[[], None], publish: Callable[[bool], Path | None], publish_behind: bool):
        self.seconds = 0.0
        self.in_place = publish_behind
        self._start, self._final = time.perf_counter(), None
        self._publish = None if publish_behind else publish  # left for result()

        def behind() -> Path | None:
            write()
            return publish(True) if publish_behind else None

        writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._future = writer.submit(behind)
        writer.shutdown(wait=False)

    def result(self) -> Path:
        if self._final is None:
            try:
                if self._publish is None:
                    self._final = self._future.result()
                else:
                    error = self._future.exception()
                    self._final = self._publish(error is None)
                    if self._final is None:
                        raise error or CheckpointError("rank 0 could not write the checkpoint (its log says why)")
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

    def save_behind(self, step: int, model, optimizer, processor, state: dict, before_publish: Callable | None = None,
                    after_publish: Callable | None = None) -> PendingSave:
        """Start saving checkpoint `step`; its result() is the folder, once the tracker names it.

        A background thread writes and fsyncs the tensor files while the caller goes on (a segment
        validates meanwhile). In one process it reads the model's and optimizer's tensors in place (the
        caller must not change them before result()), GPU tensors copied on the writer threads' own CUDA
        streams, and publishes too. Several processes first gather full tensors onto rank 0's host (a
        collective, here), rank 0 writes them behind, and result() publishes between barriers.
        after_publish: run once the new checkpoint is published (retention).
        """
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        weights, osd = model_tensors(model), optimizer_state(model, optimizer)
        files = self._stage(tmp, step, model, processor, weights, osd, state) if _is_rank0() else {}

        def write() -> None:
            if _is_rank0():
                self._write(tmp, files)
                if before_publish is not None:
                    before_publish()

        def publish(written: bool) -> Path | None:
            if not _from_rank0(written):
                return None
            final = self.path(step)
            if _is_rank0():
                self._publish(tmp, final, step)
            _barrier()
            if after_publish is not None and _is_rank0():
                after_publish()
            return final

        for device in {t.device for group in files.values() for _, t in group if t.is_cuda}:
            torch.cuda.synchronize(device)  # the writers' streams see the caller's last updates
        return PendingSave(write, publish, publish_behind=not dist.is_initialized())

    def _stage(self, tmp: Path, step: int, model, processor, weights: dict, osd: dict, state: dict) -> dict:
        """The small files of checkpoint `step` written into `tmp`; {relative path: tensors} of the big ones."""
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "model").mkdir(parents=True)
        (tmp / "optim").mkdir()
        for part in (getattr(model, "config", None), getattr(model, "generation_config", None), processor):
            if part is not None:  # a Hugging Face model and processor: the folder loads with from_pretrained
                part.save_pretrained(tmp / "model")
        tensors, scalars, devices = {"rng/torch": torch.get_rng_state()}, {}, {}
        for name, values in osd["state"].items():
            for key, value in values.items():
                if torch.is_tensor(value):
                    tensors[f"state/{name}/{key}"] = value
                    # Gathered state comes to the host (cpu_offload); per-parameter tensors belong with their parameter.
                    on_param = value.device.type != "cpu" or (dist.is_initialized() and value.dim() > 0)
                    devices[f"state/{name}/{key}"] = "param" if on_param else "cpu"
                else:
                    scalars.setdefault(name, {})[key] = value
        atomic.write_json(tmp / "optim" / OPTIM_JSON, {"param_groups": osd["param_groups"], "scalars": scalars, "devices": devices})
        atomic.write_json(tmp / STATE, {**state, "step": step})
        files = {}  # relative path -> tensors
        model_groups = _groups(weights, self.threads)
        for i, group in enumerate(model_groups):
            files[f"model/model-{i + 1:05d}-of-{len(model_groups):05d}.safetensors"] = group
        optim_groups = _groups(tensors, self.threads)
        for i, group in enumerate(optim_groups):
            files[f"optim/optim-{i + 1:05d}-of-{len(optim_groups):05d}.safetensors"] = group
        index = {"metadata": {"total_size": sum(t.nbytes for t in weights.values())},
                 "weight_map": {name: Path(f).name for f, group in files.items() if f.startswith("model/") for name, _ in group}}
        atomic.write_json(tmp / "model" / "model.safetensors.index.json", index)
        return files

    def _write(self, tmp: Path, files: dict) -> None:
        """The tensor files in parallel, then the manifest of every file in `tmp`; all fsynced."""
        order = sorted(files, key=lambda f: -sum(t.nbytes for _, t in files[f]))  # largest first
        with ThreadPoolExecutor(self.threads) as pool:
            written = dict(zip(order, pool.map(lambda f: _write_file(tmp / f, files[f]), order)))
        manifest = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name = str(path.relative_to(tmp))
            manifest[name] = written.get(name) or {"bytes": path.stat().st_size, "crc32": _crc_of_file(path)}
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
            raise CheckpointError(f"{self.path(step)} has no {MANIFEST}") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e})") from None
        for name, want in manifest.items():
            file = self.path(step) / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing")
            if file.stat().st_size != want["bytes"]:
                raise CheckpointError(f"{file} has {file.stat().st_size} bytes, its manifest says {want['bytes']} (truncated?)")
        return manifest

    def _small_file(self, step: int, name: str, manifest: dict) -> bytes:
        data = (self.path(step) / name).read_bytes()
        if zlib.crc32(data) != manifest[name]["crc32"]:
            raise CheckpointError(f"{self.path(step) / name} does not match its checksum")
        return data

    def load(self, step: int, model, optimizer=None) -> dict:
        """Load checkpoint `step` into `model` (and `optimizer`, and the torch RNG); return its state.

        Every file is read once and checked against its manifest entry; CheckpointError on any
        mismatch (the model and optimizer are then partly overwritten: load another checkpoint).
        """
        manifest = self._manifest(step)
        state = json.loads(self._small_file(step, STATE, manifest))
        for name in manifest:
            if not name.endswith(".safetensors"):
                self._small_file(step, name, manifest)  # config, processor, index, optim.json: small
        distributed = dist.is_initialized()  # rank 0 reads full tensors into host memory and broadcasts them
        model_targets = {} if distributed else {k: v.detach() for k, v in model_tensors(model).items()}
        meta = json.loads((self.path(step) / "optim" / OPTIM_JSON).read_text()) if optimizer is not None else {}
        params = dict(model.named_parameters())
        optim_tensors: dict[str, torch.Tensor] = {}
        read: set[str] = set()

        def target(name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
            read.add(name)
            if name.startswith(("state/", "rng/")):
                param = params.get(name.split("/")[1]) if name.startswith("state/") else None
                if name.startswith("state/") and param is None and not distributed:
                    raise CheckpointError(f"optimizer state {name} names no parameter of this model")
                on_param = meta["devices"].get(name) == "param" and param is not None and not distributed  # full state stays on the host
                optim_tensors[name] = torch.empty(shape, dtype=dtype, device=param.device if on_param else "cpu")
                return optim_tensors[name]
            if distributed:
                model_targets[name] = torch.empty(shape, dtype=dtype)
            if name not in model_targets:
                raise CheckpointError(f"{self.path(step)} holds {name}, which this model does not have")
            return model_targets[name]

        files = sorted((n for n in manifest if n.endswith(".safetensors")), key=lambda n: -manifest[n]["bytes"])
        files = [n for n in files if optimizer is not None or n.startswith("model/")] if _is_rank0() else []
        error = None
        try:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(lambda n: _read_file(self.path(step) / n, manifest[n], target), files))
            missing = set(model_targets) - read if not distributed else set()
            if missing:
                raise CheckpointError(f"{self.path(step)} lacks {len(missing)} model tensors, e.g. {sorted(missing)[:3]}")
            if distributed and _is_rank0():  # the full state dict names tied parameters under each name
                model_targets.update({alias: model_targets[name] for alias, name in tied_aliases(model).items()
                                      if name in model_targets})
        except CheckpointError as e:
            error = str(e)
        if distributed:  # rank 0 read the files: every rank refuses the checkpoint with it, or none does
            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            raise CheckpointError(error)
        if distributed:
            set_model_state_dict(model, model_targets, options=_options())
        if optimizer is not None:
            osd = {"state": {}, "param_groups": meta["param_groups"]}
            for name, tensor in optim_tensors.items():
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
        """Checkpoints to resume from, newest first: the tracker's and the older ones."""
        tracked = self.tracked()
        return [] if tracked is None else [s for s in self.steps() if s <= tracked][::-1]

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
            raise CheckpointError(f"no checkpoint in {self.root} is complete (tracker says step {self.tracked()})")
        return None

    def restore(self, model, optimizer, upto: int | None = None) -> tuple[int, dict]:
        """Load the newest checkpoint (at most `upto`) that loads intact; (step, state), (0, {}) if none."""
        tracked = self.tracked()
        for step in [s for s in self.candidates() if upto is None or s <= upto]:
            try:
                state = self.load(step, model, optimizer)
            except CheckpointError as e:
                log.error("refusing checkpoint %d: %s", step, e)
                continue
            if step != tracked:
                log.warning("resuming from checkpoint %d instead of the tracker's %d", step, tracked)
            return step, state
        if tracked is not None:
            raise CheckpointError(f"no checkpoint in {self.root} loads intact (tracker says step {tracked})")
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
                if step in keep_weights_of:
                    shutil.rmtree(folder / "optim", ignore_errors=True)
                    for name in (MANIFEST, STATE):
                        (folder / name).unlink(missing_ok=True)
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
