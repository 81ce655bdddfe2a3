"""Tiny random models of each family: the real config of ../shared/data/<folder> shrunk to a few
layers of a few units (token ids, vocabulary, rope kind, deepstack, layer kinds kept), saved beside
the real processor, tokenizer and chat template. Text-only families: Qwen3-4B-Instruct-2507's config
(qwen3) or transformers' config class with its vocabulary and token ids (qwen2, qwen3_moe, llama),
beside its tokenizer and chat template."""

import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from conftest import SHARED, own_keys_decode, text_attention, varlen_layout
from vlgrpo import models

# model_type -> the shared folder whose processor and config it starts from
FOLDERS = {
    "qwen2_vl": "qwen2_vl_2b",
    "qwen2_5_vl": "qwen2_5_vl_7b",
    "qwen3_vl": "qwen3_vl_4b",
    "qwen3_vl_moe": "qwen3_vl_4b",
    "qwen3_5": "qwen3_5_0_8b",
    "qwen3": "qwen3_4b",
    "qwen2": "qwen3_4b",
    "qwen3_moe": "qwen3_4b",
    "llama": "qwen3_4b",
}
TEXT_CLASSES = {"qwen2": "Qwen2Config", "qwen3_moe": "Qwen3MoeConfig", "llama": "LlamaConfig"}  # qwen3: the real config
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}


