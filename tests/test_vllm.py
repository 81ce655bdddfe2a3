"""The vLLM rollout engine. Runs in the vLLM environment (envs/make_vllm_env.sh; .ci/run's vLLM step);
in an environment without vLLM only the install hint is tested and the rest is skipped."""

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

import families
from conftest import SHARED, make_experiment
from vlgrpo import config, lora, paths
from vlgrpo.batch import PromptBatch
from vlgrpo.data.filtering import filter_split
from vlgrpo.data.prompts import encode_prompts
from vlgrpo.errors import VlgrpoError
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.tracking import merge_by_step, read_records

ROOT = Path(__file__).resolve().parents[1]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (envs/make_vllm_env.sh makes its env)")
VLLM = {"engine": "vllm"}


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_without_vllm_the_engine_says_how_to_install_it():
    with pytest.raises(VlgrpoError, match="envs/make_vllm_env.sh"):
        make_engine("vllm", None, None, cfg={})


# vLLM keeps one parallel state per process, and closing an engine tears it down: two engines must
# not be alive at once. Tests that build their own engine (own_engines) come first in this file (pytest
# runs them in file order) and close it as they end; the module's shared `trainer` is built after them.
@pytest.fixture
def own_engines():
    """Register a trainer whose vLLM engine this test builds; the engines are closed at the test's end."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    assert not model_parallel_is_initialized(), "another vLLM engine is alive: put this test above the shared trainer's"
    made = []
    yield made.append
    for trainer in made:
        if trainer.engine is not None:  # now, not whenever the garbage collector gets to it
            trainer.engine.llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def own_trainer(demo_base, tmp_path, own_engines):
    """Builds a trainer (and its engine) on the demo's data from config overrides (own_engines)."""
    from vlgrpo.trainer import GRPOTrainer

    def build(overrides: dict, refilter: bool = False):
        """refilter: filter the demo's rows again with the config's processor (another family's sizes)."""
        cfg = make_experiment(demo_base, tmp_path / "results", overrides)
        exp = config.experiment_dir(cfg)
        for split in ("train", "val") if refilter else ():  # in this process: a fork after vLLM's threads can hang
            filter_split(cfg, split, paths.path(paths.FILTERED, exp, split=split), paths.path(paths.STATS, exp, split=split),
                         workers=1)
        trainer = GRPOTrainer(cfg)
        own_engines(trainer)
        trainer.load(0)
        return trainer

    return build


@needs_vllm
def test_vllm_serves_the_policys_lora_adapters(own_trainer):
    """With LoRA (no adapters on the vision tower, as vLLM needs) vLLM generates the hf engine's greedy
    tokens with the adapters active, before and after an update that moves them (vLLM's LoRA requests)."""
    lora_trainer = own_trainer({"worker": {"rollout": VLLM, "actor": {
        "optim": {"lr": 5e-2}, "model": {"lora": {"rank": 8, "alpha": 16, "exclude_modules": ".*visual.*"}}}}})
    prompts, keys = image_prompts(lora_trainer, 4, 1), torch.arange(4)
    greedy = SamplingParams(temperature=0, top_p=1.0, max_tokens=32)

    def hf():
        return make_engine("hf", lora_trainer.policy, lora_trainer.processor).generate(prompts, keys, greedy, len(prompts))

    before_hf = hf()
    assert same_rollout(lora_trainer.engine.generate(prompts, keys, greedy, len(prompts)), before_hf)
    group = image_prompts(lora_trainer, 2, 4)
    sampled = lora_trainer.engine.generate(group, torch.arange(8), SamplingParams(1.0, 1.0, 24), len(group))
    old = lora_trainer._logprobs(lora_trainer.policy, group, sampled.responses, sampled.response_mask, 8)
    with lora.adapters_disabled(lora_trainer.ref):  # the reference: the base model
        ref = lora_trainer._logprobs(lora_trainer.ref, group, sampled.responses, sampled.response_mask, 8)
    lora_trainer.update_actor(1, group, sampled, old, ref, torch.full((8,), -1.0))
    after_hf = hf()
    assert not torch.equal(after_hf.responses, before_hf.responses)
    assert same_rollout(lora_trainer.engine.generate(prompts, keys, greedy, len(prompts)), after_hf)


