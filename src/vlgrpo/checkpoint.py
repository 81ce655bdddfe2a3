"""The checkpoint store: resumable training state that Snakemake does not manage.

Layout under results/<experiment>/checkpoints/:
    global_step_000005/model/        Hugging Face weights + config + processor (from_pretrained-able)
    global_step_000005/optimizer.pt  optimizer state
    global_step_000005/state.json    step, config hash, RNG states, data position, W&B run id
    global_step_000005/manifest.json size and sha256 of every file above
    latest.json                      the tracker: which checkpoint is the latest

A checkpoint is written into a temporary folder, fsynced, renamed by rank 0 (after a barrier when
distributed), and only then is the tracker replaced atomically. So a process killed at any moment
leaves the previous checkpoint and tracker intact. Resume reads only the tracker; a checkpoint whose
manifest does not verify is refused with a message and the previous verified one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from vlgrpo import paths, plan
from vlgrpo.config import experiment_dir
from vlgrpo.errors import VlgrpoError

log = logging.getLogger(__name__)
TRACKER = "latest.json"


def step_dir_name(step: int) -> str:
    return f"global_step_{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary name, fsync, rename over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class CheckpointError(VlgrpoError, RuntimeError):
    pass


class CheckpointStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def model_dir(self, step: int) -> Path:
        return self.path(step) / "model"

    # --- writing -------------------------------------------------------------------------
    def save(self, step: int, model, processor, optimizer, state: dict) -> Path:
        """Write checkpoint `step` and point the tracker at it; return its folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp / "model", safe_serialization=True)
            processor.save_pretrained(tmp / "model")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            _fsync_tree(tmp)
        if dist.is_initialized():
            dist.barrier()
        final = self.path(step)
        if _is_rank0():
            shutil.rmtree(final, ignore_errors=True)  # a half-verified leftover of an earlier try
            os.rename(tmp, final)
            write_json_atomic(self.root / TRACKER, {"step": step, "path": final.name})
        if dist.is_initialized():
            dist.barrier()
        return final

    # --- reading -------------------------------------------------------------------------
    def verify(self, step: int) -> str | None:
        """None if checkpoint `step` is complete and intact, else what is wrong with it."""
        folder = self.path(step)
        manifest_path = folder / "manifest.json"
        if not manifest_path.is_file():
            return f"{folder} has no manifest.json"
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            return f"{manifest_path} is not valid JSON ({e})"
        for name, want in manifest.items():
            path = folder / name
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != want["bytes"] or _sha256(path) != want["sha256"]:
                return f"{path} does not match its checksum"
        return None

    def steps(self) -> list[int]:
        """Steps of all finished checkpoint folders, oldest first (verified or not)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name.rsplit("_", 1)[1]) for p in self.root.glob("global_step_*") if p.is_dir())

    def latest(self) -> int | None:
        """The step to resume from: the tracker's checkpoint, or the newest earlier one that verifies."""
        tracker = self.root / TRACKER
        if not tracker.is_file():
            return None
        try:
            tracked = int(json.loads(tracker.read_text())["step"])
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint tracker {tracker} is unreadable ({e}); delete it to start over")
        for step in [s for s in self.steps() if s <= tracked][::-1]:
            problem = self.verify(step)
            if problem is None:
                if step != tracked:
                    log.warning("resuming from checkpoint %d instead of the tracker's %d", step, tracked)
                return step
            log.error("refusing checkpoint %d: %s", step, problem)
        raise CheckpointError(f"no checkpoint in {self.root} verifies (tracker says step {tracked})")

    def state(self, step: int) -> dict:
        return json.loads((self.path(step) / "state.json").read_text())

    def load_optimizer(self, step: int, optimizer) -> None:
        optimizer.load_state_dict(torch.load(self.path(step) / "optimizer.pt", weights_only=True))
        torch.set_rng_state(torch.load(self.path(step) / "rng.pt", weights_only=True)["torch"])

    # --- retention -----------------------------------------------------------------------
    def prune(self, keep: int, keep_weights_of: set[int]) -> None:
        """Keep the newest `keep` checkpoints whole; of older ones keep only the model folder of the
        steps in `keep_weights_of` (validations still to run, or kept by config)."""
        steps = self.steps()
        for step in steps[: max(0, len(steps) - keep)]:
            folder = self.path(step)
            if step in keep_weights_of:
                for name in ("optimizer.pt", "rng.pt", "manifest.json"):
                    (folder / name).unlink(missing_ok=True)
            else:
                shutil.rmtree(folder, ignore_errors=True)


def apply_retention(cfg: dict, total_steps: int) -> None:
    """trainer.keep_checkpoints newest checkpoints stay whole; older ones keep their weights only while
    their validation is pending (or for good with trainer.keep_validated_weights)."""
    exp = experiment_dir(cfg)
    validated = plan.validation_steps(cfg, total_steps)
    keep = set(validated)
    if not cfg["trainer"]["keep_validated_weights"]:
        keep = {s for s in validated if not paths.path(paths.VAL, exp, step=s).exists()}
    CheckpointStore(paths.path(paths.CHECKPOINTS, exp)).prune(cfg["trainer"]["keep_checkpoints"], keep)
