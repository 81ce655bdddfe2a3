"""The speed switches compute what the plain paths compute (tiny demo model, float32, CPU)."""

import contextlib
import copy
import weakref
from dataclasses import replace

import pytest
import torch

from conftest import make_experiment, own_keys_decode, text_attention, varlen_layout
from vlgrpo import models
from vlgrpo import attention
from vlgrpo.attention import PREFIX_ROWS_ATTENTION, PrefixRows, VarlenPrefixRows, prefix_rows_attention, whole_row_mask
from vlgrpo.batch import PromptBatch
from vlgrpo.data.prompts import encode_prompts, render_prompt
from vlgrpo.policy import (ForwardOptions, aligned_mlp, micro_batches, prefix_forward, prepare_model, prompt_runs,
                           response_logprobs, set_aligned_vision_mlp, set_fused_rms_norm, vision_index)
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.trainer import GRPOTrainer

FAST = ForwardOptions(prefix_sharing=True, logprobs_chunk_size=7)  # 7: chunks cross row boundaries
PACKED = replace(FAST, packed=True)  # a prompt and its responses in one row (the update under gradient checkpointing)


@pytest.fixture(scope="module")
def trainer(demo_base, tmp_path_factory):
    t = GRPOTrainer(make_experiment(demo_base, tmp_path_factory.mktemp("fast")))
    t.load(0)
    return t


def samples(trainer, n=3, count=3):
    """`count` prompts of different lengths, each repeated n times (as the trainer repeats them)."""
    rows = []
    for i, row in enumerate(trainer.rows[:count]):
        problem = row["problem"] + " Look closely." * (2 * i)
        rows.append({**row, "problem": problem, "prompt": render_prompt(trainer.processor, problem, "r1v")})
    batch = PromptBatch.from_processor(encode_prompts(trainer.processor, rows), [1] * count)
    assert len(set(batch.attention_mask.sum(-1).tolist())) == count
    return batch.repeat_interleave(n)


def rollout(trainer, prompts, temperature=1.0, max_tokens=20, engine=None):
    keys = torch.tensor([sample_key(1, 2, i) for i in range(len(prompts))])
    params = SamplingParams(temperature, 1.0, max_tokens)
    return (engine or trainer.engine).generate(prompts, keys, params, batch_size=len(prompts))


def test_prompt_runs_find_each_prompts_samples(trainer):
    prompts = samples(trainer, n=3)
    first, source = prompt_runs(prompts)
    assert first == [0, 3, 6]
    assert source.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # Two encoded prompts with the same text and image are two runs; a selection keeps its runs.
    row = trainer.rows[0]
    twins = PromptBatch.from_processor(encode_prompts(trainer.processor, [row, row]), [1, 1])
    assert torch.equal(twins.input_ids[0], twins.input_ids[1]) and prompt_runs(twins)[0] == [0, 1]
    assert prompt_runs(twins.repeat_interleave(2))[0] == [0, 2]
    assert prompt_runs(prompts.select([3, 4, 0, 1, 2]))[0] == [0, 2]


VARLEN = "varlen"  # the segment attention with the flash varlen layout (conftest.varlen_layout)


@pytest.mark.parametrize("options,attention_name", [(FAST, "sdpa"), (PACKED, "sdpa"), (PACKED, PREFIX_ROWS_ATTENTION), (PACKED, VARLEN)],
                         ids=["cache", "packed", "packed-segments", "packed-segments-varlen"])
def test_shared_prefix_chunked_logprobs_equal_plain(trainer, options, attention_name):
    layout = varlen_layout() if attention_name == VARLEN else contextlib.nullcontext()
    attention_name = PREFIX_ROWS_ATTENTION if attention_name == VARLEN else attention_name
    prompts = samples(trainer)
    out = rollout(trainer, prompts)
    assert out.response_mask.sum() > 50 and len(set(out.lengths.tolist())) > 1  # ragged responses
    with torch.no_grad():
        plain = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 0.7)
        with text_attention(trainer.policy, attention_name), layout:
            fast = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 0.7, options)
            # a micro-batch may hold part of a prompt's samples, and prompts with different numbers of them
            rows = [1, 2, 3, 4, 5, 6]
            part = response_logprobs(trainer.policy, prompts.select(rows), out.responses[rows], out.response_mask[rows], 0.7, options)
    mask = out.response_mask.bool()
    assert (fast - plain).abs().max() < 1e-5, (fast - plain).abs().max()
    assert (part - plain[rows]).abs().max() < 1e-5
    assert (fast[~mask] == 0).all()


