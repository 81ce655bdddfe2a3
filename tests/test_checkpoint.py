"""The checkpoint store on small modules: exact round trip of weights, optimizer state (also extra
per-parameter tensors) and RNG; truncated or corrupted checkpoints refused at load, the previous used."""

import json
import threading

import pytest
import torch

from vlgrpo.checkpoint import CheckpointError, CheckpointStore


class KahanAdamW(torch.optim.AdamW):
    """AdamW with an extra bf16 tensor per parameter in its state (as a compensated optimizer keeps)."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["compensation"] = state.get("compensation", torch.zeros_like(p, dtype=torch.bfloat16)) + 0.5
        return loss


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    model[3].weight = model[0].weight  # tied, as Qwen2.5-VL-3B's lm_head
    return model, KahanAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))


def train(model, optimizer, steps):
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 8))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def snapshot(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in optimizer.state_dict()["state"].items()},
            torch.get_rng_state())


def assert_same(a, b):
    (wa, sa, ra), (wb, sb, rb) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for n in sa[k]:
            assert torch.equal(sa[k][n], sb[k][n]) if torch.is_tensor(sa[k][n]) else sa[k][n] == sb[k][n], (k, n)
    assert torch.equal(ra, rb)


@pytest.fixture
def store_with_two(tmp_path):
    """Checkpoints 5 and 10 of one run, and the snapshots they hold."""
    store = CheckpointStore(tmp_path / "checkpoints", threads=3)
    model, optimizer = model_and_optimizer()
    snaps = {}
    for step in (5, 10):
        train(model, optimizer, 5)
        store.save(step, model, optimizer, None, {"config_hash": "x"})
        snaps[step] = snapshot(model, optimizer)
    return store, snaps


def restored(store):
    model, optimizer = model_and_optimizer(seed=1)  # other weights: all must come from the checkpoint
    step, state = store.restore(model, optimizer)
    return step, state, model, optimizer


def test_round_trip_is_exact_and_training_continues_identically(store_with_two):
    store, snaps = store_with_two
    step, state, model, optimizer = restored(store)
    assert step == 10 and state == {"config_hash": "x", "step": 10}
    assert_same(snapshot(model, optimizer), snaps[10])
    assert model[3].weight is model[0].weight  # the tie survives
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    files = json.loads((store.path(10) / "manifest.json").read_text())
    assert len([f for f in files if f.startswith("optim/optim-")]) == 3  # one file per writer thread
    # The same next steps from the checkpoint as from the live objects.
    live_model, live_opt = model_and_optimizer()
    CheckpointStore(store.root).load(10, live_model, live_opt)
    train(model, optimizer, 2)
    torch.set_rng_state(snaps[10][2])
    train(live_model, live_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), live_model.state_dict().values()))


def largest_file(store, step):
    return max((p for p in store.path(step).rglob("*.safetensors")), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_refused_and_the_previous_used(store_with_two, damage, caplog):
    store, snaps = store_with_two
    path = largest_file(store, 10)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) * 2 // 3] ^= 0x01  # one bit of one tensor
        path.write_bytes(bytes(data))
    assert store.verify(10) is not None and store.verify(5) is None
    step, _, model, optimizer = restored(store)
    assert step == 5
    assert_same(snapshot(model, optimizer), snaps[5])
    reason = "truncated" if damage == "truncate" else "does not match its checksum"
    assert any(reason in r.getMessage() and "refusing checkpoint 10" in r.getMessage() for r in caplog.records)
    assert store.latest() == 5  # refused at load: set aside, no longer resumed from


def test_sizes_are_checked_cheaply_bytes_at_load(store_with_two):
    store, _ = store_with_two
    path = largest_file(store, 10)
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.latest() == 10
    path.write_bytes(bytes(data[:-1]))
    assert store.latest() == 5


def test_without_a_tracker_the_newest_intact_checkpoint_is_resumed(store_with_two, caplog):
    """Issue 28 (5): a lost latest.json does not restart training from step 0."""
    store, snaps = store_with_two
    (store.root / "latest.json").unlink()
    assert store.latest() == 10
    step, _, model, optimizer = restored(store)
    assert step == 10
    assert_same(snapshot(model, optimizer), snaps[10])
    assert any("no tracker" in r.getMessage() for r in caplog.records)
    flip(largest_file(store, 10))
    assert restored(store)[0] == 5


def test_weights_kept_for_validation_are_not_resumed_from_nor_set_aside(store_with_two):
    store, _ = store_with_two
    store.prune(1, keep_weights_of={5})
    (store.root / "latest.json").unlink()
    flip(largest_file(store, 10))
    with pytest.raises(CheckpointError, match="no checkpoint .* loads intact|delete"):
        restored(store)  # 10 was set aside; 5 holds only weights: nothing to resume from, said, not step 0
    assert (store.model_dir(5) / "config.json").exists() or any(store.model_dir(5).glob("*.safetensors"))
    assert store.steps() == [5]


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # one bit of one tensor
    path.write_bytes(bytes(data))


def test_a_corrupt_checkpoint_is_set_aside_said_on_the_console_and_not_kept(store_with_two, monkeypatch):
    """Issue 28 (6): a refused checkpoint leaves the store (named, with its reason) and counts no more
    toward keep_checkpoints, so a second corruption still finds an intact one; the console hears it."""
    import os

    store, snaps = store_with_two
    model, optimizer = model_and_optimizer()
    store.load(10, model, optimizer)
    train(model, optimizer, 5)
    store.save(15, model, optimizer, None, {"config_hash": "x"})
    read, write = os.pipe()
    monkeypatch.setenv("VLGRPO_CONSOLE_FD", str(write))
    flip(largest_file(store, 15))
    assert restored(store)[0] == 10
    aside = store.root / "refused" / "global_step_000015"
    assert aside.is_dir() and "does not match its checksum" in (store.root / "refused" / "global_step_000015.reason.txt").read_text()
    store.prune(2, keep_weights_of=set())
    assert store.steps() == [5, 10]  # the corrupt one is not counted: the two intact ones stay
    flip(largest_file(store, 10))
    step, _, model, optimizer = restored(store)
    assert step == 5
    assert_same(snapshot(model, optimizer), snaps[5])
    assert (store.root / "refused" / "global_step_000010").is_dir()
    os.close(write)
    console = os.read(read, 1 << 16).decode()
    os.close(read)
    assert "refusing checkpoint 15" in console and "set aside as" in console and str(aside) in console
    assert "resuming from checkpoint 5 instead of the tracker's 15" in console


def test_no_intact_checkpoint_is_an_error(store_with_two):
    store, _ = store_with_two
    for step in (5, 10):
        path = largest_file(store, step)
        path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(CheckpointError, match="no checkpoint .* loads intact"):
        restored(store)


def test_a_checkpoint_of_another_model_is_refused(store_with_two):
    store, _ = store_with_two
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8))
    with pytest.raises(CheckpointError, match="the model has|does not have|names no parameter"):
        store.load(10, model, torch.optim.AdamW(model.parameters()))


def test_a_save_behind_publishes_only_when_written_and_a_failure_keeps_the_previous(store_with_two):
    store, snaps = store_with_two
    model, optimizer = model_and_optimizer()
    step, _ = store.restore(model, optimizer)
    train(model, optimizer, 5)
    expected = snapshot(model, optimizer)
    release = threading.Event()
    saving = store.save_behind(15, model, optimizer, None, {"config_hash": "x"}, before_publish=lambda: release.wait(30))
    assert store.latest() == 10  # the caller goes on while the files are written
    release.set()
    assert saving.result() == store.path(15) and saving.seconds > 0
    assert store.latest() == 15
    assert_same(snapshot(*restored(store)[2:]), expected)

    def fail():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.save_behind(20, model, optimizer, None, {"config_hash": "x"}, before_publish=fail).result()
    assert store.latest() == 15 and not store.path(20).exists()


def test_checksums_of_pieces_combine_into_the_files_and_cover_it_once():
    """Under FSDP2 each rank checksums the bytes it wrote; their CRC-32s combine into the whole file's
    (zlib's crc32_combine), and a byte written by no rank or by two is an error."""
    import random
    import zlib
    from pathlib import Path

    from vlgrpo.checkpoint import _check_ranges, crc32_combine

    rng = random.Random(0)
    data = rng.randbytes(100_003)
    for _ in range(20):
        cut = sorted(rng.sample(range(1, len(data)), 5))
        pieces = list(zip([0, *cut], [*cut, len(data)]))
        rng.shuffle(pieces)  # ranks report in any order
        ranges = [(a, b - a, zlib.crc32(data[a:b])) for a, b in pieces]
        assert _check_ranges(Path("f"), ranges, len(data)) == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(b"abc"), zlib.crc32(b""), 0) == zlib.crc32(b"abc")
    assert crc32_combine(0, zlib.crc32(b"xyz"), 3) == zlib.crc32(b"xyz")
    whole = [(0, 10, zlib.crc32(data[:10])), (10, 10, zlib.crc32(data[10:20]))]
    with pytest.raises(CheckpointError, match="bytes 10..12 were handled by no process"):
        _check_ranges(Path("f"), [whole[0], (12, 8, 0)], 20)
    with pytest.raises(CheckpointError, match="bytes 8..10 were handled twice"):
        _check_ranges(Path("f"), [whole[0], (8, 12, 0)], 20)
    with pytest.raises(CheckpointError, match="20 of its 30 bytes"):
        _check_ranges(Path("f"), whole, 30)


def test_tensor_files_are_laid_out_alike_whatever_the_state_order():
    """A resumed optimizer holds its state in load order, a straight one in step order: equal-sized
    tensors must land in the same files either way (the resume tests compare files tensor by tensor)."""
    from vlgrpo.checkpoint import _groups

    tensors = {f"state/p{i}/exp_avg": torch.zeros(4) for i in range(6)} | {"state/big/exp_avg": torch.zeros(16)}
    reordered = dict(reversed(list(tensors.items())))
    layout = [[n for n, _ in g] for g in _groups(tensors, 3)]
    assert layout == [[n for n, _ in g] for g in _groups(reordered, 3)]
    assert sorted(n for g in layout for n in g) == sorted(tensors)
