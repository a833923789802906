"""Online RL (train.objective=grpo, rloo): TRL's GRPOTrainer and RLOOTrainer, whose batches are
not read from the token cache but made each step from its prompts: sampled from the policy
(cputrain.rollouts), scored by the run's reward functions, given advantages within each prompt's
group, then trained on (objectives.rl_loss).

A step's prompts are global_batch_size ÷ num_generations; each rank takes its share whole, so a
prompt's group never spans ranks and its advantages are computed where it was sampled. What spans
the global batch (scale_rewards=batch's std, RLOO's normalisation, the logged reward figures) is
one all-reduce of sums. With num_iterations μ > 1 the same rollouts train μ steps, against the
log-probabilities of the policy that sampled them (taken once, without gradients, as TRL does).

The reference (rl_beta > 0) is the model with the LoRA adapters off (the converter's reference);
with full weights it would be a frozen copy of the starting model, twice the weights' memory, and
is refused (check_reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import numpy as np
import torch

from cputrain.distributed import process_group as pg
from cputrain.errors import ConfigError
from cputrain.objectives import rl_loss
from cputrain.objectives.contract import Objective
from cputrain.objectives.rollout_batch import RolloutBatch, completion_logps, rollout_batch
from cputrain.objectives.rollout_rows import row_choice

log = logging.getLogger("cputrain")


class OnlineRlObjective(Objective):
    """What GRPO and RLOO share: the rollouts, the rewards, the batches; each says its advantages and loss."""

    data_format = "prompt"
    batches_from_rollouts = True
    logs_item_rate = False  # its items are the loss type's divisor; the step logs completions/… instead
    items_key = "completions"
    item_described = "prompt"
    names = (*rl_loss.SUM_NAMES, "reward_sum")  # the loss's sums; reward_sum: validation's rewards
    summary_figures = ("reward", "reward_std", "completions/mean_length")
    sequence_level = False  # RLOO's ratio is the completion's, GRPO's each token's
    loss_type = "grpo"  # how its summed loss is counted (rl_loss.items_of): RLOO's is a mean over completions

    def __init__(self, train_cfg=None, reference=None, chunked: bool = False):
        super().__init__(train_cfg, reference, chunked)
        self.rewards = None  # the run's reward functions (handed in by the trainer: use_rewards)
        self.generator = torch.Generator().manual_seed(0)  # the rollouts' only source of randomness
        self.pad_id = 0
        self.rollout_figures: dict[str, float] = {}  # the last rollout's reward and length figures
        self.kept: list | None = None  # num_iterations > 1: the rollouts the next steps train on again
        self.seed = 0
        self.stop_token_ids: tuple[int, ...] = ()  # EOS and a chat turn's end (use_rewards, from the tokenizer)
        self.last_samples: list[dict] = []  # the last rollout's first group, for completions.jsonl
        self.iteration = 0  # steps taken on self.kept
        self.said_rollout_path = False  # the run's log says once which rollout path sampled
        self.said_rows = False  # and once whether the training rows share each group's prompt
        self.said_skipped = False  # and once that completions of advantage 0 are left out of the rows
        self.last_advantages = torch.zeros(0)  # the last rollout's, every completion's (completions.jsonl)
        self.seq_len: int | None = None  # data.seq_len, which bounds a shared row's width (rollout_rows)
        # False where the trainer's memory plan leaves the fused decoder's copy out (an fsdp rank's whole model)
        self.fused_rollouts = True

    # ---- facts ------------------------------------------------------------------------------
    @classmethod
    def check_data(cls, data_format: str) -> None:
        if data_format != "prompt":
            raise ConfigError(f"train.objective={cls.name} samples its completions from prompts (TRL's prompt-only "
                              f"records: a `prompt` field, plain or conversational: data.format=prompt), but "
                              f"data.format is {data_format}; set data.format=prompt (or auto)")

    @classmethod
    def check_config(cls, cfg) -> None:
        train = cfg.train
        if train.global_batch_size % train.num_generations:
            raise ConfigError(f"train.global_batch_size ({train.global_batch_size}) counts completions and must be a "
                              f"multiple of train.num_generations ({train.num_generations}), each prompt's group "
                              f"whole; set train.global_batch_size="
                              f"{max(1, round(train.global_batch_size / train.num_generations)) * train.num_generations}")
        if not train.rewards:
            raise ConfigError(f"train.objective={cls.name} needs at least one reward function: set train.rewards, "
                              "e.g. [exact_answer] or ['regex:^The'] or ['my_module:my_reward']")
        if train.reward_weights is not None and len(train.reward_weights) != len(train.rewards):
            raise ConfigError(f"train.reward_weights has {len(train.reward_weights)} weight(s) for "
                              f"{len(train.rewards)} reward function(s) in train.rewards; give one weight each")
        if cfg.data.seq_len <= train.max_completion_length:
            raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) leaves no room for a prompt before "
                              f"train.max_completion_length ({train.max_completion_length}) sampled tokens; raise "
                              "data.seq_len or lower train.max_completion_length")

    @classmethod
    def check_reference(cls, cfg) -> None:
        if cfg.train.rl_beta > 0 and not cfg.model.lora.enabled:
            raise ConfigError(f"train.rl_beta={cfg.train.rl_beta} needs a reference, and with full weights that is a "
                              "frozen copy of the starting model (twice the weights' memory), which cputrain does "
                              "not keep; set model.lora.enabled=true (the reference is then the adapters off), or "
                              "train.rl_beta=0")

    @classmethod
    def rows_per_step(cls, train_cfg) -> int:
        return train_cfg.global_batch_size // train_cfg.num_generations

    # ---- the built objective ------------------------------------------------------------------
    def use_rewards(self, rewards, seed: int) -> None:
        """The run's reward functions: .names, .weights ([functions]), .tokenizer and
        .score(records, completion_ids) → [completions, functions] (built above the objectives: a
        reward model is a finished model); the sampling stops at the tokenizer's EOS and a chat
        turn's end. `seed`: this rank's (each rank samples its own prompts)."""
        self.rewards = rewards
        self.seed = seed
        self.generator.manual_seed(seed)
        tokenizer = rewards.tokenizer
        stops = {tokenizer.eos_token_id}
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            token_id = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
            if token_id is not None:
                stops.add(token_id)
        self.stop_token_ids = tuple(sorted(i for i in stops if i is not None))

    def check_rows(self, rows: list, world_size: int) -> None:
        cfg = self.cfg
        room = rows[0].seq_len - cfg.max_completion_length
        for split, split_rows in zip(("training", "validation"), rows):
            longest, row = split_rows.longest_prompt
            if longest > room:
                raise ConfigError(f"{split} prompt {row} has {longest} tokens, more than data.seq_len "
                                  f"({split_rows.seq_len}) − train.max_completion_length ({cfg.max_completion_length})"
                                  f" = {room} leave for it; raise data.seq_len, lower train.max_completion_length, or "
                                  "shorten the prompt")
        prompts = self.rows_per_step(cfg)
        if prompts % world_size:
            raise ConfigError(f"a step's {prompts} prompts (train.global_batch_size {cfg.global_batch_size} ÷ "
                              f"train.num_generations {cfg.num_generations}) do not divide among {world_size} ranks, "
                              f"each prompt's group on one rank; set train.global_batch_size to a multiple of "
                              f"{cfg.num_generations * world_size}")

    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        self.pad_id, self.seq_len = rows[0].pad_id, rows[0].seq_len

    def state_dict(self) -> dict:
        """What a resumed run needs to sample the same completions (the generator's state) and,
        stopped inside a cycle of num_iterations > 1, to train the cycle's remaining steps on the
        same rollouts: the kept micro-batches' tensors (token ids, masks, advantages, the sampling
        policy's log-probabilities; the reference's, where rl_beta > 0), the steps taken on them
        and the figures those steps log. They are kept, not re-derived: the policy that sampled
        them is gone once a step has trained, and a copy of it would cost more than its rollouts
        (a few numbers a completion token)."""
        state = {"generator": self.generator.get_state()}
        if self.kept is not None and self.iteration < self.cfg.num_iterations:
            state["kept"] = [{f.name: getattr(b, f.name) for f in dataclasses.fields(b)
                              if getattr(b, f.name) is not None} for b in self.kept]
            state["iteration"] = self.iteration
            state["rollout_figures"] = dict(self.rollout_figures)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        if "kept" in state:  # stopped inside a cycle: its remaining steps train on these rollouts
            self.kept = [RolloutBatch(**fields) for fields in state["kept"]]
            self.iteration = int(state["iteration"])
            self.rollout_figures = dict(state["rollout_figures"])

    def step_batches(self, model, rows, indices: list, micro_batch: int, autocast) -> list:
        """This rank's prompts of the step (`indices`, rows of prompts) sampled, scored and cut into
        micro-batches of `micro_batch` completions; with num_iterations > 1 the rollouts of the
        cycle's first step again."""
        cfg = self.cfg
        if self.kept is not None and self.iteration < cfg.num_iterations:
            self.iteration += 1
            return self.kept
        records = rows.prompt_records(np.concatenate(indices) if len(indices) else np.zeros(0, dtype=np.int64))
        prompt_ids = [r.ids for r in records for _ in range(cfg.num_generations)]
        with autocast():  # the precision the step's forwards run in
            rollout = self._sample(model, prompt_ids)
        scores = self.rewards.score([r for r in records for _ in range(cfg.num_generations)],
                                    rollout.completion_ids)
        batches = self.batches_from_completions(model, prompt_ids, rollout.completion_ids, scores, micro_batch,
                                                autocast, stopped=rollout.stopped)
        self.rollout_figures.update(self._rollout_speed(rollout))
        self.last_samples = self._first_group(records[0] if records else None, rollout.completion_ids, scores)
        self.kept, self.iteration = (batches, 1) if cfg.num_iterations > 1 else (None, 0)
        return batches

    def _sample(self, model, prompt_ids: list[list[int]]):
        from cputrain.rollouts.sampling import SamplingSettings, sample

        cfg = self.cfg
        settings = SamplingSettings(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k,
                                    tuple(self.stop_token_ids), self.pad_id)
        # ranks of a sharded model run the same number of decode steps (rollouts.sample)
        several = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        any_running = (lambda running: pg.all_reduce_sum([float(running)])[0] > 0) if several else None
        rollout = sample(_unwrapped(model), prompt_ids, settings, self.generator, any_running, fused=self.fused_rollouts)
        if not self.said_rollout_path:  # once a run: which path sampled, and why not the fused one
            from cputrain.rollouts.decoder_weights import why_not_fused

            why = why_not_fused(_unwrapped(model)) if self.fused_rollouts else "its copy does not fit this node"
            log.info("rollouts: %s", "the fused decoder (the policy's weights fused and cast once a rollout)"
                     if rollout.path == "fused" else f"through the model's modules ({why or 'nothing to sample'})")
            self.said_rollout_path = True
        return rollout


    def _first_group(self, record, completion_ids, scores) -> list[dict]:
        """The completions of the step's first prompt, as text, with each reward and the advantage."""
        if record is None or self.rewards is None:
            return []
        advantages = self.last_advantages.tolist()
        texts = self.rewards.tokenizer.batch_decode(completion_ids[: self.cfg.num_generations],
                                                    skip_special_tokens=True)
        return [{"prompt": record.prompt, "completion": text,
                 **{f"rewards/{name}": float(scores[i, f]) for f, name in enumerate(self.rewards.names)},
                 "advantage": advantages[i]} for i, text in enumerate(texts)]

    def samples(self) -> list[dict]:
        samples, self.last_samples = self.last_samples, []
        return samples

    def _rollout_speed(self, rollout) -> dict[str, float]:
        seconds = rollout.prefill_s + rollout.decode_s
        return {"rollout/tokens_per_s": rollout.new_tokens / max(seconds, 1e-9), "rollout/time_s": seconds}

    @torch.no_grad()
    def batches_from_completions(self, model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                                 scores: torch.Tensor, micro_batch: int, autocast,
                                 stopped: list[bool] | None = None) -> list[RolloutBatch]:
        """The micro-batches of given completions (each prompt's group side by side) and their
        rewards per function [completions, functions]: advantages, the old policy's and the
        reference's log-probabilities where the step needs them; the rollout's figures logged."""
        cfg = self.cfg
        weights = torch.as_tensor(self.rewards.weights if self.rewards is not None else [1.0] * scores.shape[1],
                                  dtype=torch.float32)
        rewards = (scores.float() * weights).sum(dim=1)
        cuts = [range(at, min(at + micro_batch, len(completion_ids))) for at in range(0, len(completion_ids), micro_batch)]
        advantages = None
        if cfg.rl_beta == 0.0:  # no KL to the reference: the advantages need no forward, and can leave completions out
            advantages = self.advantages(rewards)
            members = [_trained(cut, advantages, completion_ids) for cut in cuts]
        else:
            members = [list(cut) for cut in cuts]
        batches = [self._rollout_batch(model, prompt_ids, completion_ids, cut, kept) for cut, kept in zip(cuts, members)]
        kl = None
        with autocast():
            for batch in batches:
                if cfg.num_iterations > 1 or self.needs_old_logps():
                    batch.old_logps = completion_logps(model, batch, cfg.temperature, self.chunked)
                if cfg.rl_beta != 0.0:
                    with self.reference(_unwrapped(model)) if self.reference else contextlib.nullcontext():
                        batch.ref_logps = completion_logps(model, batch, cfg.temperature, self.chunked)
        if cfg.rl_beta != 0.0 and self.sequence_level:  # RLOO: the KL is a penalty on the reward
            kl = torch.cat([((b.old_logps - b.ref_logps) * b.completion_mask).sum(-1) for b in batches])
            rewards = rewards - cfg.rl_beta * kl
        if advantages is None:
            advantages = self.advantages(rewards)
        for batch, kept in zip(batches, members):
            batch.advantages, batch.rewards = advantages[kept], rewards[kept]
        self.last_advantages = advantages
        self.rollout_figures = self._reward_figures(scores, weights, completion_ids, stopped, batches, kl)
        skipped = sum(b.skipped_completions for b in batches)
        if skipped and not self.said_skipped:
            log.info("online RL: completions whose advantage is 0 (%d of this step's %d on this rank) are left out "
                     "of the training forward and backward: with rl_beta 0 they add nothing to the loss or its "
                     "gradient; they still count in its divisor", skipped, len(completion_ids))
            self.said_skipped = True
        return batches

    def _rollout_batch(self, model, prompt_ids: list[list[int]], completion_ids: list[list[int]], cut: range,
                       kept: list[int]) -> RolloutBatch:
        """The rows of a micro-batch (the completions `cut`) that train its `kept` completions, each
        group's prompt once where the estimate finds it cheaper (rollout_rows)."""
        prompts, completions = [prompt_ids[i] for i in kept], [completion_ids[i] for i in kept]
        choice = row_choice(_unwrapped(model).config, prompts, completions, self.seq_len)
        if not self.said_rows:  # once a run, with the figures that decided it
            log.info("online RL: %s", choice.described())
            self.said_rows = True
        batch = rollout_batch(prompts, completions, self.pad_id, choice.rows)
        left_out = sorted(set(cut) - set(kept))
        batch.skipped_completions = len(left_out)
        batch.skipped_tokens = sum(len(completion_ids[i]) for i in left_out)
        return batch

    def needs_old_logps(self) -> bool:
        """Whether the old policy's log-probabilities are taken at sampling beyond num_iterations > 1."""
        return False

    def _reward_figures(self, scores, weights, completion_ids, stopped, batches, kl) -> dict[str, float]:
        """TRL's reward and completion figures over the global batch (one all-reduce of sums)."""
        cfg, n = self.cfg, len(completion_ids)
        rewards = (scores.float() * weights).sum(dim=1)
        grouped = rewards.view(-1, cfg.num_generations)
        zero_std = torch.isclose(grouped.std(dim=1), torch.zeros(())).float().sum()
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float64)
        clipped = float(sum(not s for s in stopped)) if stopped is not None else float(
            (lengths >= cfg.max_completion_length).sum())
        kl_sum = float(kl.sum()) if kl is not None else 0.0
        kl_tokens = float(sum(b.completion_tokens for b in batches)) if kl is not None else 0.0
        sums = pg.all_reduce_sum([float(n), float(rewards.sum()), float((rewards.double() ** 2).sum()),
                                  float(zero_std), float(grouped.shape[0]), float(lengths.sum()), clipped,
                                  kl_sum, kl_tokens, *scores.double().sum(dim=0).tolist()])
        total, r_sum, r_sq, zero, groups, length, clipped, kl_sum, kl_tokens, *per_func = sums
        mean = r_sum / total
        figures = {"reward": mean, "reward_std": math.sqrt(max(r_sq - total * mean * mean, 0.0) / max(total - 1, 1)),
                   "frac_reward_zero_std": zero / max(groups, 1), "completions/mean_length": length / total,
                   "completions/clipped_ratio": clipped / total}
        names = self.rewards.names if self.rewards is not None else [f"reward_{i}" for i in range(len(per_func))]
        figures.update({f"rewards/{name}/mean": s / total for name, s in zip(names, per_func)})
        if kl is not None:
            figures["kl"] = kl_sum / max(kl_tokens, 1.0)
        return figures

    def _global_mean_std(self, values: torch.Tensor) -> tuple[float, float]:
        n, s, sq = pg.all_reduce_sum([float(len(values)), float(values.sum()), float((values.double() ** 2).sum())])
        mean = s / n
        return mean, math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1, 1))

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Each completion's advantage within its group (GRPO's group-relative, RLOO's leave-one-out)."""
        raise NotImplementedError

    def clipped_loss(self, logps, old, batch, epsilon_high: float) -> rl_loss.MicroBatchLoss:
        """The micro-batch's clipped loss from its log-probabilities and the sampling policy's."""
        raise NotImplementedError

    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logps = completion_logps(model, batch, cfg.temperature, self.chunked)
        # μ = 1: the sampling policy is this one, its log-probabilities these (TRL's shortcut: no extra forward)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        out = self.clipped_loss(logps, old, batch, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon)
        sums = torch.cat([out.sums, torch.zeros(1, dtype=torch.float64)])  # no reward_sum
        # the completions left out: each loss term 0 and never clipped (a clip needs an advantage's sign),
        # but their tokens and completions count in the clip ratios' divisors, as where they were trained
        sums[0] += batch.skipped_tokens
        sums[1] += batch.skipped_completions
        return out.summed / divisor, sums

    def items(self, batch) -> int:
        return rl_loss.items_of(self.loss_type, batch.completions + batch.skipped_completions,
                                batch.completion_tokens + batch.skipped_tokens, self.cfg.max_completion_length)


    def figures(self, sums, items: int) -> dict[str, float]:
        """A step's: the rollout's reward and length figures and the loss's clip ratios (and kl);
        validation's (no completion trained): the mean reward of one completion a held-out prompt."""
        if float(sums[1]) == 0:
            return {"reward": float(sums[-1]) / max(items, 1)}
        return {**self.rollout_figures,
                **rl_loss.loss_figures(sums[: len(rl_loss.SUM_NAMES)], self.sequence_level, self.cfg.rl_beta)}

    @torch.no_grad()
    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """Validation: each held-out prompt sampled once from the generator seeded by the run's seed
        (the same completions' randomness at every evaluation); ([−sum of the rewards, 0…], prompts):
        val_loss is the negative mean reward, eval_reward its mean."""
        self.pad_id = rows.pad_id  # a finished model, evaluated outside a run, was never prepared
        records = rows.prompt_records(np.asarray(indices))
        if not records:
            return np.zeros(1 + len(self.names)), 0
        saved = self.generator.get_state()
        self.generator.manual_seed(self.seed + 7919)  # the same validation draws at every evaluation
        try:
            with autocast():
                rollout = self._sample(model, [r.ids for r in records])
        finally:
            self.generator.set_state(saved)
        scores = self.rewards.score(records, rollout.completion_ids)
        weights = torch.as_tensor(self.rewards.weights, dtype=torch.float32)
        total = float((scores.float() * weights).sum())
        return np.array([-total, *[0.0] * len(rl_loss.SUM_NAMES), total]), len(records)