# A checkpointed layer would write the prompt's cache twice: under checkpointing the update packs its rows,
# attended segment by segment (the attention prepare_model sets then) or under one 4-D mask.
@pytest.mark.parametrize("options,checkpointing,attention_name", [
    (FAST, False, "sdpa"), (PACKED, False, "sdpa"), (PACKED, True, "sdpa"), (PACKED, True, PREFIX_ROWS_ATTENTION), (PACKED, True, VARLEN)],
    ids=["cache", "packed", "packed-checkpointed", "packed-checkpointed-segments", "packed-checkpointed-segments-varlen"])
def test_shared_prefix_chunked_gradients_equal_plain(trainer, options, checkpointing, attention_name):
    layout = varlen_layout() if attention_name == VARLEN else contextlib.nullcontext()
    attention_name = PREFIX_ROWS_ATTENTION if attention_name == VARLEN else attention_name
    prompts = samples(trainer, n=2)
    out = rollout(trainer, prompts, max_tokens=12)
    weights = torch.linspace(-1, 1, out.responses.numel()).view_as(out.responses)
    grads = {}
    policy = trainer.policy
    policy.train()
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for name, opts in (("plain", ForwardOptions()), ("fast", options)):
        policy.zero_grad(set_to_none=True)
        with text_attention(policy, attention_name if name == "fast" else "sdpa"), \
                (layout if name == "fast" else contextlib.nullcontext()):
            logp = response_logprobs(policy, prompts, out.responses, out.response_mask, 1.0, opts)
            (logp * weights).sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    policy.gradient_checkpointing_disable()
    policy.eval()
    assert grads["plain"].keys() == grads["fast"].keys()
    assert any("visual" in n for n in grads["fast"])  # the image's gradient goes through the shared prefix
    for n, g in grads["plain"].items():  # float32 sums in another order: relative error far under 1e-4
        assert (grads["fast"][n] - g).norm() <= 1e-5 * g.norm() + 1e-8, (n, (grads["fast"][n] - g).norm() / g.norm())


