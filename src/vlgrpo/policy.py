"""Loading the policy and computing log-probs of responses the way training does.

The log-prob forward runs the model's own forward over prompt + response with the prompt's
attention mask, image and video inputs and mm_token_type_ids (zeros over the response), so Qwen2.5-VL computes
the same 3-D rope positions that generation used, and divides the logits by the sampling temperature
as EasyR1/verl do.

Speed switches (ForwardOptions, all off by default and none changes the result beyond rounding):
- prefix sharing: the n samples of a prompt share one forward over the prompt (images and videos included);
  their responses attend to its cached keys/values at the positions the full forward gives them; or,
  packed (the update under gradient checkpointing, which cannot recompute a layer that writes a cache),
  the prompt and its responses form one row under a 4-D mask that lets each response see the prompt
  and its own earlier tokens;
- chunked log-probs: the LM head and log-softmax run over `logprobs_chunk_size` positions at a time
  and are recomputed in backward, so float32 full-vocabulary logits never exist for a micro-batch;
- packed vision attention (set on the model by prepare_model): the vision tower's windows and images
  go through one batched attention call instead of one call each;
- fused RMSNorm (set by prepare_model): each RMSNorm module one F.rms_norm call (bf16 rounding apart);
- dynamic batching (micro_batches): micro-batches sized by a padded-token budget.
The prefix forward (prefix sharing, the static engine's prefill) takes Qwen2.5-VL's rope positions
and vision indices computed on the CPU (multimodal_index): the same values, no host reads on the GPU.
A text-only model (models.Family.vision false) gets 1-D rope positions from each row's first real
token in every forward (models.text_positions), as EasyR1 and transformers' generate give them.
"""

from __future__ import annotations

import inspect
import logging
import os
import types
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from vlgrpo import attention, distributed, lora, models, vision_rope
from vlgrpo.attention import PACKED_VISION_ATTENTION, PREFIX_ROWS_ATTENTION, PrefixRows, VarlenPrefixRows, whole_row_mask
from vlgrpo.batch import PromptBatch, to_device
from vlgrpo.config import NO_CUDA, ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(NO_CUDA)
    return torch.device(name)


def load_pretrained(path: str | os.PathLike, model_cfg: dict, device: torch.device):
    """A model of a supported family (models.FAMILIES) from a hub id or folder (also a checkpoint's
    model/ folder), its weights read straight onto `device`; not yet prepared (prepare_model)."""
    return models.model_class(models.family_of(path)).from_pretrained(
        str(path),
        dtype=DTYPES[model_cfg["dtype"]],
        attn_implementation=model_cfg["attn_implementation"],
        trust_remote_code=model_cfg["trust_remote_code"],
        device_map=device if device.type == "cuda" else None,
    )


def load_model(path: str | os.PathLike, model_cfg: dict, device: torch.device, trainable: bool):
    """load_pretrained, then prepare_model."""
    return prepare_model(load_pretrained(path, model_cfg, device), model_cfg, device, trainable)


def fused_rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm module `norm` (weight, variance_epsilon) applied to x as one F.rms_norm call
    (float32 inside, one rounding); also its forward when set_fused_rms_norm binds it."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def set_fused_rms_norm(model, fused: bool) -> None:
    """Run every RMSNorm module of `model` (weight, variance_epsilon) fused, or as the model defines it.

    The model's RMSNorm is ~8 kernels forward and more backward, run ~210 times in a prefix-shared
    micro-batch; the fused call is one or two.
    """
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            if fused:
                module.forward = types.MethodType(fused_rms_norm, module)
            else:
                module.__dict__.pop("forward", None)