def _mrope_section(rope: dict, head_dim: int) -> list[int]:
    """Sections (t, h, w) over the rotated half of a head, in the real config's proportions."""
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    return [half - 2 * (half // 3), half // 3, half // 3]


def _shrink_text(text: dict, head_dim: int) -> None:
    layers = 4 if "layer_types" in text else 2  # Qwen3.5: three linear-attention layers and one full
    heads = HIDDEN // head_dim
    text.update(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=max(1, heads * KV_HEADS // HEADS), max_window_layers=layers)
    if "head_dim" in text:
        text["head_dim"] = head_dim
    if "layer_types" in text:
        text.update(layer_types=text["layer_types"][:layers], linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_hidden_layers=0)
    for key in ("rope_scaling", "rope_parameters"):
        if text.get(key) and "mrope_section" in text[key]:
            text[key]["mrope_section"] = _mrope_section(text[key], head_dim)


def tiny_config(model_type: str, head_dim: int = HEAD_DIM) -> dict:
    """The shrunk config.json of `model_type` (from its shared folder's real one). head_dim: the text
    model's (vLLM's CPU attention takes 32 and up)."""
    config = json.loads((SHARED / FOLDERS[model_type] / "config.json").read_text())
    if model_type in TEXT_CLASSES:  # the real Qwen3-4B's vocabulary and token ids in another family's config
        tokens = {k: config[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings")}
        config = getattr(transformers, TEXT_CLASSES[model_type])(**tokens, **(MOE if model_type == "qwen3_moe" else {})).to_dict()
        config.pop("layer_types", None)  # all full attention: rebuilt for the shrunk depth
    if not models.family(model_type).vision:
        _shrink_text(config, head_dim)
        return config
    if model_type == "qwen3_vl_moe":  # Qwen3-VL-30B-A3B's layout on Qwen3-VL-4B's tokens
        config.update(model_type="qwen3_vl_moe", architectures=["Qwen3VLMoeForConditionalGeneration"])
        config["text_config"].update(model_type="qwen3_vl_moe_text", **MOE)
        config["vision_config"]["model_type"] = "qwen3_vl_moe"
    text = config.get("text_config", config)
    _shrink_text(text, head_dim)
    vision = config["vision_config"]
    vision.update(depth=2, num_heads=2)
    if "embed_dim" in vision:  # Qwen2-VL: embed_dim is the tower's width, hidden_size its output
        vision.update(embed_dim=32, hidden_size=HIDDEN)
    else:
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=HIDDEN)
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = [1]
    if vision.get("deepstack_visual_indexes"):
        vision["deepstack_visual_indexes"] = [0]
    return config


def build(model_type: str, folder: Path, seed: int = 0, weights: bool = True, head_dim: int = HEAD_DIM) -> Path:
    """A folder holding the tiny `model_type` config (tiny_config), the real processor files and
    (weights) random float32 weights drawn with `seed`."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in (SHARED / FOLDERS[model_type]).iterdir():
        if f.name not in ("config.json", "SOURCE.md", "LICENSE", "NOTICE"):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(tiny_config(model_type, head_dim)))
    if weights:
        from transformers import AutoConfig

        torch.manual_seed(seed)
        fam = models.family(model_type)
        model = models.model_class(fam).from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
        model.save_pretrained(folder)
    return folder


def check_logprobs_and_engines(trainer, model_type: str, prompts):
    """On `trainer`'s policy: sampled log-probs equal the training forward's, the fast paths the family
    serves (prefix sharing, chunked log-probs) equal the plain forward, and where it serves the static
    engine, its greedy tokens equal the hf engine's. Returns (the hf rollout, plain log-probs)."""
    from vlgrpo.attention import PREFIX_ROWS_ATTENTION
    from vlgrpo.policy import ForwardOptions, response_logprobs
    from vlgrpo.rollout import SamplingParams
    from vlgrpo.rollout.hf import HFEngine
    from vlgrpo.rollout.sampling import sample_key
    from vlgrpo.rollout.static import WIDTH_BUCKET, StaticEngine, _cache_width

    family = models.family(model_type)
    keys = torch.tensor([sample_key(1, 1, i) for i in range(len(prompts))])
    out = HFEngine(trainer.policy, trainer.processor).generate(prompts, keys, SamplingParams(1.0, 1.0, 12), len(prompts))
    mask = out.response_mask.bool()
    with torch.no_grad():
        plain = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0)
        fast = ForwardOptions(prefix_sharing=family.serves("worker.actor.prefix_sharing"), logprobs_chunk_size=5)
        shared = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0, fast)
        packed = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0, replace(fast, packed=True))
        with text_attention(trainer.policy, PREFIX_ROWS_ATTENTION):  # packed rows segment by segment, as under checkpointing
            segments = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0, replace(fast, packed=True))
            with varlen_layout():  # as on CUDA in bf16: the segments as flash varlen calls
                varlen = response_logprobs(trainer.policy, prompts, out.responses, out.response_mask, 1.0, replace(fast, packed=True))
    assert torch.allclose(plain[mask], out.logp[mask], atol=1e-5), (plain - out.logp).abs().max()
    assert torch.allclose(shared[mask], plain[mask], atol=1e-5), (shared - plain).abs().max()
    assert torch.allclose(packed[mask], plain[mask], atol=1e-5), (packed - plain).abs().max()
    assert torch.allclose(segments[mask], plain[mask], atol=1e-5), (segments - plain).abs().max()
    assert torch.allclose(varlen[mask], plain[mask], atol=1e-5), (varlen - plain).abs().max()
    if family.serves("worker.rollout.engine"):
        greedy = SamplingParams(0.0, 1.0, 12)
        hf = HFEngine(trainer.policy, trainer.processor).generate(prompts, keys, greedy, len(prompts))
        class Copying(StaticEngine):  # its decoder keeps its own copy of the weights, as under FSDP2
            own_weights = True

        # the whole cache under a mask; each row's own keys, in a cache with room for longer prompts; these
        # with the decoder's copy of the weights
        width = prompts.input_ids.shape[1]
        room = width + WIDTH_BUCKET  # a longer prompt to come: a wider cache where the step attends each row's own keys
        for decode, engine in ((contextlib.nullcontext, StaticEngine), (own_keys_decode, StaticEngine), (own_keys_decode, Copying)):
            with decode():
                static = engine(trainer.policy, trainer.processor, cuda_graph=False, widest_prompt=room)
                generated = static.generate(prompts, keys, greedy, len(prompts))
            assert bool(static._decoder.own) == (engine is Copying)
            own_keys = decode is own_keys_decode
            assert static._decoder.mask.shape[1] == _cache_width(room if own_keys else width, greedy.max_tokens)
            assert torch.equal(generated.responses, hf.responses)
            assert torch.allclose(generated.logp, hf.logp, atol=1e-5)
    return out, plain


def checkpoint_weights(cfg: dict, step: int) -> dict:
    """The model tensors of checkpoint `step` in `cfg`'s experiment."""
    from safetensors.torch import load_file

    from vlgrpo import config, paths
    from vlgrpo.checkpoint import CheckpointStore

    folder = CheckpointStore(paths.path(paths.CHECKPOINTS, config.experiment_dir(cfg))).model_dir(step)
    return {k: v for f in sorted(folder.glob("model*.safetensors")) for k, v in load_file(f).items()}


def deterministic(record: dict) -> dict:
    """A metrics record without its wall-clock figures."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}