def test_prefix_forward_with_host_indices_equals_the_models_forward(trainer):
    """Rope positions and vision indices computed on the CPU give the model's own forward."""
    prompts, model = samples(trainer, n=1), trainer.policy
    with torch.no_grad():
        own = model.model(**prompts.model_inputs(), use_cache=True)
        pre = prefix_forward(model, prompts, replace(prompts, pixel_values=None))
    assert torch.equal(pre.last_hidden, own.last_hidden_state[:, -1])
    assert torch.equal(pre.next_position, model.model.rope_deltas.view(-1) + prompts.attention_mask.sum(-1))
    cache = getattr(own, "cache", None) or own.past_key_values
    assert torch.equal(pre.cache.layers[-1].values, cache.layers[-1].values)
    grid = torch.tensor([[1, 12, 20], [1, 8, 8], [1, 18, 10]])  # ragged windows: the index helpers' edge cases
    vision = model.config.vision_config
    pixels = torch.randn(int(grid.prod(-1).sum()), vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    with torch.no_grad():
        expected = model.model.visual(pixels, grid_thw=grid).pooler_output
        given = model.model.visual(pixels, grid_thw=grid, **vision_index(model.model.visual, grid)).pooler_output
    assert torch.equal(given, expected)


def test_fused_rms_norm_gives_the_models_forward(trainer):
    model, prompts = copy.deepcopy(trainer.policy), samples(trainer, n=1)
    with torch.no_grad():
        own = model.model(**prompts.model_inputs()).last_hidden_state
        set_fused_rms_norm(model, True)
        assert sum("forward" in m.__dict__ for m in model.modules()) > 2 * len(model.model.language_model.layers)
        fused = model.model(**prompts.model_inputs()).last_hidden_state
        set_fused_rms_norm(model, False)
        assert torch.equal(model.model(**prompts.model_inputs()).last_hidden_state, own)
    assert (fused - own).abs().max() <= 1e-5 * own.abs().max()


def test_aligned_mlp_gives_the_mlps_output_and_gradients():
    """A vision MLP 44 wide (not a multiple of 8), with biases, as Qwen2.5-VL's 3,420."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    torch.manual_seed(0)
    mlp = Qwen2_5_VLMLP(Qwen2_5_VLVisionConfig(hidden_size=16, intermediate_size=44, hidden_act="silu"), bias=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grads = {}
    for name, fn in (("own", mlp.forward), ("aligned", lambda h: aligned_mlp(mlp, h))):
        mlp.zero_grad()
        x.grad = None
        y = fn(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        grads[name] = [y.detach(), x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    assert [g.shape for g in grads["aligned"]] == [g.shape for g in grads["own"]]
    for own, aligned in zip(grads["own"], grads["aligned"]):
        assert torch.allclose(aligned, own, rtol=1e-12, atol=1e-12)


def test_aligned_vision_mlp_binds_only_the_vision_towers_unaligned_mlps(trainer):
    model = copy.deepcopy(trainer.policy)
    for block in model.model.visual.blocks:  # the demo's vision MLP is 128 wide: aligned already
        assert block.mlp.gate_proj.out_features % 8 == 0
    set_aligned_vision_mlp(model, True)
    assert not any("forward" in m.__dict__ for m in model.model.visual.modules())
    block = model.model.visual.blocks[0]
    block.mlp.gate_proj.out_features -= 1  # as if 127 wide: bound, and unbound when switched off
    set_aligned_vision_mlp(model, True)
    assert block.mlp.forward.__func__ is aligned_mlp
    assert not any("forward" in m.__dict__ for m in model.model.language_model.modules())
    set_aligned_vision_mlp(model, False)
    assert "forward" not in block.mlp.__dict__


def test_packed_vision_attention_equals_per_window(trainer):
    """Windows of different sizes (ragged edges) and images of different sizes in one call."""
    model = copy.deepcopy(trainer.policy)
    grid = torch.tensor([[1, 12, 20], [1, 8, 8], [1, 18, 10]])  # patches; windows of 8x8 with partial edges
    vision = model.config.vision_config
    torch.manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    cfg = {"packed_vision_attention": False, "attn_implementation": "sdpa", "gradient_checkpointing": False, "fused_rms_norm": False,
           "aligned_vision_mlp": False, "fused_vision_rope": False, "cudnn_attention": True}
    with torch.no_grad():
        loop = torch.cat(model.model.get_image_features(pixels, grid).pooler_output)
        prepare_model(model, {**cfg, "packed_vision_attention": True}, torch.device("cpu"), trainable=False)
        packed = torch.cat(model.model.get_image_features(pixels, grid).pooler_output)
        with varlen_layout():  # as on CUDA in bf16: one flash varlen call (the reference kernel here)
            varlen = torch.cat(model.model.get_image_features(pixels, grid).pooler_output)
    assert loop.shape == packed.shape == (int(grid.prod(-1).sum()) // 4, model.config.text_config.hidden_size)
    assert (packed - loop).abs().max() < 1e-5 * loop.abs().max()
    assert (varlen - loop).abs().max() < 1e-5 * loop.abs().max()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("decode", ["masked", "own-keys"])
def test_static_engine_gives_the_hf_tokens(trainer, temperature, decode):
    """Greedy decoding and keyed sampling: the static-cache engine picks exactly the hf engine's tokens,
    its decode step attending the whole cache under a mask or each row's own keys (the decode attention
    kernel's layout, run by its PyTorch reference here)."""
    prompts = samples(trainer, n=2)
    with own_keys_decode() if decode == "own-keys" else contextlib.nullcontext():
        static = make_engine("static", trainer.policy, trainer.processor)
        fast = rollout(trainer, prompts, temperature, max_tokens=24, engine=static)
    assert static._decoder.own_keys == (decode == "own-keys")
    hf = rollout(trainer, prompts, temperature, max_tokens=24)
    assert torch.equal(fast.responses, hf.responses)
    assert torch.equal(fast.response_mask, hf.response_mask)
    assert fast.texts == hf.texts
    assert (fast.logp - hf.logp).abs().max() < 1e-5
    assert len(set(hf.lengths.tolist())) > 1 or temperature == 0  # EOS handled, not only full-length rows
    # ignore_eos: every response is max_tokens long, and EOS is never picked (as generate's min_new_tokens).
    keys, params = torch.arange(len(prompts)), SamplingParams(temperature, 1.0, 24, ignore_eos=True)
    with own_keys_decode() if decode == "own-keys" else contextlib.nullcontext():
        full = static.generate(prompts, keys, params, batch_size=len(prompts))
    assert full.lengths.tolist() == [24] * len(prompts)
    assert not torch.isin(full.responses, torch.tensor(static.eos_ids)).any()
    assert torch.equal(full.responses, trainer.engine.generate(prompts, keys, params, batch_size=len(prompts)).responses)


def test_the_static_decoder_stacks_the_qkv_weights_of_each_call(trainer, monkeypatch):
    """One GEMM for a layer's query, key and value projections gives the three modules' tokens, and
    follows weights changed in place between calls (the policy trains; the decoder is kept)."""
    from vlgrpo.rollout.static import _Decoder, _stacked_qkv_bytes

    prompts = samples(trainer, n=2)
    static = make_engine("static", trainer.policy, trainer.processor)
    loads = []
    load_weights = _Decoder.load_weights
    monkeypatch.setattr(_Decoder, "load_weights", lambda self: loads.append(self) or load_weights(self))
    stacked = rollout(trainer, prompts, 1.0, max_tokens=16, engine=static)
    assert static._decoder.qkv is not None and static._decoder.qkv[0][1] is not None  # Qwen2.5: with biases
    assert loads == [static._decoder]  # copied once a call
    # what the free-memory bound counts for a new decoder's stacked weights is what it allocates
    layers = models.text_model(trainer.policy).layers
    assert _stacked_qkv_bytes(layers) == sum(w.nbytes + b.nbytes for w, b in static._decoder.qkv) > 0
    with monkeypatch.context() as m:
        m.setattr("vlgrpo.rollout.static._stacked_qkv", lambda *a: None)
        modules = rollout(trainer, prompts, 1.0, max_tokens=16, engine=make_engine("static", trainer.policy, trainer.processor))
    assert torch.equal(stacked.responses, modules.responses) and (stacked.logp - modules.logp).abs().max() < 1e-5
    decoder, v_proj = static._decoder, models.text_model(trainer.policy).layers[0].self_attn.v_proj
    saved = v_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            v_proj.weight.mul_(-3.0)  # in place: the same address
        changed = rollout(trainer, prompts, 1.0, max_tokens=16, engine=static)
        assert static._decoder is decoder and loads.count(decoder) == 2  # (the other engine's decoder loaded once between)
        hf = rollout(trainer, prompts, 1.0, max_tokens=16)
        assert torch.equal(changed.responses, hf.responses) and (changed.logp - hf.logp).abs().max() < 1e-5
        assert not torch.allclose(changed.logp, stacked.logp)
    finally:
        with torch.no_grad():
            v_proj.weight.copy_(saved)


def test_the_static_engine_decodes_in_parts_when_the_cache_does_not_fit(trainer, monkeypatch, caplog):
    """Where the free memory cannot hold every row's static cache (a validation beside a segment's
    training state), the rows go through in equal parts, with the tokens they get at once."""
    prompts = samples(trainer, n=2)  # 6 rows
    static = make_engine("static", trainer.policy, trainer.processor)
    whole = rollout(trainer, prompts, 1.0, max_tokens=8, engine=static)
    calls = []
    generate = static._generate
    monkeypatch.setattr(static, "_generate", lambda sub, *a: calls.append(len(sub)) or generate(sub, *a))
    per_row = static._rows_that_fit(prompts.input_ids.shape[1], 8, own=False)
    assert per_row > 10**9  # the CPU: no bound
    monkeypatch.setattr("vlgrpo.rollout.static.free_bytes", lambda device: 0)
    with caplog.at_level("INFO", logger="vlgrpo.rollout.static"):
        parts = rollout(trainer, prompts, 1.0, max_tokens=8, engine=static)
    assert calls == [1] * 6 and "1 rows per call (6 rows' cache does not fit the free memory)" in caplog.text
    assert torch.equal(parts.responses, whole.responses) and (parts.logp - whole.logp).abs().max() < 1e-5


def test_the_free_memory_counts_the_allocators_unused_blocks_within_the_process_share(monkeypatch):
    """free_bytes: card free + reserved - allocated, bounded by the share set_per_process_memory_fraction
    gives the process (the allocator refuses beyond it)."""
    from vlgrpo.rollout.static import free_bytes

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * gib, 140 * gib), raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 50 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert free_bytes(torch.device("cuda")) == 50 * gib  # 40 free on the card + 10 cached
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5, raising=False)
    assert free_bytes(torch.device("cuda")) == 20 * gib  # a 70 GiB share, 50 allocated
    assert free_bytes(torch.device("cpu")) is None