@needs_vllm
def test_vllm_refuses_adapters_on_the_vision_tower(own_trainer):
    with pytest.raises(VlgrpoError, match="exclude_modules"):
        own_trainer({"worker": {"rollout": VLLM, "actor": {"model": {"lora": {"rank": 8}}}}})



@needs_vllm
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])  # Qwen3.5: vLLM's CPU Gated DeltaNet takes bf16 only
def test_vllm_generates_the_hf_engines_greedy_tokens_for_each_family(model_type, own_trainer, tmp_path):
    """Tiny random models of the other families on their real processors (tests/families.py): vLLM's
    greedy tokens are the hf engine's, images expanded to the processor's token counts."""
    if not (SHARED / families.FOLDERS[model_type]).exists():
        pytest.skip(f"shared data absent: {families.FOLDERS[model_type]}")
    folder = families.build(model_type, tmp_path / "model", head_dim=32)
    trainer = own_trainer({"model": {"path": str(folder)}, "data": {"max_prompt_length": 1024}, "worker": {"rollout": VLLM}},
                          refilter=True)
    prompts, keys = image_prompts(trainer, 4, 1), torch.arange(4)
    greedy = SamplingParams(temperature=0, top_p=1.0, max_tokens=16)
    hf = make_engine("hf", trainer.policy, trainer.processor).generate(prompts, keys, greedy, len(prompts))
    assert same_rollout(trainer.engine.generate(prompts, keys, greedy, len(prompts)), hf)


@needs_vllm
@pytest.mark.skipif(not (SHARED / "qwen3_4b").exists(), reason="shared data absent: qwen3_4b")
def test_vllm_generates_the_hf_engines_greedy_tokens_for_a_text_model(own_engines, tmp_path):
    """A text-only model (tiny Qwen3 on math rows, tests/test_textonly.py's): token ids alone go to vLLM,
    no multimodal data or limits; its greedy tokens equal the hf engine's."""
    from test_textonly import _prompts, filtered, text_experiment
    from vlgrpo.trainer import GRPOTrainer

    folder = families.build("qwen3", tmp_path / "model", head_dim=32)
    trainer = GRPOTrainer(filtered(text_experiment(tmp_path, folder, {"worker": {"rollout": VLLM}})))
    own_engines(trainer)
    trainer.load(0)
    prompts, keys = _prompts(trainer, n=1), torch.arange(3)
    greedy = SamplingParams(temperature=0, top_p=1.0, max_tokens=16)
    hf = make_engine("hf", trainer.policy, trainer.processor).generate(prompts, keys, greedy, len(prompts))
    assert same_rollout(trainer.engine.generate(prompts, keys, greedy, len(prompts)), hf)


@pytest.fixture(scope="module")
def trainer(demo_base, tmp_path_factory):
    from vlgrpo.trainer import GRPOTrainer

    # A large learning rate, so that one step changes what greedy decoding says.
    cfg = make_experiment(demo_base, tmp_path_factory.mktemp("vllm"),
                          {"worker": {"rollout": VLLM, "actor": {"optim": {"lr": 1e-2}}}})
    trainer = GRPOTrainer(cfg)
    trainer.load(0)
    return trainer


def image_prompts(trainer, count: int, n: int) -> PromptBatch:
    rows = trainer.rows[:count]
    enc = encode_prompts(trainer.processor, rows)
    return PromptBatch.from_processor(enc, [len(r["images"]) for r in rows], [r["images"] for r in rows]).repeat_interleave(n)


def same_rollout(a, b) -> bool:
    return (torch.equal(a.responses, b.responses) and torch.equal(a.response_mask, b.response_mask)
            and torch.equal(a.truncated, b.truncated) and a.texts == b.texts)


