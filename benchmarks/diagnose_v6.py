"""Two suspects in the v6 step and evaluator (issue 7): cuDNN's attention, and the vision MLP's GEMMs.

    python benchmarks/diagnose_v6.py --config configs/bench_h200.yaml --out diag_v6.json

Same model (random weights), data and trainer as `vlgrpo bench`. v6's profiles showed the first
prefill of the 601 val prompts at 15.2 s against 10.3 s for the same prefill again (cuDNN's SDPA
builds an execution plan per new shape), ~1 ms of host time per cuDNN attention call in the update,
and the vision MLP's GEMMs (intermediate size 3420: rows of 6,840 bytes, not a multiple of 16) on
Ampere cutlass kernels, 2.9 s of the prefill's 6.5 s in the vision tower. Measured here:
1. the vision MLP's three GEMMs at one prefill chunk's patch count, intermediate 3420 against 3424
   (a multiple of 8), forward, milliseconds each (CUDA events);
2. the evaluator's prefill of the 601 val prompts with cuDNN's SDPA off (torch.backends.cuda.
   enable_cudnn_sdp: memory-efficient attention takes the masked calls) then on, each first with
   new shapes (cold) then again (warm), and a decode-step replay at 601 rows captured under each;
3. the trainer: warm-up step 1, then steps 2-5 with cuDNN's SDPA on, off, on, off: phase seconds
   (the decode step is captured with cuDNN either way, as the static engine does).
Prints as it goes; writes JSON after each section; --sections gemms,prefills,steps picks a subset.
"""

from __future__ import annotations

import time

import torch

from vlgrpo import config as config_lib
from vlgrpo import paths
from vlgrpo.batch import PromptBatch
from vlgrpo.bench import base_model, ensure_filtered, sync
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.policy import resolve_device
from vlgrpo.rollout import SamplingParams
from vlgrpo.trainer import GRPOTrainer

from diagnose_h200 import cuda_ms, out, say, script_args, section


def vision_mlp_gemms(hidden: int, inter: int, patches: int, device) -> dict:
    """ms of gate, up (x @ W.T, W (inter, hidden)) and down ((patches, inter) @ W.T) in bf16."""
    x = torch.randn(patches, hidden, device=device, dtype=torch.bfloat16)
    w_in = torch.randn(inter, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(patches, inter, device=device, dtype=torch.bfloat16)
    w_out = torch.randn(hidden, inter, device=device, dtype=torch.bfloat16)
    flops = 2 * patches * hidden * inter
    res = {}
    for name, fn in (("in_ms", lambda: torch.nn.functional.linear(x, w_in)), ("out_ms", lambda: torch.nn.functional.linear(h, w_out))):
        res[name] = cuda_ms(fn, reps=20)
        res[name.replace("_ms", "_tflops")] = flops / res[name] / 1e9
    return res


def main(argv=None):
    args, wanted, write = script_args(argv, "diag_v6.json", "gemms,prefills,steps")

    cfg = config_lib.load(args.config)
    device = resolve_device(cfg["trainer"]["device"])
    ensure_filtered(cfg)
    model, _ = base_model(cfg, device)
    vision = model.config.vision_config
    hidden, inter = vision.hidden_size, vision.intermediate_size

    def gemms():
        patches = 68 * 1400  # one prefill chunk of the evaluator: ~68 prompts of one 1,400-patch image
        out["vision_mlp_gemms"] = {str(n): vision_mlp_gemms(hidden, n, patches, device) for n in (inter, -(-inter // 8) * 8)}
        say(out["vision_mlp_gemms"])

    if "gemms" in wanted:
        section("vision MLP GEMMs, intermediate as configured and rounded up to a multiple of 8", gemms)
        write()

    trainer = GRPOTrainer(cfg)
    trainer.load(0, base=model)
    length = cfg["data"]["max_response_length"]
    engine = trainer.engine

    def prefills():
        val = load_filtered(paths.path(paths.FILTERED, config_lib.experiment_dir(cfg), split="val"))
        enc = encode_prompts(trainer.processor, val, device)
        sub = PromptBatch.from_processor(enc, [len(r["images"]) for r in val]).to(device, model.dtype)
        rows, width = sub.input_ids.shape
        cache_width = -(-(width + length - 1) // 128) * 128
        params = SamplingParams(0.6, 0.95, length)
        res, configured = {}, torch.backends.cuda.cudnn_sdp_enabled()
        for cudnn in (False, True):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            engine._decoder = engine._shape = None  # a new capture under this setting
            dec = engine._decoder_for(rows, cache_width, params)
            for run in ("cold", "warm"):
                sync(device)
                start = time.perf_counter()
                with torch.no_grad():
                    engine._prefill(sub, dec)
                sync(device)
                res[f"prefill_s_cudnn_{cudnn}_{run}"] = time.perf_counter() - start
            dec.keys.copy_(torch.arange(rows, device=device))
            dec.prompt_width.fill_(width)
            dec.step_index.zero_()
            res[f"decode_step_ms_cudnn_{cudnn}"] = cuda_ms(dec.graph.replay, reps=40)
            say(res)
        engine._decoder = engine._shape = None
        torch.backends.cuda.enable_cudnn_sdp(configured)
        out["eval_prefill"] = res

    if "prefills" in wanted:
        section("evaluator prefill and decode step, cuDNN SDPA off / on", prefills)
        write()

    def steps():
        res, configured = [], torch.backends.cuda.cudnn_sdp_enabled()
        trainer.step(1)
        for step, cudnn in ((2, True), (3, False), (4, True), (5, False)):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            record = trainer.step(step)
            res.append({"step": step, "cudnn_sdp": cudnn, **{k: round(v, 3) for k, v in record.items() if k.startswith(("timing_s/", "perf/max_memory"))}})
            say(res[-1])
        torch.backends.cuda.enable_cudnn_sdp(configured)
        out["steps"] = res

    if "steps" in wanted:  # after the prefills, the 601-row batch's memory was not all back: run it alone
        section("trainer steps, cuDNN SDPA on / off alternating", steps)
        write()


if __name__ == "__main__":
    main()