def test_the_static_decoder_is_kept_while_the_weights_stay_in_place(trainer, monkeypatch):
    """A captured decode step reads weights by address: the engine keeps its decoder (and graph) across
    calls while they stay, and builds a new one when they move (the old one freed first)."""
    from vlgrpo.rollout.static import _Decoder

    prompts = samples(trainer, n=2)
    static = make_engine("static", trainer.policy, trainer.processor)
    first = rollout(trainer, prompts, 0.0, max_tokens=8, engine=static)
    decoder = static._decoder
    assert torch.equal(rollout(trainer, prompts, 0.0, max_tokens=8, engine=static).responses, first.responses)
    assert static._decoder is decoder
    head = trainer.policy.lm_head.weight
    saved = head.data
    old, alive = weakref.ref(decoder), []
    del decoder
    init = _Decoder.__init__
    monkeypatch.setattr(_Decoder, "__init__", lambda self, *a: alive.append(old() is not None) or init(self, *a))
    try:
        head.data = saved.clone()  # the same values at a new address
        moved = rollout(trainer, prompts, 0.0, max_tokens=8, engine=static)
        assert static._decoder is not old() and torch.equal(moved.responses, first.responses)
        assert alive == [False]  # the old decoder's cache was freed before the new one was made
    finally:
        head.data = saved


