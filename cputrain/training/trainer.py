"""The training run: setup() in build order, train_step(), fit().

One Trainer runs in every rank, on a config that is already decided and read-only. It never
branches on the strategy (every one comes through the protocol in cputrain.parallel.base) nor on
the kind of fine-tuning (full or LoRA come through the model converter, cputrain.model.converter).
The run's figures are RunMetrics'; the validation loss the objective's loop over ranks
(objectives.validation_loss); when to save is the checkpoint object's; what a bad step does
is the step guard's (training.step_guard), the profiled step the profiling's
(training.step_profiling), and summary.json at the end the ending's (metrics.ending).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from cputrain import model as models
from cputrain.config.resolved import DecidedConfig
from cputrain.data import order
from cputrain.distributed import process_group as pg
from cputrain.distributed.env import RankEnv
from cputrain.distributed.stop_request import StopRequest
from cputrain.errors import ConfigError, Stopped
from cputrain.finished.after_export import write_plot_and_sample
from cputrain.hardware import HardwareFacts
from cputrain.kernels.chunked_head import install_chunked_loss
from cputrain.lora.converter import converter_for
from cputrain.model.score_head import LM_HEAD
from cputrain.metrics.completions import append_samples
from cputrain.metrics.ending import ending_summary, write_ended
from cputrain.metrics.phases import PhaseRecorder
from cputrain.metrics.run_metrics import RunMetrics
from cputrain.metrics.step_profile import OPTIMIZER_REGION
from cputrain.metrics.summary import read_summary, write_summary
from cputrain.objectives.objective import objective_class, objective_for
from cputrain.objectives.validation_loss import validation_over_ranks
from cputrain.parallel import get_strategy
from cputrain.parallel.base import Strategy, StrategyContext
from cputrain.run_folder.checkpoints import Checkpoints
from cputrain.run_folder.layout import RunFolder
from cputrain.run_folder.run_config import RecordedConfig, check_compatible, write_run_config
from cputrain.run_folder.run_lock import RunLock, take_run_lock
from cputrain.training.step_guard import StepGuard
from cputrain.training.step_outcome import StepOutcome
from cputrain.training.step_profiling import StepProfiling, check_profile_step, profile_step_of_session

log = logging.getLogger("cputrain")


class Trainer:
    def __init__(self, cfg: DecidedConfig, hw: HardwareFacts, ranks: RankEnv, reasons: list | None = None,
                 take_over_lock: bool = False, recorded: RecordedConfig | None = None):
        if not isinstance(cfg, DecidedConfig):  # a model is built from it: every part of the run must see one value
            raise ConfigError("the config is not decided before training; training.choices.decide decides it first")
        self.cfg, self.hw, self.ranks = cfg, hw, ranks
        self.reasons = reasons or []
        self.run = RunFolder(cfg.output_dir)
        self.take_over_lock = take_over_lock
        self.recorded = recorded  # the run folder's config.yaml as the run's choices read it (None: read at setup)
        self.phases = PhaseRecorder(ranks.rank)
        self.step = 0  # optimizer steps completed (a skipped non-finite step counts: its batch is consumed)
        self.stop_request = StopRequest()  # SIGTERM or a first Ctrl-C, read at step boundaries
        self.exported = False  # model/ written by this session (close() then plots and samples)
        # Built by setup(), by its numbered parts:
        self.converter = self.objective = None  # 0. full fine-tuning or LoRA; lm, dpo, simpo, kto or reward
        self.lock: RunLock | None = None  # 1. rank 0's, until close()
        self.tokenizer = self.data = None  # 2. and the data the run's kind prepared (data.prepare: rows, describe())
        self.train_rows = self.val_rows = None  # 2. what batches are cut from (every kind's rows: data.rows.Rows)
        self.order: order.BatchOrder | None = None  # 2. which rows each rank takes at each step
        self.hf_config = None  # 3. transformers PretrainedConfig
        self.counts: dict[str, int] = {}  # 3. parameter counts (models.parameter_counts)
        self.strategy: Strategy | None = None  # 4.
        self.model: torch.nn.Module | None = None  # 4. the wrapped model
        self.optimizer: torch.optim.Optimizer | None = None  # 5.
        self.total_steps = 0  # 2. the run's (a session may stop earlier: train.stop_at_step)
        self.schedule = None  # 5. training.lr_schedule.WarmupCosine
        self.checkpoints: Checkpoints | None = None  # 6.
        self.metrics: RunMetrics | None = None  # 6.
        self.guard: StepGuard | None = None  # by fit(): this session's bad-step counters

    # ------------------------------------------------------------------------------------
    def setup(self) -> None:
        """One rank's run, built in the order each part needs the ones before it (DESIGN.md, "One
        run, top to bottom"): above all the strategy shards the skeleton before any weight exists,
        so an 8B model never exists whole in any rank."""
        # 0. What the run trains, chosen once before any work, and the run folder checked before
        #    anything is written into it.
        self._choose_what_to_train()

        # 1. The process group and this rank's threads are the worker's (the attention kernel was
        #    timed on them). One writer per run folder: rank 0 locks it before anything is
        #    written there (and before any tokenizing), and every rank stops if another run holds it.
        self.phases.mark("process group")
        self.lock = take_run_lock(self.run, self.ranks.is_main, self.take_over_lock)

        # 2. Tokenizer and data, before the model: the model's vocabulary and head read the
        #    tokenizer, and a batch the data cannot fill is refused before anything is built.
        self._prepare_data()

        # 3. Model skeleton on the meta device: the structure, no memory; rank 0 plans its memory
        #    from it (exact shapes) while a warning can still come before any weight exists.
        source, skeleton = self._build_skeleton()
        self._plan_memory(skeleton)
        self.phases.mark("model skeleton")

        # 4. The strategy wraps the skeleton BEFORE any weight exists, so a sharding strategy
        #    materializes only this rank's shard: an 8B model never exists whole in any rank.
        self._shard_and_load(skeleton, source)
        self.phases.mark("sharded weights", model=self.model)

        # 5. Optimizer and learning-rate schedule; then the objective's per-step preparation (a
        #    reference computed from the weights as loaded), after the optimizer and before a
        #    checkpoint replaces those weights.
        self._build_optimizer()
        self._prepare_objective(source)

        # 6. Resume from the newest complete checkpoint, if this run folder has one; the metrics
        #    and config.yaml start from its step.
        self._resume(source)
        # Last: blocks compile in place, and a checkpoint loaded above keeps the eager names.
        self._compile_blocks()

    def _choose_what_to_train(self) -> None:
        """0. Full fine-tuning or LoRA, and the objective. DPO's and KTO's reference is the
        converter's (LoRA: adapters off), or for full weights computed once from the starting
        weights (5.)."""
        cfg = self.cfg
        self.converter = converter_for(cfg, self.ranks.is_main)
        objective_class(cfg.train.objective).check_data(cfg.data.format)
        self.objective = objective_for(cfg.train, self.converter.reference, cfg.model.chunked_loss)
        check_compatible(self.run, cfg, self.recorded)  # before anything is written into an existing run folder
        self.converter.check_run_folder(self.run)  # LoRA: the adapters there belong to these base weights

    def _prepare_data(self) -> None:
        """2. One process per cache entry builds it (a lock file); the others poll for its
        completion marker instead of waiting in a collective, so preparing a 10B-token corpus may
        take far longer than the process group's timeout."""
        from cputrain.data.feedback.kind import refuse_one_label
        from cputrain.data.prepare import prepare, rows_of

        cfg, ranks = self.cfg, self.ranks
        self.tokenizer, self.data = prepare(cfg)
        refuse_one_label(self.data.stats, cfg.data)
        self.train_rows, self.val_rows = rows_of(self.data, "train"), rows_of(self.data, "val")
        if ranks.is_main:
            log.info("data: %s", self.data.describe())
        objective = self.objective
        if objective.batches_from_rollouts:  # online RL: its reward functions, each imported or refused now
            from cputrain.rewards.functions import build_rewards

            objective.use_rewards(build_rewards(cfg.train, self.tokenizer), cfg.seed * 1000 + ranks.rank)
        objective.check_rows([self.train_rows, self.val_rows], ranks.world_size)
        # before the model is built: a batch of more rows than the data made would repeat rows in a step
        pairs = self.data.stats.get("train_pairs")  # preference data counts its pairs
        rows_per_step = objective.rows_per_step(cfg.train)  # online RL: prompts, each sampled several times
        order.check_batch_fits(cfg.train, len(self.train_rows), ranks.world_size, pairs, rows_per_step)
        self.order = order.BatchOrder(len(self.train_rows), rows_per_step, cfg.seed)
        if ranks.is_main and pairs is not None:
            log.info("batch: %s", order.pairs_per_step(cfg.train, len(self.train_rows), pairs))
        self.total_steps = self._total_steps()  # known once the data is (train.epochs)
        check_profile_step(cfg.train, self.total_steps, len(self.train_rows))

    def _build_skeleton(self):
        """3. (the model's source, its skeleton on the meta device with the objective's head and
        the converter's adapters)."""
        cfg = self.cfg
        source = models.resolve_source(cfg.model, vocab_size=len(self.tokenizer))
        models.check_vocab(source.hf_config, self.tokenizer)
        # the head the objective trains (a reward model's score), with the pad token its pooling skips
        models.fit_head(source.hf_config, self.objective.head, self.tokenizer.pad_token_id
                        if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id)
        self.hf_config = source.hf_config
        skeleton = models.build_skeleton(source, cfg.model)
        self.converter.convert(skeleton, source)  # LoRA: adapters in, the base frozen
        models.enable_activation_checkpointing(skeleton, cfg.model.activation_checkpointing)
        self.counts = models.parameter_counts(skeleton)
        return source, skeleton

    def _plan_memory(self, skeleton: torch.nn.Module) -> None:
        """3. Rank 0: plan.json, a warning now if this node cannot hold the plan, and a checkpoint's worth."""
        ranks = self.ranks
        fused = True
        if ranks.is_main:
            from cputrain.plan.memory.runtime import write_run_plan
            from cputrain.plan.time import worth_here

            plan, fused = write_run_plan(self.run, self.cfg, skeleton, ranks.world_size, ranks.local_world_size,
                                         self.hw.memory_gib)
            log.info("checkpoints: %s", worth_here(plan, self.cfg, self.hw, ranks.world_size,
                                                   ranks.local_world_size).line())
        if self.objective.batches_from_rollouts:  # every rank samples on the same path: rank 0's plan decides
            self.objective.fused_rollouts = pg.broadcast_from_main(fused)

    def _shard_and_load(self, skeleton: torch.nn.Module, source) -> None:
        """4. The strategy wraps the skeleton, then each rank reads only the weights it owns."""
        cfg, ranks = self.cfg, self.ranks
        ctx = StrategyContext(cfg, ranks.rank, ranks.world_size, cfg.hardware.dtype, self.converter.file_name_of,
                              ranks_per_node=ranks.local_world_size)
        self.strategy = get_strategy(cfg.parallel.strategy, ctx=ctx)
        self.phases.tensors_held = self.strategy.tensors_held
        self.model = self.strategy.wrap(skeleton)
        self.strategy.load_weights(self.model, source.folder)
        self.converter.fill(self.strategy.unwrap(self.model))
        self.strategy.check_weights(self.model)
        if cfg.model.chunked_loss:
            install_chunked_loss(self.strategy.unwrap(self.model))

    def _build_optimizer(self) -> None:
        """5. The strategy's optimizer (over the weights it holds) and the learning-rate schedule."""
        from cputrain.training.lr_schedule import build_schedule

        self.optimizer = self.strategy.build_optimizer(self.model)
        self.schedule = build_schedule(self.optimizer, self.cfg.train, self.total_steps)
        self.phases.mark("optimizer created", model=self.model, optimizer=self.optimizer)

    def _prepare_objective(self, source) -> None:
        """5. DPO (train.dpo_reference=precompute) and KTO: the reference log-probabilities of every
        sequence, from the weights as loaded (LoRA: the base), before a checkpoint (trained
        weights) replaces them; after the optimizer, because a sharding engine that gathers each
        module's partitioned weights around its forward may exist only from then on. They are
        kept in the token cache's entry, each rank its share."""
        cfg, ranks = self.cfg, self.ranks
        reference = None
        if self.objective.stores_reference:
            from cputrain.objectives.reference_store import ReferenceStore, reference_file

            reference = ReferenceStore(reference_file(self.data.folder, source.folder, cfg), ranks.rank,
                                       ranks.world_size, ranks.local_rank)
        self.objective.prepare(self.model, [self.train_rows, self.val_rows], cfg.train.micro_batch_size,
                               self.strategy.autocast, reference)

    def _resume(self, source) -> None:
        """6. The newest complete checkpoint loaded, if any; the run's metrics opened at its step;
        rank 0 records the run's config (and LoRA what the adapters are trained on)."""
        cfg, ranks = self.cfg, self.ranks
        # what every save writes and a resume loads: the strategy's state of the model and optimizer
        state = self.strategy.checkpoint_state(self.model, self.optimizer)
        self.checkpoints = Checkpoints(self.run, cfg, ranks, state, self.strategy.meter)
        resumed = self.checkpoints.load_latest(self.schedule)
        if resumed is not None:
            self.step = resumed
            if self.checkpoints.objective_state:  # online RL: where its sampling generator stood
                self.objective.load_state_dict(self.checkpoints.objective_state)
            log.info("resumed from %s (step %d)", self.run.step_path(resumed), resumed)
        self.metrics = RunMetrics(cfg, self.hw, ranks, self.run, self.counts, self.hf_config, self.strategy.meter,
                                  self.total_steps, self.objective.summary_figures, self.objective.perplexity,
                                  self.objective.item_described + "s")
        self.metrics.open_sinks(self.step, guard=self.lock.assert_held if self.lock else lambda: None)
        if ranks.is_main:
            write_run_config(self.run, cfg, self.reasons)
            self.converter.record(self.run, source)  # LoRA: what the adapters are trained on, checked on resume

    def _compile_blocks(self) -> None:
        """model.compile: in place, block by block, so checkpoints keep the eager names."""
        cfg = self.cfg
        if cfg.model.compile:
            cache = cfg.model.compile_cache_dir or str(Path(cfg.data.cache_dir) / "inductor")
            models.compile_blocks(self.strategy.unwrap(self.model), cache)
            if self.ranks.is_main:
                log.info("model.compile: decoder blocks compile during the first step (kernels cached in %s)", cache)

    def _total_steps(self) -> int:
        t = self.cfg.train
        if t.max_steps is not None:
            return t.max_steps
        return max(1, math.ceil(t.epochs * len(self.train_rows) / t.global_batch_size))

    # ------------------------------------------------------------------------------------
    def train_step(self) -> StepOutcome:
        """One optimizer step over this rank's share of the global batch."""
        # this rank's rows of the step as the objective makes them micro-batches (cut from the cache;
        # online RL: its prompts sampled and scored)
        objective, mbs = self.objective, self.cfg.train.micro_batch_size
        micro_batches = objective.step_batches(
            self.model, self.train_rows,
            self.order.rank_micro_batches(self.step, self.ranks.rank, self.ranks.world_size, mbs), mbs,
            self.strategy.autocast)
        # The step's loss is the sum of the losses of every item of the global batch (trained
        # target, or preference pair) ÷ their number, over all micro-batches and ranks: a mean of
        # per-micro-batch means is wrong when micro-batches hold different numbers of them (chat
        # data, packed pairs). Strategies average gradients over ranks, so each rank divides by the
        # global count ÷ world size.
        trained, tokens, items = (int(n) for n in pg.all_reduce_sum([
            sum(b.trained_targets for b in micro_batches), sum(b.tokens for b in micro_batches),
            sum(objective.items(b) for b in micro_batches)]))
        divisor = max(items, 1) / self.ranks.world_size
        self.model.train()
        loss_sum = torch.zeros(())
        figure_sums = torch.zeros(len(objective.names), dtype=torch.float64)
        # One autocast region around all micro-batches: autocast caches the bf16 copy of each fp32
        # weight until the region ends, so weights are cast once per optimizer step (they change
        # only at the step), not once per micro-batch. Measured +3% tokens/s on a 97M Llama with
        # 2 micro-batches on AMX (benchmarks/step_time/bf16_step.py); more with more accumulation.
        with self.strategy.autocast():
            # what the objective takes over the whole step first (KTO: its KL estimate, every rank's)
            objective.start_step(self.model, micro_batches, self.strategy.autocast)
            for i, batch in enumerate(micro_batches):
                with self.strategy.accumulation(self.model, last_micro_batch=i == len(micro_batches) - 1):
                    loss, figures = objective.loss(self.model, batch, divisor)
                    self.strategy.backward(loss)
                loss_sum += loss.detach().float()
                if figures is not None:
                    figure_sums += figures.double()
        loss = float(loss_sum)
        # One small all-reduce a step (none on one rank): is any rank's loss not finite, was any rank
        # asked to stop, is a timed checkpoint due by rank 0's clock? Every rank then skips or steps,
        # stops or goes on, saves or not, at the same step. The objective's figures (preference:
        # TRL's rewards/…) ride along, summed over the global batch's pairs.
        time_due = self.ranks.is_main and self.checkpoints.time_due()
        bad_losses, stops, save_due, *figure_totals = pg.all_reduce_sum([
            0.0 if math.isfinite(loss) else 1.0, float(self.stop_request.requested), float(time_due),
            *figure_sums.tolist()])
        figures = objective.figures(figure_totals, items) or None
        # A named region (microseconds when no profiler runs): train.profile_step counts what is in it.
        with torch.profiler.record_function(OPTIMIZER_REGION):
            grad_norm, stepped = self.strategy.step(self.model, self.optimizer, self.cfg.train.grad_clip,
                                                    loss_finite=bad_losses == 0)
        # A finite loss and gradient norm can still leave inf or nan in the weights (a far too high
        # lr): read once after the update (docs/benchmarks/step-time.md, block weights-check: the cost per step).
        weights_finite = self.strategy.weights_finite_on_every_rank(self.model) if stepped else True
        self.schedule.step()
        self.step += 1
        return StepOutcome(loss, grad_norm, trained, tokens, stepped,
                           (self.stop_request.signal_name or "SIGTERM") if stops else None, save_due > 0,
                           weights_finite, figures, items if objective.names and objective.logs_item_rate else None)

    # ------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Step; let the metrics and the checkpoints act; evaluate when due. Returns the summary.
        However the steps end (finished, stopped, diverged, failed), rank 0 writes summary.json
        with the ending's status, reason and exit code, for a pipeline to read."""
        if self.step < self.total_steps:
            try:
                return self._fit()
            except BaseException as err:
                if self.ranks.is_main and self.metrics is not None:
                    write_ended(self.run, self.metrics, self.step, self.guard.skipped_steps if self.guard else 0, err)
                raise
        log.info("the run is already complete at step %d; raise train.max_steps to continue it", self.step)
        self.metrics.end_progress(self.step, "finished")  # a TrainJob whose pods restarted after the end
        return read_summary(self.run) or {}

    def _fit(self) -> dict:
        self.guard = StepGuard(self.cfg.train, self.strategy, self.checkpoints, self.run, self.ranks.is_main)
        self._warn_if_no_validation()
        # stop_at_step ends this session early; the schedule still runs to total_steps.
        stop_at = min(self.total_steps, self.cfg.train.stop_at_step or self.total_steps)
        metrics = self.metrics
        profiling = StepProfiling(self.run, metrics,
                                  profile_step_of_session(self.cfg.train, self.ranks.is_main, self.step, stop_at))
        metrics.start(self.step)
        self.stop_request.install()
        try:
            while self.step < stop_at:
                with metrics.step(), profiling.recording(self.step + 1):
                    outcome = self.train_step()
                if metrics.steps_this_session == 1:
                    self.phases.mark("first step done", model=self.model, optimizer=self.optimizer)
                row = metrics.record(self.step, outcome.loss, outcome.grad_norm, self.schedule.get_last_lr()[0],
                                     self.order.epoch_of(self.step), outcome.trained, outcome.tokens,
                                     outcome.figures, outcome.pairs)
                if self._validation_due() and not outcome.stop_signal:
                    val_loss, figures = validation_over_ranks(self.objective, self.model, self.val_rows,
                                                              self.cfg.train, self.ranks, self.strategy.autocast)
                    row = metrics.with_validation(row, self.step, val_loss, figures)
                metrics.publish(row)
                # every rank takes the step's records from the objective, which holds the last step's
                # alone; rank 0 keeps those of the steps metrics.jsonl logs
                samples = self.objective.samples()
                if self.ranks.is_main and self.step % self.cfg.train.log_every == 0:
                    append_samples(self.run, self.step, samples)
                profiling.step()
                self.guard.judge(self.step, outcome)  # after the row: the step that stops the run is on record
                saved = False
                if (outcome.stop_signal or outcome.save_due
                        or self.checkpoints.should_save(self.step, self.total_steps, stop_at)):
                    saved = self._save_unless_in_a_bad_streak()
                if outcome.stop_signal:
                    newest = self.run.newest_complete()
                    where = (f"checkpoint saved ({self.run.step_path(self.step)})" if saved else
                             "no checkpoint written inside a streak of bad steps (newest: "
                             f"{self.run.step_path(newest) if newest is not None else 'none'})")
                    raise Stopped(f"stopped by {outcome.stop_signal} at step {self.step}/{self.total_steps}; {where}; "
                                  "re-run the same command to resume")
        finally:
            self.stop_request.uninstall()
        return self._finish()

    def _save_unless_in_a_bad_streak(self) -> bool:
        """Save the step, unless it is inside a streak of bad steps: its weights are then not known
        to be healthy, and a save would rotate out a checkpoint that is."""
        if self.guard.bad_steps_in_row:
            if self.ranks.is_main:
                log.warning("step %d: checkpoint not written: %d bad step(s) in a row; the newest checkpoint is kept",
                            self.step, self.guard.bad_steps_in_row)
            return False
        self.checkpoints.save(self.step, self.schedule, self.objective.state_dict())
        self.metrics.exclude_pause()
        return True

    def _validation_due(self) -> bool:
        every = self.cfg.train.eval_every
        return len(self.val_rows) > 0 and (self.step % every == 0 or self.step == self.total_steps)

    def _warn_if_no_validation(self) -> None:
        if len(self.val_rows) == 0 and self.ranks.is_main:  # val_loss stays null in metrics.jsonl and summary.json
            log.warning("the validation split has 0 sequences (%d training sequences; data.val_fraction=%s): "
                        "validation is skipped and val_loss is null; raise data.val_fraction or "
                        "data.max_documents to validate", len(self.train_rows), self.cfg.data.val_fraction)

    def _finish(self) -> dict:
        """The steps are done: their clock stops; the export (and a finished run) holds finite weights only."""
        self.metrics.stop()
        self.phases.mark("training step peak", model=self.model, optimizer=self.optimizer,
                         rss_gib=self.metrics.step_peak_gib, peak_rss_gib=self.metrics.step_peak_gib)
        if not self.strategy.weights_finite_on_every_rank(self.model):
            self.guard.diverged(f"the weights are not finite at step {self.step}, the end of the run: nothing is "
                                "exported")
        self.checkpoints.confirm()
        summary = ending_summary(self.metrics, self.step, self.guard.skipped_steps, "finished", 0, None)
        self.phases.write(self.run, self.ranks)
        self.checkpoints.export(self._write_model)
        if self.ranks.is_main:
            write_summary(self.run, summary)
        self.metrics.end_progress(self.step, "finished")  # after the export: 100% says the model is there
        self.exported = True
        return summary

    def _write_model(self, folder: str, is_writer: bool) -> None:
        self.converter.export(self.strategy, self.model, self.hf_config, self.tokenizer, folder, is_writer)

    def close(self) -> None:
        """The end of this rank's run, however it ended (finished, or an error on its way out). A
        finished run's rank 0 first writes loss.png and sample.txt, still under the run lock (they
        are run-folder files). Then, whatever that did, the sinks' files are flushed and rank 0's
        lock let go, so the next run need not wait for it to go stale; then the model, optimizer and
        strategy, which hold the process group, let go of before the group is destroyed."""
        try:
            if self.exported and self.ranks.is_main:
                self._write_plot_and_sample()
        finally:
            if self.metrics is not None:
                self.metrics.close_sinks()
            if self.lock is not None:
                self.lock.release()
                self.lock = None
            if self.strategy is not None:
                self.strategy.close()
            self.model = self.optimizer = self.schedule = self.checkpoints = self.strategy = None

    def _write_plot_and_sample(self) -> None:
        """loss.png, and sample.txt sampled from the prompt of the first validation example (of the
        first training one without a validation split; from "The" for text). A reward model writes
        no text."""
        rows = self.val_rows if self.val_rows is not None and len(self.val_rows) else self.train_rows
        sample_tokens = self.cfg.train.sample_tokens if self.objective.head == LM_HEAD else 0
        write_plot_and_sample(self.run, sample_tokens, self.cfg.seed, rows.prompt_ids(0))