def aligned_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP (gate_proj, up_proj, down_proj, act_fn) with its intermediate size padded with zeros
    to a multiple of 8 at compute time; also its forward when set_aligned_vision_mlp binds it.

    Qwen2.5-VL's vision MLP is 3,420 wide: rows of 6,840 bytes, not a multiple of 16, which keeps
    cuBLAS off Hopper's TMA kernels (measured on an H200 at 95k patches: 3.2 / 3.7 ms a GEMM at 3,420,
    1.1 / 1.1 ms at 3,424). The padded units are act(0) * 0 = 0 and meet zero columns of down_proj, so
    the output is the MLP's; the parameters keep their shapes (checkpoints unchanged) and their
    gradients come back through the padding. gate and up run as one GEMM.
    """
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    pad = -gate.out_features % 8
    weight = torch.cat([F.pad(gate.weight, (0, 0, 0, pad)), F.pad(up.weight, (0, 0, 0, pad))])  # (2 I', H)
    bias = None if gate.bias is None else torch.cat([F.pad(gate.bias, (0, pad)), F.pad(up.bias, (0, pad))])
    g, u = F.linear(x, weight, bias).chunk(2, dim=-1)  # (..., I') each
    return F.linear(mlp.act_fn(g) * u, F.pad(down.weight, (0, pad)), down.bias)


def set_aligned_vision_mlp(model, aligned: bool) -> None:
    """Run the vision tower's gated MLPs through aligned_mlp where their width is not a multiple of 8
    (Qwen2.5-VL's; other towers have none, and a text-only model no tower)."""
    tower = models.vision_tower(model)
    for module in tower.modules() if tower is not None else ():
        if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            if aligned and module.gate_proj.out_features % 8:
                module.forward = types.MethodType(aligned_mlp, module)
            else:
                module.__dict__.pop("forward", None)


def set_fused_vision_rope(model, fused: bool) -> None:
    """Run the vision tower's attention modules (qkv, proj, num_heads) through
    vision_rope.fused_rope_attention, which rotates q and k in one Triton kernel, where the kernel serves
    the tower's device and dtype (it says once why where it does not); else as the model defines them."""
    tower = models.vision_tower(model)
    if tower is None:
        return
    param = next(tower.parameters())
    serves = fused and vision_rope.serves(param.device.type, param.dtype)
    for module in tower.modules():
        if type(module).__name__.endswith("VisionAttention") and all(hasattr(module, n) for n in ("qkv", "proj", "num_heads")):
            if serves:
                module.forward = types.MethodType(vision_rope.fused_rope_attention, module)
            else:
                module.__dict__.pop("forward", None)


def prepare_model(model, model_cfg: dict, device: torch.device, trainable: bool):
    """Move to `device` in eval mode and apply the model settings (also to an in-memory model).

    model_cfg: the `model` group of config.for_device(cfg, device), its `auto` switches resolved."""
    if "auto" in model_cfg.values():
        raise ConfigError("model settings with 'auto' switches: resolve them with config.for_device first")
    model = model.to(device)
    model.eval()
    family, tower = models.family_of_model(model), models.vision_tower(model)
    if model_cfg["packed_vision_attention"] and not family.serves("model.packed_vision_attention"):
        raise ConfigError(f"'model.packed_vision_attention' is true, which {family.title} cannot run: "
                          f"{family.cannot['model.packed_vision_attention']}")
    if tower is not None:
        packed = model_cfg["packed_vision_attention"]
        tower.config._attn_implementation = PACKED_VISION_ATTENTION if packed else model_cfg["attn_implementation"]
    # The update's packed prefix rows (prefix sharing under checkpointing) are attended segment by segment.
    packed_rows = trainable and model_cfg["gradient_checkpointing"] and model_cfg["attn_implementation"] == "sdpa"
    models.text_model(model).config._attn_implementation = PREFIX_ROWS_ATTENTION if packed_rows else model_cfg["attn_implementation"]
    set_fused_rms_norm(model, model_cfg["fused_rms_norm"])
    set_aligned_vision_mlp(model, model_cfg["aligned_vision_mlp"])
    set_fused_vision_rope(model, model_cfg["fused_vision_rope"])
    if device.type == "cuda":  # process-wide (a torch switch); the static engine's captured decode step keeps cuDNN
        torch.backends.cuda.enable_cudnn_sdp(model_cfg["cudnn_attention"])
    if trainable:
        if model_cfg["gradient_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        else:
            model.gradient_checkpointing_disable()
        if lora.has_adapters(model):  # only the adapters train (worker.actor.model.lora)
            lora.set_trainable(model, model_cfg["freeze_vision_tower"])
        elif tower is not None:
            tower.requires_grad_(not model_cfg["freeze_vision_tower"])
    else:
        model.requires_grad_(False)
    return model


def is_model_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "config.json").is_file()


@dataclass(frozen=True)
class ForwardOptions:
    prefix_sharing: bool = False
    logprobs_chunk_size: int = 0
    packed: bool = False  # prefix sharing without a cache: a prompt and its responses in one row

    @classmethod
    def from_config(cls, cfg: dict, update: bool = False) -> "ForwardOptions":
        """The switches of the no-grad log-prob passes (old, ref), or with `update` of the actor update.
        Under gradient checkpointing the update shares prefixes packed: a checkpointed layer would write
        its keys/values into the prompt's cache a second time when backward recomputes it. The packed
        rows need a 4-D attention mask, which flash_attention_2 does not take: then it shares none."""
        actor, model = cfg["worker"]["actor"], cfg["model"]
        packed = update and model["gradient_checkpointing"]
        sharing = actor["prefix_sharing"]
        if sharing and packed and model["attn_implementation"] == "flash_attention_2":
            log.info("worker.actor.prefix_sharing: off in the update (gradient checkpointing needs packed rows, "
                     "whose 4-D attention mask flash_attention_2 does not take)")
            sharing = False
        return cls(sharing, actor["logprobs_chunk_size"], packed and sharing)


def prompt_runs(prompts: PromptBatch) -> tuple[list[int], torch.Tensor]:
    """Runs of consecutive rows that are copies of one encoded prompt (the n samples of a prompt).

    Read from prompt_ids on the host: no comparison of pixel values (which may live on the GPU).
    Returns the first row of each run (U) and each row's run index, (N,) long.
    """
    ids = prompts.prompt_ids.tolist()
    first, source = [], []
    for r in range(len(ids)):
        if r == 0 or ids[r] != ids[r - 1]:
            first.append(r)
        source.append(len(first) - 1)
    return first, torch.tensor(source, dtype=torch.long)


@dataclass
class Prefix:
    """The forward over U distinct prompts, for their samples to continue from."""

    last_hidden: torch.Tensor  # (U, H) final hidden state at the last prompt position
    cache: DynamicCache  # keys/values per layer, (U, kv_heads, P, D)
    next_position: torch.Tensor  # (U,) rope position of the first response token
    attention_mask: torch.Tensor  # (U, P)


def _cache_kwarg(module) -> str:
    """The name a forward takes its KV cache by: `cache` (transformers 5.24) or `past_key_values` (5.17)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def vision_index(vision, grid: torch.Tensor) -> dict:
    """The vision tower's precomputed keyword arguments for images of `grid` (num images, 3), on the CPU:
    rotary positions, full and window attention bounds with their longest segments, window order."""
    cu_seqlens = get_vision_cu_seqlens(grid)
    window_index, cu_window_seqlens = get_vision_window_index(grid, vision.spatial_merge_size, vision.window_size, vision.patch_size)
    return {
        "position_ids": get_vision_position_ids(grid, vision.spatial_merge_size),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        "window_index": window_index,
        "cu_window_seqlens": cu_window_seqlens,
        "max_window_seqlen": int((cu_window_seqlens[1:] - cu_window_seqlens[:-1]).max()),
    }


def multimodal_index(model, host: PromptBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """What a vision-language forward derives from token ids and image grids, computed on the CPU.

    The model's own get_rope_index and the vision tower's index helpers loop over rows and images
    with a host read each; on the GPU every read waits for the queue to drain. host: the batch on
    the CPU (pixel values not needed). Returns, on `device` (copies queued without waiting):
    3-D rope position_ids (3, N, P), rope_deltas (N,) and the vision tower's keyword arguments
    (Qwen2.5-VL's windowed tower, the videos' under "video"; {} for the other families, whose towers
    index themselves).
    """
    positions, deltas = model.model.get_rope_index(
        host.input_ids, mm_token_type_ids=host.mm_token_type_ids, image_grid_thw=host.image_grid_thw,
        video_grid_thw=host.video_grid_thw, second_per_grid_ts=host.second_per_grid_ts, attention_mask=host.attention_mask,
    )
    def index(grid):
        return {k: to_device(v, device) if torch.is_tensor(v) else v for k, v in vision_index(model.model.visual, grid).items()}

    window = models.family_of_model(model).window_vision
    tower = index(host.image_grid_thw) if window and len(host.image_grid_thw) else {}  # {}: text-only rows
    if window and host.video_grid_thw is not None:  # the videos' own index, under "video" (_multimodal_forward's)
        tower["video"] = index(host.video_grid_thw)
    return to_device(positions, device), to_device(deltas.view(-1), device), tower


def _multimodal_forward(model, prompts: PromptBatch, host: PromptBatch):
    """The vision-language forward with the indices of multimodal_index passed in, with a cache.
    Returns (language model output, rope_deltas)."""
    positions, deltas, tower = multimodal_index(model, host, prompts.input_ids.device)
    return _vl_forward(model, prompts, positions, tower, prompts.attention_mask, use_cache=True), deltas


def _vl_forward(model, prompts: PromptBatch, positions, tower: dict, attention_mask, use_cache: bool, **attention):
    """The vision-language forward at rope `positions` (3, N, L) under `attention_mask` (the rows' 2-D
    mask or a 4-D one); `attention`: keyword arguments for the language model's attention function.
    Qwen2.5-VL's is spelled out here (embed, vision tower, image features into their placeholders,
    language model) to hand its tower the CPU index `tower`; the other families run their own forward
    with the rope positions given (deepstack included)."""
    base = model.model
    if not tower:
        return base(**{**prompts.model_inputs(), "attention_mask": attention_mask}, position_ids=positions, use_cache=use_cache,
                    **attention)
    embeds = base.get_input_embeddings()(prompts.input_ids)
    video_index = tower.pop("video", None)
    for pixels, grid, index, token in ((prompts.pixel_values, prompts.image_grid_thw, tower, base.config.image_token_id),
                                       (prompts.pixel_values_videos, prompts.video_grid_thw, video_index, base.config.video_token_id)):
        if pixels is None:  # text-only rows, or rows without videos
            continue
        with torch.profiler.record_function("vision"):  # a range the benchmark's validation profile reports
            features = base.visual(pixels.type(base.visual.dtype), grid_thw=grid, **index).pooler_output
        embeds = embeds.masked_scatter((prompts.input_ids == token)[..., None], features.to(embeds.dtype))
    return base.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions, use_cache=use_cache,
                               **attention)


def prefix_forward(model, prompts: PromptBatch, host: PromptBatch) -> Prefix:
    """The model's forward over `prompts` (on the model's device) with a cache.

    host: the same rows on the CPU (pixel values may be left out): rope positions and vision
    indices are computed from it (multimodal_index), so the forward queues its work without waits.
    """
    positions = models.text_positions(model, prompts.attention_mask)
    if positions is not None:  # a text-only model: 1-D rope from each row's first real token
        out = model.model(**prompts.model_inputs(), position_ids=positions, use_cache=True)
        next_position = prompts.attention_mask.sum(-1)
    else:  # text after the prompt continues from its largest 3-D position (rope_deltas + valid length)
        out, deltas = _multimodal_forward(model, prompts, host)
        next_position = deltas + prompts.attention_mask.sum(-1)
    cache = getattr(out, "cache", None)  # transformers 5.24; 5.17 names it past_key_values
    cache = out.past_key_values if cache is None else cache
    return Prefix(out.last_hidden_state[:, -1], cache, next_position, prompts.attention_mask)


def _shared_prefix_hidden(model, unique: PromptBatch, host: PromptBatch, source, responses, response_mask) -> torch.Tensor:
    """Hidden states that predict each response token, each distinct prompt encoded once. -> (N, R, H)

    unique: the U distinct prompts (on the model's device), host: the same on the CPU; source: (N,)
    each row's prompt in it, on the CPU.
    """
    source = to_device(source, responses.device)
    prefix = prefix_forward(model, unique, host)
    cache = DynamicCache(config=model.config)
    lm = models.text_model(model)
    for i in range(len(lm.layers)):
        layer = prefix.cache.layers[i]
        cache.update(layer.keys.index_select(0, source), layer.values.index_select(0, source), i)
    mask = torch.cat([prefix.attention_mask.index_select(0, source), response_mask], dim=1)
    positions = prefix.next_position.index_select(0, source)[:, None] + torch.arange(responses.shape[1], device=responses.device)
    if models.family_of_model(model).vision:  # text after the prompt: the three mrope axes are equal
        positions = positions[None].expand(3, -1, -1)
    out = lm(
        input_ids=responses, attention_mask=mask, position_ids=positions,
        use_cache=True, **{_cache_kwarg(lm): cache},
    )
    return torch.cat([prefix.last_hidden.index_select(0, source)[:, None], out.last_hidden_state[:, :-1]], dim=1)


def _packed_prefix_hidden(model, unique: PromptBatch, host: PromptBatch, source, responses, response_mask) -> torch.Tensor:
    """Hidden states that predict each response token, each distinct prompt encoded once, without a
    cache (so checkpointed layers can recompute): a prompt and its samples' responses form one row,
    [prompt | response 1 | ... | response k], where each response attends to the prompt and to its
    own earlier tokens, at the rope positions the plain forward gives it. -> (N, R, H)

    unique: the U distinct prompts (P columns, on the model's device), host: the same on the CPU;
    source: (N,) each row's prompt in it, nondecreasing (a prompt's samples are consecutive rows), on
    the CPU (the layout is read there: no wait for the device).
    """
    device, (U, P), (N, R) = responses.device, unique.input_ids.shape, responses.shape
    counts = torch.bincount(source, minlength=U)
    slot = torch.arange(N) - (counts.cumsum(0) - counts)[source]  # (N,) sample index within its prompt
    k = int(counts.max())
    source, slot = to_device(source, device), to_device(slot, device)
    block = responses.new_zeros((U, k, R))  # slots a prompt has no sample for are never attended nor read
    block[source, slot] = responses
    valid = response_mask.new_zeros((U, k, R))
    valid[source, slot] = response_mask
    ids = torch.cat([unique.input_ids, block.view(U, k * R)], dim=1)  # (U, L), L = P + k R
    keys = torch.cat([unique.attention_mask, valid.view(U, k * R)], dim=1).bool()  # (U, L) keys that exist
    extra = {}
    if models.text_model(model).config._attn_implementation == PREFIX_ROWS_ATTENTION:  # segment by segment
        if attention.flash_varlen_serves(device.type, model.dtype):  # flash kernels over the real tokens
            extra["prefix_rows"] = VarlenPrefixRows.of(host.attention_mask.sum(-1), P, k, R, device)
        else:
            extra["prefix_rows"] = PrefixRows.of(unique.attention_mask.bool(), valid.bool())
        mask = keys[:, None, None, :]  # (U, 1, 1, L): 4-D, so transformers builds no mask of its own; unread
    else:  # one (L, L) mask per row
        mask = whole_row_mask(unique.attention_mask.bool(), valid.bool())  # (U, 1, L, L) True: attend
        if model.config._attn_implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=model.dtype, device=device).masked_fill_(~mask, torch.finfo(model.dtype).min)

    def after(follow):  # (U,) position after each prompt -> (U, k R): each response continues its prompt
        return (follow[:, None] + torch.arange(R, device=device)).repeat(1, k)

    text_positions = models.text_positions(model, unique.attention_mask)
    if text_positions is not None:  # a text-only model: 1-D rope from each row's first real token
        positions = torch.cat([text_positions, after(unique.attention_mask.sum(-1))], dim=1)
        out = model.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
    else:
        prompt_positions, deltas, tower = multimodal_index(model, host, device)
        following = after(deltas + unique.attention_mask.sum(-1))[None].expand(3, -1, -1)  # text after the prompt: equal axes
        positions = torch.cat([prompt_positions, following], dim=2)  # (3, U, L)
        mm = unique.mm_token_type_ids
        packed = replace(unique, input_ids=ids, attention_mask=keys.long(),
                         mm_token_type_ids=None if mm is None else torch.cat([mm, mm.new_zeros((U, k * R))], dim=1))
        out = _vl_forward(model, packed, positions, tower, mask, use_cache=False, **extra)
    t = torch.arange(R, device=device)
    at = torch.where(t == 0, P - 1, P + slot[:, None] * R + t - 1)  # (N, R) the position that predicts token t
    return out.last_hidden_state[source[:, None], at]


def token_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
    """log softmax(head(hidden) / temperature) at `targets`: (N, R, H), (N, R) -> (N, R) float32.

    chunk > 0: `chunk` positions at a time; under autograd each chunk's logits are recomputed in
    backward instead of kept.
    """

    def piece(h, y):
        logits = head(h).float()
        if temperature > 0:
            logits = logits / temperature
        return logits.log_softmax(dim=-1).gather(-1, y[..., None]).squeeze(-1)

    if chunk <= 0:
        return piece(hidden, targets)
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    grad = torch.is_grad_enabled() and flat_h.requires_grad
    parts = [
        checkpoint(piece, flat_h[s : s + chunk], flat_y[s : s + chunk], use_reentrant=False) if grad
        else piece(flat_h[s : s + chunk], flat_y[s : s + chunk])
        for s in range(0, flat_y.numel(), chunk)
    ]
    return torch.cat(parts).view_as(targets)


def response_logprobs(
    model,
    prompts: PromptBatch,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    options: ForwardOptions = ForwardOptions(),
) -> torch.Tensor:
    """Log-probs of the response tokens under softmax(logits / temperature).

    prompts: N rows (left-padded, P columns); responses, response_mask: (N, R).
    Returns logp (N, R) float32, zero where the mask is 0. Only the R positions that predict a
    response token go through the LM head. A sharded model runs it inside its root's forward hooks.
    """
    return distributed.root_call(model, _response_logprobs, prompts, responses, response_mask, temperature, options)


def _response_logprobs(model, prompts, responses, response_mask, temperature, options) -> torch.Tensor:
    device, full_width = model.device, responses.shape[1]
    width = int(response_mask.sum(-1).max())  # trailing all-padding columns are not computed
    responses, response_mask = to_device(responses[:, :width], device), to_device(response_mask[:, :width], device)
    if options.prefix_sharing:  # runs found where the prompts are (the CPU): only distinct prompts travel
        first, source = prompt_runs(prompts)
        host = prompts.select(first)
        shared = _packed_prefix_hidden if options.packed else _shared_prefix_hidden
        hidden = shared(model, host.to(device, model.dtype), host, source, responses, response_mask)
    else:
        prompts = prompts.to(device, model.dtype)
        inputs = prompts.model_inputs()
        inputs["input_ids"] = torch.cat([inputs["input_ids"], responses], dim=1)
        inputs["attention_mask"] = torch.cat([inputs["attention_mask"], response_mask], dim=1)
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.cat(
                [inputs["mm_token_type_ids"], torch.zeros_like(responses, dtype=inputs["mm_token_type_ids"].dtype)], dim=1
            )
        positions = models.text_positions(model, inputs["attention_mask"])
        if positions is not None:
            inputs["position_ids"] = positions
        hidden = model.model(**inputs, use_cache=False).last_hidden_state[:, -(width + 1) : -1]  # (N, R, H)
    logp = token_logprobs(model.lm_head, hidden, responses, temperature, options.logprobs_chunk_size) * response_mask
    return F.pad(logp, (0, full_width - width))


def micro_batches(prompts: PromptBatch, response_mask: torch.Tensor, rows: list[int], size: int, dynamic: bool) -> list[list[int]]:
    """Split `rows` into micro-batches.

    Fixed: consecutive chunks of `size` rows. dynamic (EasyR1's dynamic_batching): a budget of
    size x (prompt width + response width) padded tokens per micro-batch; rows of equal prompt ids
    stay together (so prefix sharing sees a prompt's samples at once), shorter prompts first, and a
    micro-batch costs rows x (longest prompt + longest response) in it.
    """
    if not dynamic:
        return [rows[i : i + size] for i in range(0, len(rows), size)]
    prompt_len = prompts.attention_mask.sum(-1).tolist()
    response_len = response_mask.sum(-1).tolist()
    budget = size * (prompts.input_ids.shape[1] + response_mask.shape[1])
    runs: list[list[int]] = []
    for r in rows:
        if runs and torch.equal(prompts.input_ids[r], prompts.input_ids[runs[-1][-1]]):
            runs[-1].append(r)
        else:
            runs.append([r])
    runs.sort(key=lambda run: prompt_len[run[0]])  # stable: less left padding per micro-batch

    def cost(group):
        return len(group) * (max(prompt_len[i] for i in group) + max(response_len[i] for i in group))

    out: list[list[int]] = []
    current: list[int] = []
    for run in runs:
        if current and cost(current + run) > budget and cost(run) <= budget:  # start a run afresh if it fits
            out.append(current)
            current = []
        for r in run:  # else fill up row by row
            if current and cost(current + [r]) > budget:
                out.append(current)
                current = []
            current.append(r)
    return out + [current] if current else out