def test_a_decoder_with_its_own_weights_outlives_their_moves_and_serves_narrower_prompts(trainer, monkeypatch):
    """Where the model is sharded (FSDP2 gathers it afresh for each rollout, to new places), the decoder
    keeps its own copy of the weights its step reads: it is kept while they move and change, with the
    hf engine's tokens. Its step attending each row's own keys, it also serves prompts narrower than its
    cache: no new decoder (nor capture on a GPU) until a call's prompts outgrow it."""
    from vlgrpo.rollout.static import StaticEngine, _cache_width, _Decoder, _weight_bytes

    monkeypatch.setattr(StaticEngine, "own_weights", property(lambda self: True))  # as under FSDP2
    down = models.text_model(trainer.policy).layers[0].mlp.down_proj
    read, step = [], _Decoder.step
    monkeypatch.setattr(_Decoder, "step", lambda self: read.append(down.weight.data_ptr()) or step(self))
    wide_rows = [{**row, "problem": row["problem"] + " Look closely." * 60} for row in trainer.rows[:1]]
    wide_rows = [{**row, "prompt": render_prompt(trainer.processor, row["problem"], "r1v")} for row in wide_rows]
    wide = PromptBatch.from_processor(encode_prompts(trainer.processor, wide_rows), [1]).repeat_interleave(6)
    narrow = samples(trainer, n=2)  # 6 rows too
    policy = trainer.policy
    with own_keys_decode():
        static = make_engine("static", policy, trainer.processor)
        rollout(trainer, wide, 1.0, max_tokens=12, engine=static)
        decoder = static._decoder
        assert decoder.own and static.decoders == 1
        assert decoder.weight_bytes == _weight_bytes(policy, own=True) > _weight_bytes(policy, own=False)
        assert decoder.mask.shape[1] > _cache_width(narrow.input_ids.shape[1], 12)
        held = {id(p): p for p in policy.parameters()}
        saved = {name: p.data for name, p in policy.named_parameters()}
        try:
            with torch.no_grad():
                for p in policy.parameters():
                    p.data = p.data.clone()  # the same values at new places, as a new gathering
                down.weight.mul_(-3.0)  # and a weight the stacked q/k/v do not hold changed
            read.clear()
            moved = rollout(trainer, narrow, 1.0, max_tokens=12, engine=static)
            assert static._decoder is decoder and static.decoders == 1
            assert set(read) == {decoder.own[id(down.weight)].data_ptr()}  # the step read the decoder's copy
            # the modules hold the model's parameters again after the call
            assert all(id(p) in held for p in policy.parameters())
            hf = rollout(trainer, narrow, 1.0, max_tokens=12)
            assert torch.equal(moved.responses, hf.responses) and (moved.logp - hf.logp).abs().max() < 1e-5
        finally:
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    p.data = saved[name]
    unchanged = rollout(trainer, narrow, 1.0, max_tokens=12)
    assert not torch.allclose(unchanged.logp, moved.logp)  # the changed weight was read


def test_a_decoder_keeps_no_copy_of_the_weights_where_the_rows_do_not_fit_beside_it(trainer, monkeypatch, caplog):
    """The copy pays off across calls only: where a call's rows fit in one decoder without it and not
    with it (a validation's one call beside the training state), the decoder reads the weights in place."""
    from vlgrpo.rollout.static import StaticEngine

    prompts = samples(trainer, n=2)  # 6 rows
    monkeypatch.setattr("vlgrpo.rollout.static.free_bytes", lambda device: 10**10)
    static = make_engine("static", trainer.policy, trainer.processor)
    width = prompts.input_ids.shape[1]
    assert static._rows_that_fit(width, 8, own=True) < static._rows_that_fit(width, 8, own=False)  # the copy counted
    monkeypatch.setattr(StaticEngine, "own_weights", property(lambda self: True))  # as under FSDP2
    monkeypatch.setattr(StaticEngine, "_rows_that_fit", lambda self, width, max_tokens, own: 2 if own else 6)
    with caplog.at_level("INFO", logger="vlgrpo.rollout.static"):
        out = rollout(trainer, prompts, 1.0, max_tokens=8, engine=static)
    assert static._decoder.own == {} and static._decoder.mask.shape[0] == 6  # no copy, every row in one call
    assert "6 rows do not fit beside a copy of them" in caplog.text
    hf = rollout(trainer, prompts, 1.0, max_tokens=8)
    assert torch.equal(out.responses, hf.responses) and (out.logp - hf.logp).abs().max() < 1e-5