@needs_vllm
def test_vllm_generates_the_hf_engines_greedy_tokens_after_an_update(trainer):
    """The weights pushed in memory are the trained ones: before and after an actor update (which
    changes the policy's greedy answers), vLLM's greedy tokens equal the hf engine's. Every rollout also checks
    that vLLM expanded each image to the processor's token count (else it raises)."""
    prompts, keys = image_prompts(trainer, 4, 1), torch.arange(4)
    greedy = SamplingParams(temperature=0, top_p=1.0, max_tokens=32)

    def hf():
        return make_engine("hf", trainer.policy, trainer.processor).generate(prompts, keys, greedy, len(prompts))

    before_hf, before = hf(), trainer.engine.generate(prompts, keys, greedy, len(prompts))
    assert same_rollout(before, before_hf)
    # One actor update (the trainer's own) pushing the sampled responses down, so it moves the weights
    # away from what the policy says whatever the rewards (the demo's groups often score alike: zero advantages).
    group = image_prompts(trainer, 2, 4)
    sampled = trainer.engine.generate(group, torch.arange(8), SamplingParams(1.0, 1.0, 24), len(group))
    old = trainer._logprobs(trainer.policy, group, sampled.responses, sampled.response_mask, 8)
    ref = trainer._logprobs(trainer.ref, group, sampled.responses, sampled.response_mask, 8)  # the KL loss's
    update = trainer.update_actor(1, group, sampled, old, ref, torch.full((8,), -1.0))
    assert update["actor/nonfinite_skipped"] == 0
    after_hf = hf()
    assert not torch.equal(after_hf.responses, before_hf.responses)  # the update changed the policy's answers
    after = trainer.engine.generate(prompts, keys, greedy, len(prompts))
    assert same_rollout(after, after_hf)
    mask = after.response_mask.bool()
    assert torch.isfinite(after.logp[mask]).all() and (after.logp[mask] <= 0).all()


@needs_vllm
def test_vllm_generates_the_hf_engines_greedy_tokens_on_a_mixed_batch(trainer):
    """Text-only rows (no images, no multimodal data) beside image rows: vLLM's greedy tokens are hf's."""
    from vlgrpo.data.prompts import render_prompt

    text = [{"problem": p, "answer": "3", "images": [], "prompt": render_prompt(trainer.processor, p, "r1v")}
            for p in ("How many sides does a triangle have?", "What is 2 + 2? Count them.")]
    rows = [trainer.rows[0], text[0], trainer.rows[1], text[1]]
    prompts = PromptBatch.from_processor(encode_prompts(trainer.processor, rows), [len(r["images"]) for r in rows],
                                         [r["images"] for r in rows])
    keys, greedy = torch.arange(4), SamplingParams(temperature=0, top_p=1.0, max_tokens=32)
    hf = make_engine("hf", trainer.policy, trainer.processor).generate(prompts, keys, greedy, len(prompts))
    assert same_rollout(trainer.engine.generate(prompts, keys, greedy, len(prompts)), hf)



@needs_vllm
def test_vllm_generates_the_hf_engines_greedy_tokens_on_video_prompts(trainer, tmp_path):
    """Video rows (frames sampled by qwen-vl-utils, multi_modal_data "video") beside image rows: vLLM
    expands each video to the processor's tokens and its greedy tokens are hf's."""
    from test_video import VIDEO_PROBLEMS, write_frames
    from vlgrpo.data.prompts import render_prompt
    from vlgrpo.data.videos import video_spec
    from vlgrpo.rollout.graded import encode_batch

    data = trainer.cfg["data"]
    video = [{"problem": p, "answer": "1", "images": [], "prompt": render_prompt(trainer.processor, p, "r1v"),
              "videos": [video_spec(write_frames(tmp_path, f"clip{i}", 4 + i), str(tmp_path), data["min_pixels"],
                                    data["max_pixels"], data["video_fps"])]}
             for i, p in enumerate(VIDEO_PROBLEMS)]
    prompts = encode_batch(trainer.processor, [trainer.rows[0], video[0], video[1]], 1, torch.device("cpu"))
    assert prompts.num_videos.tolist() == [0, 1, 1]
    keys, greedy = torch.arange(3), SamplingParams(temperature=0, top_p=1.0, max_tokens=32)
    hf = make_engine("hf", trainer.policy, trainer.processor).generate(prompts, keys, greedy, len(prompts))
    assert same_rollout(trainer.engine.generate(prompts, keys, greedy, len(prompts)), hf)


