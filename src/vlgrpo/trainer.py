"""GRPO training, one segment at a time.

The algorithm as implemented, one step k (EasyR1's order and metric names):
  1. batch: rollout.batch_size prompts from a permutation of the filtered train split seeded by
     (seed, epoch); drop_last. Step k is a pure function of k. With online filtering (or
     data.mini_rollout_batch_size) the batch fills in tries (make_batch), try t's prompts a pure
     function of (seed, k, t).
  2. gen: rollout.n samples per prompt (temperature, top_p), each sample's randomness keyed by
     (seed, k, prompt index, sample index); responses up to data.max_response_length tokens. remax
     adds a greedy response per prompt, its reward the baseline.
  3. reward: the configured grading function (overall = format_weight * format + rest * accuracy).
  4. old: log-probs of the responses under the current policy (no grad), micro-batched.
  5. ref: log-probs under the frozen reference model (the base model), unless algorithm.disable_kl.
  6. adv: token-level rewards (the score on the last token, minus kl_coef x KL with KL in the
     reward), then algorithm.adv_estimator (vlgrpo.estimators).
  7. update_actor: for each mini-batch of actor.global_batch_size prompts (x n samples), micro-batches
     accumulate gradients of the loss_type's pg_loss (+ kl_coef * kl_loss with use_kl_loss), each normalised by the whole mini-batch's
     token count (token mode) so the sum is exactly the mini-batch token mean; clip the gradient norm;
     AdamW step, skipped (and counted) if the norm is not finite.
A segment resumes from the store's latest checkpoint, runs steps up to its end step, saves a
checkpoint and writes its marker last.

Under torchrun (trainer.n_gpus_per_node x nnodes > 1; vlgrpo.distributed) every rank runs this: it
generates for its share of the prompts (gathered, so rewards and advantages see the whole batch),
computes old and ref log-probs and gradients for its rows of each mini-batch (split by token count),
the loss normalised by the whole mini-batch's tokens; policy and reference are sharded with FSDP2.
Each rank writes its own rows of a checkpoint (vlgrpo.checkpoint); only rank 0 writes metrics,
W&B, validation files and the marker.

Launch: `vlgrpo train --config results/<exp>/config.resolved.yaml --end-step N` (the rule
train_segment does this); it runs this module (under torchrun for several processes) under a
heartbeat watchdog.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vlgrpo import config as config_lib
from vlgrpo import atomic, clock, distributed, estimators, evaluate, failures, grpo, locks, lora, metrics, models, paths, plan, val_results
from vlgrpo.batch import PromptBatch, to_device
from vlgrpo.checkpoint import CheckpointStore, PendingSave, apply_retention, run_behind
from vlgrpo.data.filtering import load_filtered
from vlgrpo.data.sources import load_processor
from vlgrpo.errors import VlgrpoError
from vlgrpo.optim import build_optimizer, lr_at
from vlgrpo.policy import ForwardOptions, load_pretrained, micro_batches, prepare_model, resolve_device, response_logprobs
from vlgrpo.rewards import reward_file_digest, reward_from_config
from vlgrpo.rollout import SamplingParams, make_engine
from vlgrpo.rollout.graded import Graded, concat_rollouts, encode_batch, generate_and_grade, select_rollout
from vlgrpo.rollout.sampling import sample_key
from vlgrpo.tracking import Tracker, read_metrics

log = logging.getLogger("vlgrpo.trainer")
TRY_STREAM = 0x7E1  # keys the permutation that tries after a step's first take their prompts from


class NonFiniteError(VlgrpoError, RuntimeError):
    pass


def training_hash(cfg: dict) -> str:
    """Hash of everything that changes what training computes (not max_steps, logging, retention)."""
    return config_lib.config_hash({k: cfg[k] for k in config_lib.TRAIN_KEYS})


@contextlib.contextmanager
def timer(timing: dict, name: str):
    start = time.perf_counter()
    with torch.profiler.record_function(name):  # a phase's range in a profile (vlgrpo bench --profile)
        yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start  # a phase timed in parts adds up
    log.debug("%s: %.2f s", name, timing[name])  # the benchmark shows these as they happen


class Heartbeat:
    """Touches a file at most once a second; the watchdog kills a segment whose file goes stale."""

    def __init__(self, path: Path | None):
        self.path, self.last = path, 0.0

    def beat(self) -> None:
        if self.path is not None and time.monotonic() - self.last > 1.0:
            self.path.touch()
            self.last = time.monotonic()


class Faults:
    """Fault injection for tests, from VLGRPO_FAULT="kind@step[,kind@step]" (kinds: kill, stall,
    nonfinite, kill_in_save). With VLGRPO_FAULT_ONCE=<file>, faults fire only while that file does
    not exist, and the first one to fire creates it. With VLGRPO_FAULT_RANK=r, only on rank r."""

    def __init__(self):
        spec = os.environ.get("VLGRPO_FAULT", "")
        self.at = {(kind, int(step)) for kind, step in (item.split("@") for item in spec.split(",") if item)}
        self.once = os.environ.get("VLGRPO_FAULT_ONCE")
        self.rank = os.environ.get("VLGRPO_FAULT_RANK")

    def fires(self, kind: str, step: int) -> bool:
        if (kind, step) not in self.at or (self.once and Path(self.once).exists()):
            return False
        if self.rank is not None and int(self.rank) != distributed.rank():
            return False
        if self.once:
            Path(self.once).touch()
        log.warning("fault injection: %s at step %d", kind, step)
        return True




class GRPOTrainer:
    def __init__(self, cfg: dict, heartbeat: Heartbeat | None = None):
        self.device = distributed.init(resolve_device(cfg["trainer"]["device"]))
        self.settings = cfg  # as config.resolved.yaml holds them (`auto` kept), which validations are keyed on
        self.cfg = cfg = config_lib.for_device(cfg, self.device, models.family_of(cfg["model"]["path"]))
        self.exp_dir = config_lib.experiment_dir(cfg)
        self.heartbeat = heartbeat or Heartbeat(None)
        self.faults = Faults()
        self.processor = load_processor(cfg["model"]["path"])
        self.rows = load_filtered(paths.path(paths.FILTERED, self.exp_dir, split="train"))
        self.batch_size = cfg["worker"]["rollout"]["batch_size"]
        self.steps_per_epoch = len(self.rows) // self.batch_size
        self.total_steps = plan.total_steps(cfg, self.steps_per_epoch)
        self.reward_fn = reward_from_config(cfg, [r["answer"] for r in self.rows[:8]])  # stops here if it breaks the contract
        self.store = CheckpointStore(paths.path(paths.CHECKPOINTS, self.exp_dir))
        self.policy = self.ref = self.optimizer = self.engine = None
        self.lora_info: dict | None = None
        self.forward, self.update_forward = ForwardOptions.from_config(cfg), ForwardOptions.from_config(cfg, update=True)
        self.nonfinite_in_a_row = 0
        algorithm = cfg["algorithm"]
        # None: no KL; "loss": a loss term; "reward": in the reward, with the controller's coefficient (checkpointed).
        self.kl_mode = None if algorithm["disable_kl"] else "loss" if algorithm["use_kl_loss"] else "reward"
        self.kl_coef = algorithm["kl_coef"]
        # KL in the reward needs every old log-prob before the update: the update cannot supply the first mini-batch's.
        self.old_from_update = cfg["worker"]["actor"]["old_logprobs_from_update"] and self.kl_mode != "reward"
        if cfg["worker"]["actor"]["old_logprobs_from_update"] and not self.old_from_update:
            log.info("old_logprobs_from_update is off: KL in the reward needs all old log-probs before the update")
        self.parts: list[list[list[int]]] = []  # per mini-batch, each rank's rows (set each step)

    # --- data ------------------------------------------------------------------------------
    def data_seed(self) -> int:
        """The seed of data order and tries: data.seed, or the run's seed when it is null (EasyR1's)."""
        return self.cfg["seed"] if self.cfg["data"]["seed"] is None else self.cfg["data"]["seed"]

    def batch_indices(self, step: int, size: int | None = None) -> list[int]:
        """Rows of the filtered train split used at `step` (1-based): a pure function of (seed, step).

        size: prompts per step (default rollout.batch_size); epochs hold len(rows) // size steps.
        data.shuffle: a permutation per epoch seeded by (data seed, epoch); else file order."""
        size = size or self.batch_size
        epoch, position = divmod(step - 1, len(self.rows) // size)
        generator = torch.Generator().manual_seed(sample_key(self.data_seed(), epoch))
        shuffle = self.cfg["data"]["shuffle"]
        order = torch.randperm(len(self.rows), generator=generator) if shuffle else torch.arange(len(self.rows))
        return order[position * size : (position + 1) * size].tolist()

    def try_indices(self, step: int, attempt: int) -> list[int]:
        """Rows tried at `attempt` (1-based) of `step` when the batch fills in tries: a pure function of
        (seed, step, attempt), so a resumed run tries what the uninterrupted one tried.

        Attempt 1 is the step's place in the epoch walk, in blocks of data.mini_rollout_batch_size;
        later attempts take the next blocks of a permutation keyed by (seed, step) of the other rows
        (no prompt twice in a step). Empty when the step has tried every row."""
        size = self.cfg["data"]["mini_rollout_batch_size"] or self.batch_size
        first = self.batch_indices(step, size)
        if attempt == 1:
            return first
        generator = torch.Generator().manual_seed(sample_key(self.data_seed(), TRY_STREAM, step))
        taken = set(first)
        rest = [i for i in torch.randperm(len(self.rows), generator=generator).tolist() if i not in taken]
        return rest[(attempt - 2) * size : (attempt - 1) * size]

    # --- state -----------------------------------------------------------------------------
    def _build(self, base=None) -> None:
        """Policy, reference and optimizer from the base model, read once: the reference is a copy.

        base: an in-memory base model used instead of model.path (the benchmark's random weights).
        """
        model_cfg = self.cfg["model"]
        base = load_pretrained(model_cfg["path"], model_cfg, self.device) if base is None else base
        # Under torchrun (even with one rank: the path a GPU run compares with one process) both are sharded.
        shard = (lambda m: distributed.shard(m, self.device, self.cfg["trainer"]["fsdp_cpu_offload"])) \
            if distributed.launched() else (lambda m: m)
        kl = self.kl_mode is not None  # KL as a loss or in the reward (kl_coef 0 still logs it, as EasyR1)
        if kl and not lora.enabled(self.cfg):
            self.ref = shard(prepare_model(copy.deepcopy(base), model_cfg, self.device, trainable=False))
        if lora.enabled(self.cfg):
            base = lora.add_adapters(base, self.cfg)
        self.policy = shard(prepare_model(base, model_cfg, self.device, trainable=True))
        if kl and lora.enabled(self.cfg):
            self.ref = self.policy  # with its adapters disabled (step): the base model, no second copy
        if lora.enabled(self.cfg):  # the report states these (the segment's marker carries them)
            self.lora_info = {**lora.settings(self.cfg), **lora.counts(self.policy)}
            log.info("LoRA: %s", self.lora_info)
        self.optimizer = build_optimizer(self.cfg, self.policy)

    def _make_engine(self) -> None:
        rollout = self.cfg["worker"]["rollout"]
        self.engine = make_engine(rollout["engine"], self.policy, self.processor, rollout["cuda_graph"], self.cfg,
                                  widest_prompt=max(row["prompt_length"] for row in self.rows))

    def load(self, step: int, base=None) -> None:
        """Policy, reference, optimizer and rollout engine, resumed from checkpoint `step` (0 = base)."""
        if base is not None and step:
            raise ValueError("an in-memory base model only starts a run (step 0)")
        self._build(base)
        if step:
            self.store.load(step, self.policy, self.optimizer)
        self._make_engine()

    def resume(self, upto: int, timing: dict) -> tuple[int, dict]:
        """Build the models and load the newest intact checkpoint at most `upto` (a corrupt one is
        refused and the one before it used); (step, its state), (0, {}) for a fresh start."""
        with timer(timing, "build_model"):
            self._build()
        self.heartbeat.beat()
        with timer(timing, "load_checkpoint"):
            start, state = self.store.restore(self.policy, self.optimizer, upto)
        self.kl_coef = state.get("kl_coef", self.kl_coef)  # the in-reward KL controller's, as the step left it
        self._make_engine()
        return start, state

    def save(self, step: int, run_id: str) -> PendingSave:
        """Start saving checkpoint `step` (CheckpointStore.save_behind): the model and optimizer stay
        unchanged until it is done."""
        epoch, position = divmod(step, self.steps_per_epoch)
        state = {
            "config_hash": training_hash(self.cfg),
            "data_position": {"epoch": epoch, "batch_in_epoch": position, "steps_per_epoch": self.steps_per_epoch},
            "wandb_run_id": run_id,
            "kl_coef": self.kl_coef,
        }
        kill = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if self.faults.fires("kill_in_save", step) else None
        return self.store.save_behind(step, self.policy, self.optimizer, self.processor, state, kill)

    def validate(self, step: int) -> dict | None:
        """Validate checkpoint `step` with the policy in memory (as the evaluate rule would, written
        aside for it to adopt); None if validation failed: the checkpoint stands, the rule validates it.
        A segment's last act: the reference model and the gradients are freed first, for generation's
        memory (the optimizer state stays: the checkpoint being written behind reads it)."""
        self.ref = None
        self.optimizer.zero_grad(set_to_none=True)
        try:
            return evaluate.evaluate(self.settings, step, model=self.policy, engine=self.engine, in_process=True)
        except Exception:
            log.exception("in-process validation of step %d failed; the evaluate rule will validate it", step)
            return None
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # --- one step --------------------------------------------------------------------------
    def _micro_batches(self, prompts: PromptBatch, mask, rows: list[int], micro: int) -> list[list[int]]:
        return micro_batches(prompts, mask, rows, micro, self.cfg["worker"]["actor"]["dynamic_batching"])

    def _logprobs(self, model, prompts: PromptBatch, responses, mask, micro: int, rows: list[int] | None = None) -> torch.Tensor:
        """(N, R) float32 log-probs of the responses under `model` (no grad); only `rows` if given, zeros elsewhere.

        Several ranks: each computes its rows of the step's split (self.parts); the sum over ranks is the whole."""
        temperature = self.cfg["worker"]["rollout"]["temperature"]
        rows = list(range(len(prompts))) if rows is None else rows
        if distributed.world() > 1:
            mine = {i for part in self.parts for i in part[distributed.rank()]}
            rows = [i for i in rows if i in mine]
        out = torch.zeros(responses.shape, dtype=torch.float32, device=model.device)  # one copy back, at the end
        with torch.no_grad():
            for batch, real in distributed.padded(self._micro_batches(prompts, mask, rows, micro), [0]):
                logp = response_logprobs(model, prompts.select(batch), responses[batch], mask[batch], temperature, self.forward)
                if real:
                    out.index_copy_(0, to_device(torch.tensor(batch), out.device), logp)
                self.heartbeat.beat()
        return distributed.all_reduce(out.cpu())

    def make_batch(self, step: int, params: SamplingParams) -> tuple[list[dict], PromptBatch, object, object, dict, dict]:
        """The step's rows (prompts), their encoding (N rows), rollout, grading (result(): scores,
        errors), timing and batch metrics.

        One try of the step's rollout.batch_size prompts, graded while old and ref run; or, with
        algorithm.online_filtering or a smaller data.mini_rollout_batch_size, tries (try_indices) as
        EasyR1's _make_batch_data: each try's groups whose mean filter_key lies strictly between
        filter_low and filter_high are kept (all without filtering) until rollout.batch_size prompts
        are, then the first rollout.batch_size. reward/* then covers every graded sample of the step,
        as EasyR1's; batch/num_try_make_batch counts the tries.
        """
        cfg, algorithm, n = self.cfg, self.cfg["algorithm"], self.cfg["worker"]["rollout"]["n"]
        size = cfg["data"]["mini_rollout_batch_size"] or self.batch_size
        filtering = algorithm["online_filtering"]

        def generate(rows):
            return generate_and_grade(self.engine, self.processor, rows, n, (cfg["seed"], step), params, len(rows) * n,
                                      self.reward_fn, self.device)

        if not filtering and size >= self.batch_size:
            rows = [self.rows[i] for i in self.batch_indices(step)]
            prompts, out, grading, gen_timing = generate(rows)
            return rows, prompts, out, grading, gen_timing, {}
        kept_rows, kept_out, kept_scores, every_score, errors = [], [], [], [], 0
        timing = {"encode": 0.0, "generation": 0.0, "grading": 0.0}
        limit, attempt = cfg["trainer"]["max_try_make_batch"], 0
        while len(kept_rows) < self.batch_size:
            attempt += 1
            if 0 < limit < attempt:
                raise VlgrpoError(
                    f"step {step}: {len(kept_rows)} of {self.batch_size} prompts kept after trainer.max_try_make_batch="
                    f"{limit} tries of {size}; widen algorithm.filter_low/filter_high or raise max_try_make_batch"
                )
            rows = [self.rows[i] for i in self.try_indices(step, attempt)]
            if not rows:
                raise VlgrpoError(f"step {step}: every training prompt was tried and only {len(kept_rows)} of "
                                  f"{self.batch_size} were kept; widen algorithm.filter_low/filter_high")
            _, out, grading, part = generate(rows)
            waited = time.perf_counter()
            scores, try_errors = grading.result()
            timing = {k: timing[k] + part[k] for k in timing}
            timing["grading"] += time.perf_counter() - waited
            every_score += scores
            errors += try_errors
            keep = [True] * len(rows)
            if filtering:
                key = algorithm["filter_key"]
                if key not in scores[0]:
                    raise VlgrpoError(f"algorithm.filter_key {key!r} is not in the reward's results (keys: {', '.join(scores[0])})")
                keep = estimators.kept_groups(torch.tensor([s[key] for s in scores]), n,
                                              algorithm["filter_low"], algorithm["filter_high"]).tolist()
            chosen = [g for g, k in enumerate(keep) if k][: self.batch_size - len(kept_rows)]
            members = [g * n + j for g in chosen for j in range(n)]
            kept_rows += [rows[g] for g in chosen]
            kept_out.append(select_rollout(out, members))
            kept_scores += [scores[i] for i in members]
            self.heartbeat.beat()
        started = time.perf_counter()
        prompts = encode_batch(self.processor, kept_rows, n, self.device)  # one padding for the whole batch
        timing["encode"] += time.perf_counter() - started
        out = concat_rollouts(kept_out, models.tokenizer(self.processor).pad_token_id)
        info = {"batch/num_try_make_batch": attempt, "batch/num_prompts_tried": len(every_score) // n,
                **{f"reward/{k}": sum(s[k] for s in every_score) / len(every_score) for k in ("overall", "format", "accuracy")}}
        return kept_rows, prompts, out, Graded(kept_scores, errors), timing, info

    def remax_baselines(self, step: int, rows: list[dict], params: SamplingParams) -> tuple[torch.Tensor, dict]:
        """ReMax's baselines: the overall reward of one greedy response to each of the step's prompts
        (the same engine), (N,) in batch order (each prompt's n times), and that rollout's timing."""
        greedy = SamplingParams(0.0, 1.0, params.max_tokens, params.ignore_eos)
        _, _, grading, timing = generate_and_grade(self.engine, self.processor, rows, 1, (self.cfg["seed"], step), greedy,
                                                   len(rows), self.reward_fn, self.device)
        waited = time.perf_counter()
        scores, _ = grading.result()
        timing["grading"] += time.perf_counter() - waited
        n = self.cfg["worker"]["rollout"]["n"]
        return torch.tensor([s["overall"] for s in scores], dtype=torch.float32).repeat_interleave(n), timing

    def step(self, step: int) -> dict:
        cfg, rollout_cfg, actor, algorithm = self.cfg, self.cfg["worker"]["rollout"], self.cfg["worker"]["actor"], self.cfg["algorithm"]
        if self.faults.fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.fires("stall", step):
            while True:
                time.sleep(60)
        n, timing = rollout_cfg["n"], {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
        step_start, captures = time.perf_counter(), getattr(self.engine, "captures", 0)
        params = SamplingParams(
            rollout_cfg["temperature"], rollout_cfg["top_p"], cfg["data"]["max_response_length"], rollout_cfg["ignore_eos"],
            rollout_cfg["top_k"], cfg["worker"]["reward"]["skip_special_tokens"],
        )
        # Grading runs on other CPU cores while old and ref run; `reward` is the time the step waits for it.
        with torch.profiler.record_function("gen"):  # timed by its parts (encode, generation)
            rows, prompts, out, grading, gen_timing, batch_info = self.make_batch(step, params)
        timing["gen"], reward_s = gen_timing["encode"] + gen_timing["generation"], gen_timing["grading"]
        baselines = None
        if algorithm["adv_estimator"] == "remax":
            baselines, remax_timing = self.remax_baselines(step, rows, params)
            timing["gen"] += remax_timing["encode"] + remax_timing["generation"]
            reward_s += remax_timing["grading"]
        self.heartbeat.beat()
        seqlens = (out.lengths + prompts.attention_mask.sum(-1)).tolist()  # (N,) prompt + response tokens, batch order
        mini = actor["global_batch_size"] * n
        self.parts = [distributed.balanced_split(list(range(s, min(s + mini, len(prompts)))), seqlens, distributed.world())
                      for s in range(0, len(prompts), mini)]
        micro = actor["micro_batch_size_per_device_for_experience"]
        with timer(timing, "old"):  # the update fills the rows it computes itself (old_logprobs_from_update)
            first = actor["global_batch_size"] * n if self.old_from_update else 0
            old_logp = self._logprobs(self.policy, prompts, out.responses, out.response_mask, micro, list(range(first, len(prompts))))
        ref_logp = None
        if self.ref is not None:
            with timer(timing, "ref"):
                with lora.adapters_disabled(self.ref):  # LoRA: the policy without its adapters
                    ref_logp = self._logprobs(self.ref, prompts, out.responses, out.response_mask, micro)
        with timer(timing, "reward"):
            scores, reward_errors = grading.result()
            overall = torch.tensor([s["overall"] for s in scores], dtype=torch.float32)
        timing["reward"] += reward_s
        kl_metrics = {}
        with timer(timing, "adv"):
            mask = out.response_mask.float()
            token_rewards = estimators.token_level_scores(overall, mask)  # (N, R)
            if self.kl_mode == "reward":
                token_rewards, current_kl = estimators.kl_in_reward(
                    token_rewards, old_logp, ref_logp, mask, self.kl_coef, algorithm["kl_penalty"])
                kl_metrics = {"actor/kl_penalty": current_kl, "actor/kl_coef": self.kl_coef}
                if algorithm["kl_type"] == "adaptive":
                    self.kl_coef = estimators.adaptive_kl_coef(self.kl_coef, current_kl, len(overall),
                                                               algorithm["kl_target"], algorithm["kl_horizon"])
            advantages, returns = estimators.compute_advantages(
                algorithm["adv_estimator"], token_rewards, mask, n, algorithm["gamma"], baselines)
        with timer(timing, "update_actor"):
            update = self.update_actor(step, prompts, out, old_logp, ref_logp, advantages)
        timing["step"] = time.perf_counter() - step_start

        lengths, prompt_lengths = out.lengths, prompts.attention_mask.sum(-1)
        response_tokens, total_tokens = int(lengths.sum()), sum(seqlens)
        world, groups = metrics.world_size(), overall.view(-1, n)
        per_rank = [[i for part in self.parts for i in part[r]] for r in range(world)]  # the rows each rank updated
        record = {
            "step": step,
            **{f"reward/{k}": sum(s[k] for s in scores) / len(scores) for k in scores[0]},  # every key the reward returns, as EasyR1
            "reward/errors": reward_errors,
            **batch_info,
            **update,
            **kl_metrics,
            **metrics.data_metrics(overall, (token_rewards * mask).sum(-1), advantages, out.response_mask, returns),
            "critic/zero_adv_group_frac": (groups.max(1).values == groups.min(1).values).float().mean().item(),
            **metrics.length_metrics("response_length", lengths, cfg["data"]["max_response_length"]),
            **metrics.length_metrics("prompt_length", prompt_lengths, cfg["data"]["max_prompt_length"]),
            **metrics.seqlen_metrics(seqlens, per_rank, world=world),
            **metrics.timing_metrics(timing, response_tokens, total_tokens),
            **metrics.throughput_metrics(total_tokens, timing["step"], world),
            "perf/mfu_actor": metrics.mfu(
                metrics.actor_flops(self.policy.config.get_text_config(), seqlens), timing["update_actor"],
                actor["ppo_epochs"], metrics.peak_tflops(self.device), world,
            ),
            **distributed.over_ranks(metrics.memory_metrics(self.device), torch.distributed.ReduceOp.MAX),  # the largest rank's
        }
        record["actor/entropy_loss"] = grpo.entropy_from_logp(old_logp, out.response_mask.float()).item()
        if self.device.type == "cuda":
            allocator = torch.cuda.memory_stats()  # this step's: cudaMalloc calls, flush-and-retry events
            record.update(distributed.over_ranks({"perf/cuda_malloc_calls": allocator.get("num_device_alloc", 0),
                                                  "perf/cuda_alloc_retries": allocator.get("num_alloc_retries", 0),
                                                  # decode steps the static engine captured as CUDA graphs in this step
                                                  "perf/cuda_graph_captures": getattr(self.engine, "captures", 0) - captures},
                                                 torch.distributed.ReduceOp.MAX))
        return record

    def update_actor(self, step, prompts: PromptBatch, out, old_logp, ref_logp, advantages) -> dict:
        """PPO epochs over mini-batches of global_batch_size prompts; returns averaged actor metrics.

        With actor.old_logprobs_from_update, the first mini-batch of the first epoch takes its old
        log-probs from its own forward (the policy has not changed yet) and writes them into old_logp.
        Several ranks: each runs its rows of each mini-batch (self.parts), as many micro-batches as the
        others (zero-weight fillers); the loss is normalised by the whole mini-batch, so the sum of the
        ranks' gradients is the mini-batch's (FSDP averages: the loss is scaled by the world size).
        """
        cfg, actor, algorithm = self.cfg, self.cfg["worker"]["actor"], self.cfg["algorithm"]
        temperature = cfg["worker"]["rollout"]["temperature"]
        n, mode = cfg["worker"]["rollout"]["n"], actor["loss_avg_mode"]
        mini, micro = actor["global_batch_size"] * n, actor["micro_batch_size_per_device_for_update"]
        lr = lr_at(cfg, step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        params = [p for p in self.policy.parameters() if p.requires_grad]
        sums, updates, skipped, norms = defaultdict(float), 0, 0, 0.0
        world, rank = distributed.world(), distributed.rank()
        scale = float(world) if distributed.is_sharded(self.policy) else 1.0
        # The step's tensors go to the device once; metrics stay there until the end (no wait per micro-batch).
        dev = self.policy.device
        old_d, adv_d, mask_d = to_device(old_logp, dev), to_device(advantages, dev), to_device(out.response_mask, dev)
        if self.kl_mode == "loss" and ref_logp is None:
            raise ValueError("update_actor: the KL loss (algorithm.use_kl_loss) needs ref_logp, the reference model's (N, R) log-probs")
        ref_d = None if ref_logp is None else to_device(ref_logp, dev)
        self.policy.train()
        for epoch in range(actor["ppo_epochs"]):
            for index_mb, start in enumerate(range(0, len(prompts), mini)):
                on_policy = self.old_from_update and epoch == 0 and start == 0
                mini_rows = list(range(start, min(start + mini, len(prompts))))
                mask = out.response_mask[mini_rows].float()
                denominator = float(mask.sum()) if mode == "token" else float(len(mini_rows))
                self.optimizer.zero_grad(set_to_none=True)
                mine = self.parts[index_mb][rank] if world > 1 else mini_rows
                for rows, real in distributed.padded(self._micro_batches(prompts, out.response_mask, mine, micro), mini_rows[:1]):
                    logp = response_logprobs(
                        self.policy, prompts.select(rows), out.responses[rows], out.response_mask[rows], temperature, self.update_forward
                    )
                    index = to_device(torch.tensor(rows), dev)
                    rmask = mask_d.index_select(0, index).float()
                    if on_policy and real:
                        old_d.index_copy_(0, index, logp.detach())
                    loss, metrics = grpo.policy_loss(
                        logp, old_d.index_select(0, index), adv_d.index_select(0, index), rmask,
                        actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_dual"],
                        mode, denominator, actor["loss_type"], actor["tau_positive"], actor["tau_negative"],
                    )
                    if self.kl_mode == "loss":
                        kl = grpo.aggregate(
                            grpo.kl_penalty(logp, ref_d.index_select(0, index), algorithm["kl_penalty"]), rmask, mode, denominator
                        )
                        loss = loss + algorithm["kl_coef"] * kl
                        metrics["kl_loss"] = kl.detach()
                    if self.faults.fires("nonfinite", step):
                        loss = loss * float("nan")
                    weight = 1.0 if real else 0.0  # a filler keeps the collectives in step and adds nothing
                    (loss * (weight * scale)).backward()
                    for key, value in metrics.items():
                        sums[key] = sums[key] + weight * (value.detach().double() if torch.is_tensor(value) else float(value))
                    self.heartbeat.beat()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, actor["max_grad_norm"])
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # the global norm
                norms += grad_norm
                updates += 1
                if torch.isfinite(torch.tensor(grad_norm)):
                    self.optimizer.step()
                    self.nonfinite_in_a_row = 0
                else:
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    self.nonfinite_in_a_row += 1
                    log.error("step %d: non-finite gradient norm, update skipped", step)
                    if self.nonfinite_in_a_row >= cfg["trainer"]["max_nonfinite_steps"]:
                        raise NonFiniteError(
                            f"{self.nonfinite_in_a_row} non-finite updates in a row (trainer.max_nonfinite_steps="
                            f"{cfg['trainer']['max_nonfinite_steps']}); the segment stops here"
                        )
        self.policy.eval()
        if self.old_from_update:
            old_logp[:mini] = distributed.all_reduce(old_d[:mini].cpu())  # each rank filled its rows
        # Micro-batch metrics were normalised by the mini-batch: their sum (over ranks too) is the mini-batch value.
        sums = distributed.over_ranks({k: float(v) for k, v in sums.items()})  # one wait for the device, here
        sums["grad_norm"] = norms  # already global
        record = {f"actor/{k}": v / updates for k, v in sums.items()}
        record["actor/lr"] = lr
        if self.kl_mode == "loss":
            record["actor/kl_coef"] = algorithm["kl_coef"]
        record["actor/nonfinite_skipped"] = skipped
        return record


def run_segment(cfg: dict, end_step: int, marker: Path, heartbeat: Heartbeat | None = None) -> dict:
    """_run_segment while rank 0 holds the experiment's trainer lock: one trainer at a time
    (vlgrpo.locks; a second one waits for the first to end, then fails naming it)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with locks.trainer_lock(config_lib.experiment_dir(cfg), end_step) if rank0 else contextlib.nullcontext():
        return _run_segment(cfg, end_step, marker, heartbeat)


def _run_segment(cfg: dict, end_step: int, marker: Path, heartbeat: Heartbeat | None = None) -> dict:
    """Train from the latest checkpoint to `end_step`, save a checkpoint there, validate it in-process
    if it is on the validation grid, write the marker last. Retention (apply_retention) runs behind the
    training, and on the run's last segment once more after its save.

    The job's phases go to the marker and, as timing_s/*, into end_step's record in metrics.jsonl:
    startup (job start to model build: interpreter, imports, data), build_model, load_checkpoint,
    train, save_checkpoint, validation, prune (the last segment's retention).
    """
    job_start = float(os.environ.get("VLGRPO_JOB_START") or clock.process_start())
    times: dict[str, float] = {}
    trainer = GRPOTrainer(cfg, heartbeat)
    rank0 = distributed.is_rank0()  # the only writer of metrics, W&B, retention and the marker
    if end_step > trainer.total_steps:
        raise ValueError(f"end step {end_step} is past the run's last step {trainer.total_steps}")
    start = trainer.store.latest() or 0
    validation = None
    tracker = None
    if start < end_step:
        times["startup"] = time.time() - job_start
        log.info("startup %.1f s (job start to data and processor ready); %s", times["startup"],
                 f"{distributed.world()} rank(s) under torchrun" if distributed.launched() else "one process")
        start, state = trainer.resume(end_step, times)
        if start and state["config_hash"] != training_hash(trainer.cfg):
            raise config_lib.ConfigError(
                f"checkpoint {trainer.store.path(start)} was made with a different training config; "
                f"use a new experiment name, or delete {trainer.store.root} to start over"
            )
        tracker = Tracker(cfg, trainer.exp_dir) if rank0 else None
        trainer.heartbeat.beat()

        def retain():
            apply_retention(cfg, trainer.total_steps, lambda s: val_results.is_validated(cfg, s))

        # What the last segment's checkpoint put beyond trainer.keep_checkpoints is deleted while this one
        # trains, when the disk is idle: deleting a 30 GB checkpoint took an H100 host's disk 6.7 s.
        pruning = run_behind(retain, "retention") if rank0 else None
        with timer(times, "train"):
            for step in tqdm(range(start + 1, end_step + 1), desc=f"segment to {end_step}", initial=start, total=end_step,
                             disable=not rank0):
                record = trainer.step(step)
                if rank0:
                    tracker.log(record)
                trainer.heartbeat.beat()
        if pruning is not None:
            try:  # done before the save: its writes have the disk to themselves
                pruning.result()
            except Exception as e:  # housekeeping: the steps trained are saved all the same
                log.warning("retention failed (%s: %s); the next segment's retention tries again", type(e).__name__, e)
        # The checkpoint is written behind the validation, which only reads the model; its time is
        # what the segment waits for it (timing_s/save_checkpoint_behind: the whole write).
        with timer(times, "save_checkpoint"):
            saving = trainer.save(end_step, tracker.run_id if rank0 else "")
        trainer.heartbeat.beat()
        if end_step in plan.validation_steps(cfg, trainer.total_steps):
            with timer(times, "validation"):
                validation = trainer.validate(end_step)
            trainer.heartbeat.beat()
        with timer(times, "save_checkpoint"):
            saving.result()
        times["save_checkpoint_behind"] = saving.seconds
        if rank0 and end_step == trainer.total_steps:
            with timer(times, "prune"):  # the run's last segment: no later one trains behind it
                retain()
        if rank0 and lora.enabled(trainer.cfg) and (end_step == trainer.total_steps or cfg["trainer"]["export_merged"]):
            with timer(times, "export_merged"):  # the final step's (or every, on request) merged model
                lora.export_merged(trainer.cfg["model"], trainer.store.model_dir(end_step),
                                   paths.path(paths.MERGED, trainer.exp_dir, step=end_step), trainer.processor)
        if rank0:
            parts = {} if validation is None else {f"validation_{k.split('/')[1]}": validation[k] for k in
                                                   ("timing_s/encode", "timing_s/generation", "timing_s/scoring")}
            tracker.add_timings(end_step, {**times, **parts})
    else:
        log.info("checkpoint %d already covers step %d: nothing to train", start, end_step)
    if tracker is not None:
        tracker.close()
    if not rank0:
        return {}
    last = next((r for r in read_metrics(paths.path(paths.METRICS, trainer.exp_dir)) if r["step"] == end_step), {})
    summary = {k: last[k] for k in ("reward/overall", "reward/format", "reward/accuracy", "actor/kl_loss") if k in last}
    out = {
        "end_step": end_step,
        "start_step": start,
        "checkpoint": str(trainer.store.path(end_step)),
        "config_hash": training_hash(trainer.cfg),
        "reward_sha256": reward_file_digest(cfg["worker"]["reward"]["reward_function"]),  # a later run tells a change
        "metrics": summary,
        "validated_in_process": validation is not None,
        **({"lora": trainer.lora_info} if trainer.lora_info else {}),
        "timing_s": times,
        "job_start": job_start,
        "job_end": time.time(),
    }
    atomic.write_json(marker, out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlgrpo.trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="results/<exp>/config.resolved.yaml")
    parser.add_argument("--end-step", type=int, required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--heartbeat")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    locks.exit_with_watchdog()  # a trainer whose `vlgrpo train` was killed stops too
    cfg = config_lib.read_resolved(args.config)
    # Rank 0 beats for all: a rank that hangs stops rank 0 at its next collective, so the beat goes stale.
    rank0 = int(os.environ.get("RANK", "0")) == 0
    heartbeat = Heartbeat(Path(args.heartbeat) if args.heartbeat and rank0 else None)
    heartbeat.beat()  # imports are done
    if "VLGRPO_JOB_START" in os.environ:  # the first part of timing_s/startup
        log.info("imports done %.1f s after the job started", time.time() - float(os.environ["VLGRPO_JOB_START"]))
    try:
        run_segment(cfg, args.end_step, Path(args.marker), heartbeat)
    except failures.USER_ERRORS as error:  # fails once, with one line (vlgrpo.failures)
        failures.exit_on_user_error(config_lib.experiment_dir(cfg), f"train_{paths.step_str(args.end_step)}", "vlgrpo train", error)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