def test_a_decoder_makes_room_for_the_longest_prompt_to_come(trainer, monkeypatch):
    """Told the longest prompt later calls bring (the trainer's longest filtered prompt), a decoder whose
    step attends each row's own keys gets a cache that wide at once: a later call with that prompt runs on
    it (no new decoder, nor capture on a GPU), with the hf engine's tokens. Where the rows fit in one call
    only without the room, or where the step attends under a mask, the cache is the call's own width."""
    from vlgrpo.rollout.static import StaticEngine, _cache_width

    wide_rows = [{**row, "problem": row["problem"] + " Look closely." * 60} for row in trainer.rows[:1]]
    wide_rows = [{**row, "prompt": render_prompt(trainer.processor, row["problem"], "r1v")} for row in wide_rows]
    wide = PromptBatch.from_processor(encode_prompts(trainer.processor, wide_rows), [1]).repeat_interleave(6)
    narrow = samples(trainer, n=2)  # 6 rows too
    widest, own_width = wide.input_ids.shape[1], _cache_width(narrow.input_ids.shape[1], 12)
    assert _cache_width(widest, 12) > own_width
    with own_keys_decode():
        static = make_engine("static", trainer.policy, trainer.processor, widest_prompt=widest)
        rollout(trainer, narrow, 1.0, max_tokens=12, engine=static)
        assert static._decoder.mask.shape == (6, _cache_width(widest, 12))
        out = rollout(trainer, wide, 1.0, max_tokens=12, engine=static)
        assert static.decoders == 1
        hf = rollout(trainer, wide, 1.0, max_tokens=12)
        assert torch.equal(out.responses, hf.responses) and (out.logp - hf.logp).abs().max() < 1e-5
        monkeypatch.setattr(StaticEngine, "_rows_that_fit", lambda self, width, max_tokens, own: 6 if width < widest else 3)
        tight = make_engine("static", trainer.policy, trainer.processor, widest_prompt=widest)
        rollout(trainer, narrow, 1.0, max_tokens=12, engine=tight)
        assert tight._decoder.mask.shape == (6, own_width)  # every row in one call, without the room
    masked = make_engine("static", trainer.policy, trainer.processor, widest_prompt=widest)
    rollout(trainer, narrow, 1.0, max_tokens=12, engine=masked)  # on the CPU the step attends under a mask
    assert masked._decoder.mask.shape == (6, own_width)


def test_dynamic_micro_batches_respect_the_token_budget(trainer):
    prompts = samples(trainer, n=4, count=3)
    rows = list(range(len(prompts)))
    plen = prompts.attention_mask.sum(-1)
    assert micro_batches(prompts, torch.ones(12, 30), rows, 5, dynamic=False) == [rows[:5], rows[5:10], rows[10:]]
    size, width = 3, 30
    budget = size * (prompts.input_ids.shape[1] + width)
    for lengths in ([30, 5, 12, 7] * 3, [3, 2, 4, 1] * 3):
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        plan = micro_batches(prompts, mask, rows, size, dynamic=True)
        assert sorted(r for mb in plan for r in mb) == rows
        for mb in plan:
            assert len(mb) * (plen[mb].max() + mask[mb].sum(-1).max()) <= budget
    assert max(len(mb) for mb in plan) > size  # short rows: fuller than fixed micro-batches
    assert any({0, 1, 2, 3} <= set(mb) for mb in plan)  # a prompt's samples stay together when they fit


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_fast_step_equals_the_plain_step(demo_base, tmp_path, checkpointing):
    """One whole GRPO step with every switch on gives the plain step's metrics. With gradient
    checkpointing the update shares prompt prefixes in packed rows, attended segment by segment."""
    records = {}
    fast = {"model": {"packed_vision_attention": True, "gradient_checkpointing": checkpointing, "fused_rms_norm": True,
                      "aligned_vision_mlp": True},
            "worker": {"rollout": {"engine": "static"},
                       "actor": {"dynamic_batching": True, "prefix_sharing": True, "logprobs_chunk_size": 64,
                                 "micro_batch_size_per_device_for_update": 3,
                                 "micro_batch_size_per_device_for_experience": 5}}}
    for name, overrides in (("plain", {}), ("fast", fast)):
        cfg = make_experiment(demo_base, tmp_path / name, overrides)
        t = GRPOTrainer(cfg)
        t.load(0)
        records[name] = t.step(1)
    assert t.forward.prefix_sharing and not t.forward.packed
    assert t.engine.widest_prompt == max(row["prompt_length"] for row in t.rows) > 0  # the static engine makes room for it
    assert t.update_forward.prefix_sharing and t.update_forward.packed is checkpointing
    # the packed rows are attended segment by segment (prepare_model's attention for checkpointed SDPA)
    assert models.text_model(t.policy).config._attn_implementation == (PREFIX_ROWS_ATTENTION if checkpointing else "sdpa")
    assert models.text_model(t.ref).config._attn_implementation == "sdpa"
    for key in ("reward/overall", "response_length/mean", "actor/entropy_loss", "actor/pg_loss", "actor/kl_loss",
                "actor/ppo_kl", "actor/grad_norm"):
        assert records["fast"][key] == pytest.approx(records["plain"][key], rel=1e-4, abs=1e-6), key


