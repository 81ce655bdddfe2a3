"""Rollout engine on vLLM, colocated with training in the same process.

The engine is built once from the model folder (the base model, or the checkpoint being
validated); before every rollout the policy's current weights are pushed into it in memory (the worker's in-place `reload_weights`, called through
`collective_rpc`; in this process unless tensor parallelism spawns workers) and its prefix and
encoder caches are dropped, since they hold keys/values and image embeddings of the old weights.
On a GPU the engine sleeps between rollouts (level 2: weights and KV cache released, so training
gets the memory back) and wakes for the next one; vLLM has no sleep mode on the CPU, where the
engine keeps its memory.

Prompts go in as the other engines see them: the token ids the processor made (each image's and
video's run of placeholder tokens collapsed to one, which vLLM expands again) and the row's images,
which vLLM's processor, given the same pixel bounds, leaves at their size, and videos (the frames
qwen-vl-utils sampled, as EasyR1 passes them, with qwen-vl-utils' metadata, which vLLM requires);
every rollout checks that vLLM's expanded prompt equals ours token for token. Each row is one
request with its own seed, the row's
32-bit key (sampling.sample_key of seed, step, prompt, sample), so a sample depends on its key only.
vLLM samples with its own generator: the same keys give other tokens than the hf engine's keyed
sampling (greedy decoding gives the same tokens). With LoRA, vLLM serves the base model and the policy's
adapters through its LoRA support (enable_lora; a LoRA request per rollout). Vision placeholders and ids past the tokenizer are
never sampled (as in HFEngine), EOS ends a response and counts in it.
Install: envs/make_vllm_env.sh (its own venv; README "Rollouts with vLLM"); make_engine says so
when vLLM is missing.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import vllm
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import LogitsProcessor

from vlgrpo import lora, models
from vlgrpo.batch import PromptBatch
from vlgrpo.data.images import processor_pixel_bounds
from vlgrpo.errors import VlgrpoError
from vlgrpo.rollout import Rollout, SamplingParams
from vlgrpo.rollout.hf import banned_tokens, eos_ids, finish_rollout


class VLLMError(VlgrpoError, RuntimeError):
    pass


class BanTokens(LogitsProcessor):
    """The tokens HFEngine never samples (vision placeholders, ids past the tokenizer), for every request.

    Built by vLLM where it samples (a worker process under tensor parallelism): the ids come from the
    model's own tokenizer.
    """

    def __init__(self, vllm_config, device, is_pin_memory):
        config = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.banned = banned_tokens(tokenizer, config.get_vocab_size()).nonzero().squeeze(-1).to(device)

    def is_argmax_invariant(self) -> bool:
        return False  # greedy decoding skips banned tokens too

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill_(1, self.banned, float("-inf"))


def _repack_kept_cpu_weights(worker) -> None:
    """On the CPU, vLLM packs every linear product's weight for its kernels at load time. The reload
    repacks the layers it loads, but a layer whose weight it does not load keeps its old pack: the
    LM head tied to the input embeddings (its weight is the embeddings' tensor, updated in place,
    yet its product kept the pack from the first load). Layers that keep their weight beside the
    pack (remove_weight=False: embeddings, LM heads) are packed again from it here."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise VLLMError(f"worker.actor.model.lora.rank {rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def _collapse_image_runs(ids: list[int], image_token: int, video_token: int | None = None) -> list[int]:
    """Prompt ids with each run of image (video) placeholder tokens reduced to one (vLLM expands each
    image and video itself)."""
    vision = {image_token, video_token} - {None}
    return [t for i, t in enumerate(ids) if t not in vision or i == 0 or ids[i - 1] != t]


class VLLMEngine:
    """Same generate() as HFEngine; cfg: the resolved config (rollout, data, seed, trainer.device)."""

    def __init__(self, model, processor, cfg: dict):
        path = model.name_or_path
        archs = getattr(model.config, "architectures", None) or [type(model).__name__]
        if not set(archs) & set(vllm.ModelRegistry.get_supported_archs()):
            raise VLLMError(f"model.path {path!r}: architecture {archs} is not supported by vLLM {vllm.__version__}")
        self.model, self.tokenizer = model, models.tokenizer(processor)
        self.eos_ids, self.pad_id = eos_ids(model, self.tokenizer), self.tokenizer.pad_token_id
        self.vision = models.family_of_model(model).vision  # a text-only model: token ids alone, no multimodal limits
        self.image_token = model.config.image_token_id if self.vision else None
        self.video_token = getattr(model.config, "video_token_id", None) if self.vision else None
        rollout, data = cfg["worker"]["rollout"], cfg["data"]
        self.sleeps = model.device.type == "cuda"  # vLLM's sleep mode exists on CUDA (and ROCm, XPU) only
        # the images arrive sized by vlgrpo.data.images.model_image_size; vLLM's processor snaps them with
        # the same bounds as the hf processor, so it leaves them as they are (token counts checked in generate)
        min_pixels, max_pixels = processor_pixel_bounds(processor)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: weights pushed by reference
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM cuts training's threads to 1
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        max_model_len = data["max_prompt_length"] + data["max_response_length"]
        # On a GPU vLLM takes gpu_memory_utilization of the device. On the CPU its fraction would count
        # this process's training memory (which grows after the engine starts): the KV cache is sized
        # for one rollout instead, every sequence at full length.
        # LoRA (worker.actor.model.lora): vLLM serves the base model with the policy's adapters, pushed
        # as a peft folder before every rollout (vLLM's LoRA support; it has none for the vision tower)
        self.lora_rank = lora.settings(cfg)["rank"] if lora.has_adapters(model) else 0
        if self.lora_rank:
            visual = models.vision_tower(model)
            tower = sorted(n for n, _ in visual.named_parameters() if lora.is_adapter(n)) if visual is not None else []
            if tower:
                raise VLLMError(
                    f"worker.rollout.engine vllm: vLLM has no LoRA for the vision tower, which has adapters ({tower[0]}, ...); "
                    "set worker.actor.model.lora.exclude_modules: '.*visual.*' (EasyR1's example config does)"
                )
            self._lora_dir = tempfile.TemporaryDirectory(prefix="vlgrpo_lora_")
            self._lora_request, self._lora_id = None, 0
        kv_bytes = None if self.sleeps else models.kv_cache_bytes(
            model.config.get_text_config(), model.dtype, rollout["batch_size"] * rollout["n"], max_model_len
        )
        try:
            self.llm = vllm.LLM(
                model=path,
                dtype=str(model.dtype).removeprefix("torch."),
                # A real load, even though the policy's weights replace them before every rollout: vLLM's
                # in-place reload needs the metadata a real load records (after a dummy load, layers
                # whose weights the CPU backend repacks kept their random values).
                load_format="auto",
                seed=cfg["seed"],
                max_model_len=max_model_len,
                # as many images as fit in a prompt at min_pixels (784 pixels a token)
                # (a video: at least one frame's worth of tokens)
                **({"limit_mm_per_prompt": {kind: max(1, data["max_prompt_length"] * 784 // min_pixels) for kind in ("image", "video")},
                    "mm_processor_kwargs": {"min_pixels": min_pixels, "max_pixels": max_pixels}} if self.vision else {}),
                gpu_memory_utilization=rollout["gpu_memory_utilization"],
                kv_cache_memory_bytes=kv_bytes,
                tensor_parallel_size=rollout["tensor_parallel_size"],
                # under torchrun each rank owns its engine (vLLM's external launcher); else vLLM's default
                distributed_executor_backend="external_launcher" if distributed else None,
                enable_sleep_mode=self.sleeps,
                enforce_eager=model.device.type != "cuda",
                generation_config="vllm",  # not generation_config.json's defaults (repetition_penalty 1.05)
                logprobs_mode="processed_logprobs",  # after temperature, as HFEngine's log-probs
                logits_processors=[BanTokens],
                **({"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_lora_rank(self.lora_rank)} if self.lora_rank else {}),
            )
        except (ValueError, RuntimeError) as e:
            if "memory" in str(e).lower():
                wanted = (f"worker.rollout.gpu_memory_utilization={rollout['gpu_memory_utilization']} (the fraction "
                          "of the GPU's memory vLLM may use in all, weights and KV cache)") if kv_bytes is None else (
                          f"a KV cache of {kv_bytes / 2**30:.2f} GiB on the CPU (worker.rollout.batch_size x n sequences "
                          "of max_prompt_length + max_response_length tokens)")
                raise VLLMError(f"vLLM could not reserve its memory with {wanted}: {e}") from e
            raise
        # level 2 drops the weights (the policy's are pushed at every wake); with LoRA the base weights stay (level 1: host memory)
        self.sleep_level = 1 if self.lora_rank else 2
        if self.sleeps:
            self.llm.sleep(level=self.sleep_level)  # training has the memory until the first rollout
        self.asleep = self.sleeps

    def push_adapters(self) -> int:
        """Write the policy's current adapters as a peft folder and name it in a new LoRA request (a new id:
        vLLM loads it afresh); the base weights in vLLM are model.path's, as the policy's. Drops the caches."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = Path(self._lora_dir.name)
        tensors = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous()
                   for k, v in lora.adapter_tensors(self.model).items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.model.peft_config[lora.ADAPTER].save_pretrained(str(folder))
        self._lora_id += 1
        self._lora_request = LoRARequest(f"policy_{self._lora_id}", self._lora_id, str(folder))
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        return len(tensors)

    def push_weights(self) -> int:
        """Copy the policy's current parameters into vLLM's model; drop caches computed with older ones."""
        if self.lora_rank:
            return self.push_adapters()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        in_process = self.llm.llm_engine.vllm_config.parallel_config.world_size == 1 or "WORLD_SIZE" in os.environ
        weights = []
        for name, p in self.model.named_parameters():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards (DTensor)
            weights.append((name, t if in_process else t.cpu()))  # to spawned workers through shared memory
        # The worker's in-place reload: load_weights, then the kernel-format processing the first load did.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.collective_rpc(_repack_kept_cpu_weights)
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        return len(weights)

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, keys: torch.Tensor, params: SamplingParams, batch_size: int, progress=False
    ) -> Rollout:
        """Sample one response per row of `prompts`; vLLM schedules the batch itself (batch_size unused)."""
        if prompts.images is None and self.vision:
            raise ValueError("the vllm engine needs the rows' images (PromptBatch.from_processor(..., images=...))")
        self.push_weights()
        requests, expected = [], []
        for i in range(len(prompts)):
            ids = prompts.input_ids[i][prompts.attention_mask[i].bool()].tolist()
            expected.append(ids)
            request = {"prompt_token_ids": _collapse_image_runs(ids, self.image_token, self.video_token) if self.vision else ids}
            media = {}
            if self.vision and prompts.images[i]:  # a text-only row has no multimodal data
                media["image"] = list(prompts.images[i])
            if prompts.videos is not None and prompts.videos[i]:
                media["video"] = [(v.frames, v.metadata) for v in prompts.videos[i]]  # vLLM needs the metadata
            if media:
                request["multi_modal_data"] = media
            requests.append(request)
        sampling = [
            vllm.SamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p if params.temperature > 0 else 1.0,
                top_k=params.top_k if params.temperature > 0 and params.top_k > 0 else -1,
                seed=int(key),
                max_tokens=params.max_tokens,
                min_tokens=params.max_tokens if params.ignore_eos else 0,
                ignore_eos=params.ignore_eos,
                stop_token_ids=[] if params.ignore_eos else self.eos_ids,
                logprobs=0,
                detokenize=False,  # texts are decoded below exactly as the other engines decode them
            )
            for key in keys.tolist()
        ]
        try:
            outputs = self.llm.generate(requests, sampling, use_tqdm=progress,
                                        lora_request=self._lora_request if self.lora_rank else None)
        finally:
            if self.sleeps:
                self.llm.sleep(level=self.sleep_level)
                self.asleep = True
        responses = torch.full((len(prompts), params.max_tokens), self.pad_id, dtype=torch.long)
        logp = torch.zeros(len(prompts), params.max_tokens)
        for i, out in enumerate(outputs):
            if list(out.prompt_token_ids) != expected[i]:
                raise VLLMError(
                    f"vLLM rendered prompt row {i} as {len(out.prompt_token_ids)} tokens, the processor as "
                    f"{len(expected[i])}: its image processor sized the image differently"
                )
            sample = out.outputs[0]
            responses[i, : len(sample.token_ids)] = torch.tensor(sample.token_ids)
            logp[i, : len(sample.token_ids)] = torch.tensor(
                [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
            )
        return finish_rollout(responses, logp, self.eos_ids, self.pad_id, self.tokenizer, params.ignore_eos, params.skip_special_tokens)