def _unwrapped(model):
    return getattr(model, "module", model)


def _trained(cut: range, advantages: torch.Tensor, completion_ids: list[list[int]]) -> list[int]:
    """The completions of a micro-batch (`cut`) its rows train, where the loss has no KL term: those
    whose advantage is not 0. For the others −min(ratio · 0, clipped · 0) is 0, and so is its
    gradient, so leaving them out changes neither; a group whose rewards are all equal has
    advantages of exactly 0 (rl_loss), and such groups are common late in a run (TRL's
    frac_reward_zero_std counts them). Where none is left, the shortest stays: every micro-batch
    still runs its forward and backward, which a sharded model's ranks take together."""
    kept = [i for i in cut if float(advantages[i]) != 0.0]
    return kept or [min(cut, key=lambda i: len(completion_ids[i]))]


class GrpoObjective(OnlineRlObjective):
    name = "grpo"

    @property
    def loss_type(self) -> str:
        return self.cfg.loss_type

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        batch_std = self._global_mean_std(rewards)[1] if cfg.scale_rewards == "batch" else None
        advantages, _ = rl_loss.group_advantages(rewards, cfg.num_generations, cfg.scale_rewards, batch_std)
        return advantages

    def clipped_loss(self, logps, old, batch, epsilon_high: float) -> rl_loss.MicroBatchLoss:
        cfg = self.cfg
        return rl_loss.grpo_loss(logps, old, batch.advantages, batch.completion_mask, cfg.loss_type, cfg.epsilon,
                                 epsilon_high, cfg.max_completion_length, cfg.rl_beta, batch.ref_logps)


class RlooObjective(OnlineRlObjective):
    name = "rloo"
    sequence_level = True

    def needs_old_logps(self) -> bool:
        return self.cfg.rl_beta != 0.0  # its KL penalty reads the sampling policy's log-probabilities

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        advantages = rl_loss.leave_one_out_advantages(rewards, self.cfg.num_generations)
        if self.cfg.normalize_advantages:
            advantages = rl_loss.normalized(advantages, *self._global_mean_std(advantages))
        return advantages

    def clipped_loss(self, logps, old, batch, epsilon_high: float) -> rl_loss.MicroBatchLoss:
        return rl_loss.rloo_loss(logps, old, batch.advantages, batch.completion_mask, self.cfg.epsilon, epsilon_high)