def test_old_logprobs_from_the_update_equal_a_separate_pass(demo_base, tmp_path):
    """The first mini-batch's old log-probs taken from its own update forward: the same step."""
    records = {}
    for name, reuse in (("separate", False), ("from_update", True)):
        actor = {"global_batch_size": 4, "ppo_epochs": 2, "old_logprobs_from_update": reuse}  # 2 mini-batches, 2 epochs
        t = GRPOTrainer(make_experiment(demo_base, tmp_path / name, {"worker": {"actor": actor}}))
        t.load(0)
        records[name] = t.step(1)
    for key in ("actor/entropy_loss", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/grad_norm", "actor/pg_clipfrac_higher"):
        assert records["from_update"][key] == pytest.approx(records["separate"][key], rel=1e-4, abs=1e-6), key


def test_packed_prefix_with_eager_attention_equals_plain(demo_base, tmp_path):
    """The packed rows' 4-D mask as eager attention takes it (additive), under gradient checkpointing."""
    t = GRPOTrainer(make_experiment(demo_base, tmp_path, {"model": {"attn_implementation": "eager"}}))
    t.load(0)
    prompts = samples(t, n=2)
    out = rollout(t, prompts, max_tokens=10)
    t.policy.train()
    t.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = response_logprobs(t.policy, prompts, out.responses, out.response_mask, 1.0)
    packed = response_logprobs(t.policy, prompts, out.responses, out.response_mask, 1.0, PACKED)
    assert t.policy.model.language_model.config._attn_implementation == "eager"
    assert (packed - plain).abs().max() < 1e-5, (packed - plain).abs().max()


def test_prefix_rows_attention_equals_one_sdpa_call_under_the_whole_rows_mask():
    """Two packed rows [prompt | 3 response slots]: left-padded prompts, ragged responses, an empty slot;
    grouped keys/values (2 query heads per key head). The real queries' outputs equal SDPA over the whole
    row under its (L, L) mask."""
    U, k, P, R, heads, kv_heads, dim = 2, 3, 5, 4, 4, 2, 8
    prompt_keys = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    lengths = torch.tensor([[4, 2, 3], [1, 4, 0]])  # the second prompt's third slot is empty
    response_keys = torch.arange(R) < lengths[..., None]  # (U, k, R)
    torch.manual_seed(0)
    q, key, value = torch.randn(U, heads, P + k * R, dim), torch.randn(U, kv_heads, P + k * R, dim), torch.randn(U, kv_heads, P + k * R, dim)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    out, _ = prefix_rows_attention(module, q, key, value, scaling=dim**-0.5, prefix_rows=PrefixRows.of(prompt_keys, response_keys))
    real = torch.cat([prompt_keys, response_keys.flatten(1)], dim=1)  # (U, L)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), attn_mask=whole_row_mask(prompt_keys, response_keys),
        scale=dim**-0.5).transpose(1, 2)
    assert out.shape == (U, P + k * R, heads, dim)
    assert torch.allclose(out[real], expected[real], atol=1e-6)


def prefix_rows_case(device, dtype, U=3, k=4, P=37, R=29, heads=8, kv_heads=2, dim=64):
    """Packed rows with left-padded prompts, ragged responses and an empty slot: the two layouts and q, k, v."""
    device = torch.device(device)
    prompt_lengths = torch.tensor([P, 1, 20][:U])
    prompt_keys = torch.arange(P) >= (P - prompt_lengths)[:, None]  # (U, P)
    lengths = torch.randint(1, R + 1, (U, k), generator=torch.Generator().manual_seed(1))
    lengths[-1, -1] = 0  # an empty slot
    response_keys = torch.arange(R) < lengths[..., None]  # (U, k, R)
    L = P + k * R
    g = torch.Generator().manual_seed(0)
    q, key, value = (torch.randn(U, h, L, dim, generator=g).to(device, dtype).requires_grad_() for h in (heads, kv_heads, kv_heads))
    real = torch.cat([prompt_keys, response_keys.flatten(1)], dim=1).to(device)  # (U, L)
    masks = PrefixRows.of(prompt_keys.to(device), response_keys.to(device))
    return q, key, value, real, masks, VarlenPrefixRows.of(prompt_lengths, P, k, R, device)