@needs_vllm
def test_samples_follow_their_request_seeds(trainer):
    n = 4
    prompts = image_prompts(trainer, 3, n)
    keys = torch.tensor([sample_key(1, 7, i // n, i % n) for i in range(len(prompts))])
    sampled = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24)

    def generate(p, k):
        return trainer.engine.generate(p, k, sampled, len(p))

    first = generate(prompts, keys)
    assert same_rollout(generate(prompts, keys), first)  # same seeds, same tokens
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
    shuffled = generate(prompts.select(order), keys[order])  # each seed belongs to its request, not to a batch slot
    assert torch.equal(shuffled.responses, first.responses[order])
    other = generate(prompts, keys + 1)
    assert (other.responses != first.responses).any(-1).float().mean() >= 0.75  # other seeds, other tokens
    assert len({tuple(r) for r in first.responses[:n].tolist()}) > 1  # the n samples of a prompt differ


@needs_vllm
def test_an_unsupported_architecture_is_named():
    from vlgrpo.rollout.vllm import VLLMEngine, VLLMError

    model = SimpleNamespace(name_or_path="/models/x", config=SimpleNamespace(architectures=["NoSuchVLForCausalLM"]))
    with pytest.raises(VLLMError, match="NoSuchVLForCausalLM.*not supported by vLLM"):
        VLLMEngine(model, None, {})


@needs_vllm
def test_a_kv_cache_larger_than_memory_is_refused_with_its_size(trainer):
    """On the CPU the KV cache holds one rollout; a rollout that cannot fit says how big it is and why."""
    from vlgrpo.models import kv_cache_bytes
    from vlgrpo.rollout.vllm import VLLMEngine, VLLMError

    cfg = copy.deepcopy(trainer.cfg)
    cfg["worker"]["rollout"]["batch_size"] = 10**6
    data, n = cfg["data"], cfg["worker"]["rollout"]["n"]
    wanted = kv_cache_bytes(trainer.policy.config.get_text_config(), trainer.policy.dtype, n * 10**6,
                            data["max_prompt_length"] + data["max_response_length"])
    assert wanted > psutil.virtual_memory().total
    with pytest.raises(VLLMError, match=rf"KV cache of {wanted / 2**30:.2f} GiB on the CPU \(worker.rollout.batch_size x n"):
        VLLMEngine(trainer.policy, trainer.processor, cfg)


@needs_vllm
@pytest.mark.slow
def test_the_demo_workflow_runs_with_vllm_and_logs_the_same_metric_names(demo_base, tmp_path):
    """Snakemake end to end (baseline, 2 segments, their validations, report) with engine: vllm;
    metric names equal those of an hf-engine step and validation."""
    from vlgrpo.evaluate import evaluate
    from vlgrpo.trainer import GRPOTrainer

    demo = Path(demo_base["demo"]["out_dir"])
    synth = demo / "geometry_synth"
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
         "--config", "experiment=wfv", f"demo={{out_dir: {demo}, n_train: 64, n_val: 16, n_test: 16, warmup_steps: 30}}",
         f"model={{path: {demo_base['model']['path']}}}",
         f"data={{train: {synth}/train.parquet, val: {synth}/test.parquet}}",
         "trainer={max_steps: 4, save_freq: 2, val_freq: 2, retries: 0}",
         "worker={rollout: {engine: vllm}}"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    exp = tmp_path / "results" / "wfv"
    assert config.read_resolved(exp / "config.resolved.yaml")["worker"]["rollout"]["engine"] == "vllm"
    records = read_records(exp / "metrics.jsonl")
    train = merge_by_step(r for r in records if r["kind"] == "train")
    assert sorted(train) == [1, 2, 3, 4]
    vals = {p.name: json.loads(p.read_text()) for p in (exp / "val").glob("step_*.json")}
    assert sorted(vals) == ["step_000000.json", "step_000002.json", "step_000004.json"]
    assert (exp / "report" / "report.html").is_file()

    hf_cfg = make_experiment(demo_base, tmp_path / "hf")
    hf_trainer = GRPOTrainer(hf_cfg)
    hf_trainer.load(0)
    hf_keys = set(hf_trainer.step(1))
    for step, record in train.items():  # segment ends (2, 4) also carry the segment job's phases
        extra = set(record) - hf_keys
        assert hf_keys <= set(record) and all(k.startswith("timing_s/") and step in (2, 4) for k in extra), (step, extra)
    hf_val = evaluate(hf_cfg, 0, model=hf_trainer.policy)
    assert all(set(v) == set(hf_val) for v in vals.values())