def outputs_and_grads(q, key, value, rows, real):
    """The real queries' outputs and the gradients of a weighted sum of them."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = q.shape[1] // key.shape[1], True
    out, _ = prefix_rows_attention(module, q, key, value, scaling=q.shape[-1] ** -0.5, prefix_rows=rows)
    weights = torch.linspace(-1, 1, out[real].numel(), device=q.device).view_as(out[real])
    grads = torch.autograd.grad((out[real].float() * weights).sum(), (q, key, value))
    return out[real].float(), [g.float() for g in grads]


def test_varlen_prefix_rows_equal_the_masked_segments():
    """The flash varlen layout (run by the reference kernel here) gives the masked segments' outputs and
    gradients: places, bounds, grouped heads and the end-aligned causal window."""
    q, key, value, real, masks, varlen = prefix_rows_case("cpu", torch.float32)
    assert varlen.longest_prompt == 37 and varlen.prompt_bounds.tolist() == [0, 37, 38, 58]
    with varlen_layout():
        out, grads = outputs_and_grads(q, key, value, varlen, real)
    expected, expected_grads = outputs_and_grads(q, key, value, masks, real)
    assert torch.allclose(out, expected, atol=1e-5)
    for g, e in zip(grads, expected_grads):
        assert torch.allclose(g, e, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or attention.varlen_attn is None, reason="needs CUDA and torch's flash varlen (2.11+)")
def test_flash_varlen_prefix_rows_equal_the_masked_segments_on_cuda():
    """torch's flash varlen kernels (bf16) against SDPA under the segments' masks: outputs and gradients
    within bf16's rounding."""
    assert attention.flash_varlen_serves("cuda", torch.bfloat16)
    q, key, value, real, masks, varlen = prefix_rows_case("cuda", torch.bfloat16, dim=128)
    out, grads = outputs_and_grads(q, key, value, varlen, real)
    expected, expected_grads = outputs_and_grads(q, key, value, masks, real)
    assert (out - expected).abs().max() < 2e-2, (out - expected).abs().max()
    for g, e in zip(grads, expected_grads):
        assert (g - e).norm() <= 2e-2 * e.norm(), (g - e).norm() / e.norm()


@pytest.mark.skipif(not torch.cuda.is_available() or attention.varlen_attn is None, reason="needs CUDA and torch's flash varlen (2.11+)")
def test_flash_varlen_packed_vision_attention_equals_padded_sdpa_on_cuda(monkeypatch):
    """The vision tower's packed segments (windows and whole images, head dim 80 as Qwen2.5-VL's) in one
    flash varlen call against SDPA over the segments padded: outputs and gradients within bf16's rounding."""
    lengths = torch.tensor([64, 64, 30, 200, 7])
    bounds = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int().cuda()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, int(lengths.sum()), 80, generator=g).cuda().bfloat16().requires_grad_() for _ in range(3))
    weights = torch.randn(1, int(lengths.sum()), 16, 80, generator=g).cuda()
    results = []
    for flash in (True, False):
        monkeypatch.setattr(attention, "flash_varlen_serves", lambda device_type, dtype: flash)
        out, _ = attention.packed_attention(None, q, k, v, scaling=80**-0.5, cu_seq_lens_q=bounds, max_length_q=int(lengths.max()))
        results.append((out.float(), torch.autograd.grad((out.float() * weights).sum(), (q, k, v))))
    (out, grads), (expected, expected_grads) = results
    assert (out - expected).abs().max() < 2e-2, (out - expected).abs().max()
    for g_, e in zip(grads, expected_grads):
        assert (g_.float() - e.float()).norm() <= 2e-2 * e.float().norm()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_decoder_with_its_own_weights_replays_after_they_move_on_cuda(trainer, monkeypatch):
    """On the card, in bf16: the decoder with its own copy of the weights captures its step once and
    replays it after every parameter moved (as a new FSDP2 gathering places them), with the tokens and
    log-probs of a decoder captured over the model's weights where they are."""
    from vlgrpo.rollout.static import StaticEngine

    model = copy.deepcopy(trainer.policy).to("cuda", torch.bfloat16)
    prompts = samples(trainer, n=2)
    keys, params = torch.arange(len(prompts)), SamplingParams(1.0, 1.0, 24, ignore_eos=True)
    expected = make_engine("static", model, trainer.processor).generate(prompts, keys, params, batch_size=len(prompts))
    monkeypatch.setattr(StaticEngine, "own_weights", property(lambda self: True))
    own = make_engine("static", model, trainer.processor)
    first = own.generate(prompts, keys, params, batch_size=len(prompts))
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    again = own.generate(prompts, keys, params, batch_size=len(prompts))
    assert own.captures == own.decoders == 1
    for out in (first, again):
        assert torch.equal(out.responses, expected.responses) and torch.equal(out.logp, expected.logp)
