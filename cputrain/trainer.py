"""The training run: setup() in build order, train_step(), evaluate(), fit().

One Trainer runs in every rank. It never branches on the strategy's name: single, ddp, fsdp
and zero3 all come through the small protocol in cputrain.parallel.base.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cputrain.lora import base_model
from cputrain.run_folder.checkpoints import Checkpoints
from cputrain.run_folder.layout import RunFolder
from cputrain.run_folder.run_config import check_compatible, recorded_value, write_run_config
from cputrain.run_folder.run_lock import RunLock, take_run_lock
from cputrain.config import ResolvedConfig
from cputrain.data import order
from cputrain.distributed import comm, process_group as pg
from cputrain.distributed.env import RankEnv
from cputrain.hardware import HardwareFacts
from cputrain.kernels.attention_choice import choose_attention
from cputrain.kernels.chunked_loss import install_chunked_loss
from cputrain.metrics import flops, memory
from cputrain.metrics.jsonl import MetricsJsonl
from cputrain.metrics.measured_peak import measured_peak_flops
from cputrain.metrics.phases import PhaseRecorder
from cputrain.metrics.sinks import ReportSinks
from cputrain.metrics.summary import read_summary, write_summary
from cputrain import model as models
from cputrain.parallel import get_strategy, needs_process_group
from cputrain.parallel.base import StrategyContext

log = logging.getLogger("cputrain")


class Trainer:
    def __init__(self, cfg: ResolvedConfig, hw: HardwareFacts, ranks: RankEnv, cpus: list[int] | None = None,
                 reasons: list | None = None, take_over_lock: bool = False):
        self.cfg, self.hw, self.ranks, self.cpus = cfg, hw, ranks, cpus
        self.reasons = reasons or []
        self.run = RunFolder(cfg.output_dir)
        self.take_over_lock = take_over_lock
        self.lock: RunLock | None = None  # rank 0's, from setup() until release_lock()
        self.metrics_log: ReportSinks | None = None  # rank 0's: metrics.jsonl and the report_to sinks
        self.step = 0  # optimizer steps completed
        self.exported = False  # model/ written by this session (the worker then plots and samples)
        self.phases = PhaseRecorder(ranks.rank)

    # ------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, ranks = self.cfg, self.ranks
        check_compatible(self.run, cfg)  # before anything is written into an existing run folder
        if cfg.model.lora.enabled:  # the adapters in the folder belong to these base weights
            base_model.check_same_base(self.run, cfg.model.name_or_path)

        # 1. Process group and this rank's cores: everything after runs on the right threads.
        pg.set_threads(cfg.hardware.threads, self.cpus)
        if ranks.distributed or needs_process_group(cfg.parallel.strategy):
            pg.init_process_group(cfg.parallel.backend, ranks.world_size, cfg.parallel.timeout_s)
        self.phases.mark("process group")
        # One writer per run folder: rank 0 locks it before anything is written there (and
        # before any tokenizing), and every rank stops if another run holds it.
        self.lock = take_run_lock(self.run, ranks.is_main, self.take_over_lock)

        # 2. Tokenizer and data. One process per cache entry builds it (a lock file); the others
        #    poll for its completion marker instead of waiting in a collective, so preparing a
        #    10B-token corpus may take far longer than the process group's timeout.
        self._prepare_data()

        # 3. Model skeleton on the meta device: the structure, no memory.
        source = models.resolve_source(cfg.model, vocab_size=len(self.tokenizer))
        models.check_vocab(source.hf_config, self.tokenizer)
        self.hf_config = source.hf_config
        if cfg.model.attn_implementation == "auto":
            self._choose_attention()
        skeleton = models.build_skeleton(source, cfg.model)
        adapter_init = self._add_adapters(skeleton, source) if cfg.model.lora.enabled else {}
        if cfg.model.activation_checkpointing:
            models.enable_activation_checkpointing(skeleton)
        self.counts = models.parameter_counts(skeleton)
        if ranks.is_main:  # plan.json, and a warning now if this node cannot hold the plan
            from cputrain.plan.runtime import write_run_plan

            write_run_plan(self.run, cfg, skeleton, ranks.world_size, ranks.local_world_size, self.hw.memory_gib)
        self.phases.mark("model skeleton")

        # 4. The strategy wraps the skeleton BEFORE any weight exists, so a sharding strategy
        #    materializes only this rank's shard: an 8B model never exists whole in any rank.
        dtype = cfg.hardware.dtype
        self.strategy = get_strategy(
            cfg.parallel.strategy, ctx=StrategyContext(cfg, ranks.rank, ranks.world_size, dtype)
        )
        self.phases.tensors_held = self.strategy.tensors_held
        self.model = self.strategy.wrap(skeleton)
        self.strategy.load_weights(self.model, source.folder)
        if adapter_init:
            from cputrain.lora.adapters import fill_adapters

            fill_adapters(self.strategy.unwrap(self.model), adapter_init)
        if cfg.model.chunked_loss:
            install_chunked_loss(self.strategy.unwrap(self.model))
        self.phases.mark("sharded weights", model=self.model)

        # 5. Optimizer and learning-rate schedule.
        self.optimizer = self.strategy.build_optimizer(self.model)
        self.total_steps = self._total_steps()
        from cputrain.optim import build_schedule

        self.schedule = build_schedule(self.optimizer, cfg.train, self.total_steps)
        self.phases.mark("optimizer created", model=self.model, optimizer=self.optimizer)

        # 6. Resume from the newest complete checkpoint, if this run folder has one.
        self.checkpoints = Checkpoints(self.run, cfg, ranks)
        resumed = self.checkpoints.load_latest(self.strategy, self.model, self.optimizer, self.schedule)
        if resumed is not None:
            self.step = resumed
            log.info("resumed from %s (step %d)", self.run.step_path(resumed), resumed)
        if ranks.is_main:  # metrics.jsonl loses the rows of steps trained again; the report_to sinks open
            self.metrics_log = ReportSinks(self.run, cfg, self.step)
            write_run_config(self.run, cfg, self.reasons)
            if cfg.model.lora.enabled:  # what the adapters were trained on, checked on resume
                base_model.record(self.run, source.folder)

        if cfg.model.compile:  # in place, block by block: checkpoints keep the eager names
            cache = cfg.model.compile_cache_dir or str(Path(cfg.data.cache_dir) / "inductor")
            models.compile_blocks(self.strategy.unwrap(self.model), cache)
            if ranks.is_main:
                log.info("model.compile: decoder blocks compile during the first step (kernels cached in %s)", cache)

        self.flops_per_token = flops.flops_per_token(
            self.counts["non_embedding"],
            self.hf_config.num_hidden_layers,
            self.hf_config.hidden_size,
            cfg.data.seq_len,
            trained_params=self.counts["trained_non_embedding"],  # LoRA: weight gradients of the adapters only
        )
        # MFU is against the cores this rank was given, so it reads the same at any rank count:
        # against the theoretical peak (cores × clock × FLOP/cycle) and against the measured one
        # (a large matmul of this dtype on this rank's threads, timed once per machine).
        share = cfg.hardware.threads / max(1, self.hw.physical_cores)
        self.peak_flops = self.hw.peak_flops[cfg.hardware.precision] * min(1.0, share) * ranks.world_size
        measured, self.measured_peak_how = measured_peak_flops(self.hw.cpu_model, self.hw.flags,
                                                               cfg.hardware.threads, dtype)
        self.measured_peak_flops = measured * ranks.world_size

    def _add_adapters(self, skeleton, source) -> dict:
        """model.lora: peft's adapters into the skeleton, the rest frozen (bf16 where the compute
        is); returns their initial values, copied in once the strategy has materialized the model."""
        from cputrain.lora.adapters import ADAPTER, add_adapters

        cfg = self.cfg
        initial = add_adapters(skeleton, cfg.model.lora, frozen_dtype=cfg.hardware.dtype, seed=cfg.seed,
                               base_path=str(source.folder.resolve()))
        if self.ranks.is_main:
            trained = sum(t.numel() for t in initial.values())
            total = sum(p.numel() for p in skeleton.parameters())
            log.info("model.lora: rank %d on %s: %s trained parameters (%.2f%% of %s); the base is frozen in %s",
                     cfg.model.lora.rank, ", ".join(sorted(skeleton.peft_config[ADAPTER].target_modules)), f"{trained:,}",
                     100 * trained / total, f"{total:,}", str(cfg.hardware.dtype).removeprefix("torch."))
        return initial

    def _choose_attention(self) -> None:
        """model.attn_implementation=auto: rank 0 times both kernels; every rank uses its choice."""
        cfg, ranks = self.cfg, self.ranks
        # A resumed run keeps the kernel it trained with: timing again could pick the other one,
        # and the losses after the resume would no longer be those of a run never stopped.
        resumed_with = recorded_value(self.run, "model.attn_implementation")
        if resumed_with in ("sdpa", "eager"):
            cfg.model.attn_implementation = resumed_with
            if ranks.is_main:
                log.info("model.attn_implementation = %s: chosen when this run started (config.yaml)", resumed_with)
            return
        mine = choose_attention(self.hf_config, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.hardware.dtype) if ranks.is_main else None
        choice = pg.broadcast_from_main(mine)
        cfg.model.attn_implementation = choice.implementation
        if ranks.is_main:
            log.info("model.attn_implementation = %s: %s", choice.implementation, choice.reason)

    def _prepare_data(self) -> None:
        from cputrain.data.prepare import prepare

        cfg = self.cfg
        self.tokenizer, self.data = prepare(cfg)
        self.order = order.BatchOrder(len(self.data.train), cfg.train.global_batch_size, cfg.seed)
        if self.ranks.is_main:
            s = self.data.stats
            log.info(
                "data: %d documents, %d tokens → %d train + %d validation sequences of %d tokens "
                "(useful tokens 100%%: 0 padding, %d tail tokens dropped)",
                s["documents"], s["tokens"], s["train_sequences"], s["val_sequences"], s["seq_len"], s["dropped_tail_tokens"],
            )

    def _total_steps(self) -> int:
        t = self.cfg.train
        if t.max_steps is not None:
            return t.max_steps
        return max(1, math.ceil(t.epochs * len(self.data.train) / t.global_batch_size))

    # ------------------------------------------------------------------------------------
    def _batch(self, indices: np.ndarray, split: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(split[indices], dtype=np.int64))

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over this rank's share of the global batch. Returns (loss, grad norm)."""
        micro_batches = self.order.rank_micro_batches(
            self.step, self.ranks.rank, self.ranks.world_size, self.cfg.train.micro_batch_size
        )
        self.model.train()
        loss_sum = torch.zeros(())
        # One autocast region around all micro-batches: autocast caches the bf16 copy of each fp32
        # weight until the region ends, so weights are cast once per optimizer step (they change
        # only at the step), not once per micro-batch. Measured +3% tokens/s on a 97M Llama with
        # 2 micro-batches on AMX (benchmarks/bf16_step.py); more with more accumulation.
        with self.strategy.autocast():
            for i, indices in enumerate(micro_batches):
                tokens = self._batch(indices, self.data.train)
                with self.strategy.accumulation(self.model, last_micro_batch=i == len(micro_batches) - 1):
                    # labels=input ids: the model shifts them to predict each next token.
                    loss = self.model(input_ids=tokens, labels=tokens).loss / len(micro_batches)
                    self.strategy.backward(loss)
                loss_sum += loss.detach().float()
        grad_norm = self.strategy.step(self.model, self.optimizer, self.cfg.train.grad_clip)
        self.schedule.step()
        self.step += 1
        return float(loss_sum), grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the first eval_batches × micro-batch sequences, split across ranks."""
        val = self.data.val
        if len(val) == 0:
            return float("nan")
        self.model.eval()
        mbs, world, rank = self.cfg.train.micro_batch_size, self.ranks.world_size, self.ranks.rank
        n = min(len(val), self.cfg.train.eval_batches * mbs * world)
        n -= n % world  # every rank runs the same number of forwards (collectives must match)
        if n == 0:
            n = len(val)
        per_rank = np.array_split(np.arange(n), world)[rank] if n >= world else np.arange(n)
        total, count = 0.0, 0
        for start in range(0, len(per_rank), mbs):
            idx = per_rank[start : start + mbs]
            tokens = self._batch(idx, val)
            with self.strategy.autocast():
                total += float(self.model(input_ids=tokens, labels=tokens).loss) * len(idx)
            count += len(idx)
        return pg.all_reduce_mean(total / max(count, 1))

    # ------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        main = self.ranks.is_main
        if self.step >= self.total_steps:
            log.info("the run is already complete at step %d; raise train.max_steps to continue it", self.step)
            return read_summary(self.run) or {}
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        # A live bar where a person watches a terminal; plain log lines in CI logs and pod logs.
        live = main and sys.stderr.isatty()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not live, desc="train", unit="step",
                   dynamic_ncols=True, mininterval=1.0)
        start_step, wall0 = self.step, time.perf_counter()
        window_t0, window_steps = time.perf_counter(), 0
        first_step_done = False
        last_val = None
        has_val = len(self.data.val) > 0
        if not has_val and main:  # said once; val_loss stays null in metrics.jsonl and summary.json
            log.warning("the validation split has 0 sequences (%d training sequences; data.val_fraction=%s): "
                        "validation is skipped and val_loss is null; raise data.val_fraction or "
                        "data.max_documents to validate", len(self.data.train), cfg.data.val_fraction)
        memory.reset_peak()
        # The high-water mark is reset around every step, so "training step peak" is the peak of
        # a step alone; what evaluation and checkpoint saves add between steps is folded into
        # run_peak_gib (metrics and summary), so the run's own peak is never understated.
        step_peak_gib = run_peak_gib = 0.0
        # stop_at_step ends this session early; the schedule still runs to total_steps.
        stop_at = min(self.total_steps, t.stop_at_step or self.total_steps)
        while self.step < stop_at:
            run_peak_gib = max(run_peak_gib, memory.peak_rss_gib())
            memory.reset_peak()
            loss, grad_norm = self.train_step()
            step_peak_gib = max(step_peak_gib, memory.peak_rss_gib())
            window_steps += 1
            if not first_step_done:
                self.phases.mark("first step done", model=self.model, optimizer=self.optimizer)
                first_step_done = True
            record = None
            if self.step % t.log_every == 0 or self.step == self.total_steps:
                elapsed = time.perf_counter() - window_t0
                tps = window_steps * tokens_per_step / elapsed
                mfu = flops.mfu(tps, self.flops_per_token, self.peak_flops)
                mfu_measured = flops.mfu(tps, self.flops_per_token, self.measured_peak_flops)
                record = {
                    "step": self.step,
                    "loss": pg.all_reduce_mean(loss),
                    "lr": self.schedule.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "mfu_of_measured_peak": mfu_measured,
                    "step_time_s": elapsed / window_steps,
                    "rss_gib": memory.rss_gib(),
                    "peak_rss_gib": max(run_peak_gib, memory.peak_rss_gib()),
                    "epoch": self.order.epoch_of(self.step),
                }
                record.update(self.strategy.meter.window())
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{mfu:.1%}")
                if main and not live:
                    log.info("step %d/%d  loss %.4f  lr %.2e  %s tok/s  MFU %.1f%%", self.step, self.total_steps,
                             record["loss"], record["lr"], f"{tps:,.0f}", 100 * mfu)
                window_t0, window_steps = time.perf_counter(), 0
            if has_val and (self.step % t.eval_every == 0 or self.step == self.total_steps):
                last_val = self.evaluate()
                record = record or {"step": self.step}
                record["val_loss"] = last_val
                record["val_ppl"] = math.exp(min(last_val, 50))
                window_t0 = time.perf_counter()  # evaluation time is not training throughput
            if record and main:
                self.lock.assert_held()  # another run took the folder over: stop before writing beside it
                self.metrics_log.log(record)
            if self.step % t.checkpoint_every == 0 or self.step in (self.total_steps, stop_at):
                self.checkpoints.save(self.step, self.strategy, self.model, self.optimizer, self.schedule)
                window_t0 = time.perf_counter()
            bar.update(1)
        bar.close()
        self.phases.mark("training step peak", model=self.model, optimizer=self.optimizer,
                         rss_gib=step_peak_gib, peak_rss_gib=step_peak_gib)
        run_peak_gib = max(run_peak_gib, memory.peak_rss_gib())
        wall_s = time.perf_counter() - wall0
        return self._finish(wall_s, start_step, last_val, run_peak_gib)

    def release_lock(self) -> None:
        if self.metrics_log is not None:  # flushes the sinks' files, also on an error exit
            self.metrics_log.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def close(self) -> None:
        """Let go of the model, optimizer and strategy (they hold the process group) before it is destroyed."""
        strategy = getattr(self, "strategy", None)
        if strategy is not None:
            strategy.close()
        for name in ("model", "optimizer", "schedule", "checkpoints", "strategy"):
            self.__dict__.pop(name, None)

    def _finish(self, wall_s: float, start_step: int, val_loss, run_peak_gib: float) -> dict:
        rows = MetricsJsonl(self.run).rows()
        train_rows = [r for r in rows if "tokens_per_s" in r]
        steady = train_rows[1:] or train_rows  # the first window holds warm-up (allocation, compile)

        def steady_median(key: str) -> float:
            return float(np.median([r.get(key, 0.0) for r in steady])) if steady else 0.0

        summary = {
            "final_step": self.step,
            "final_loss": train_rows[-1]["loss"] if train_rows else None,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None,
            "first_val_loss": next((r["val_loss"] for r in rows if "val_loss" in r), None),
            "tokens_per_s": steady_median("tokens_per_s"),
            # MFU against the theoretical peak, and against the measured matmul peak of this machine
            "mfu": steady_median("mfu"),
            "mfu_of_measured_peak": steady_median("mfu_of_measured_peak"),
            "peak_rss_gib": max([run_peak_gib] + [r.get("peak_rss_gib", 0) for r in rows]),
            "wall_time_s": wall_s,
            "steps_this_session": self.step - start_step,
            "world_size": self.ranks.world_size,
            "strategy": self.cfg.parallel.strategy,
            "precision": self.cfg.hardware.precision,
            "threads_per_rank": self.cfg.hardware.threads,
            "parameters": self.counts["total"],
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak_flops,
            "peak_flops_how": self.hw.peak_formula[self.cfg.hardware.precision],
            "measured_peak_flops": self.measured_peak_flops,
            "measured_peak_flops_how": self.measured_peak_how,
            "attn_implementation": self.cfg.model.attn_implementation,
            "compile": self.cfg.model.compile,
            "chunked_loss": self.cfg.model.chunked_loss,
            "trained_parameters": self.counts["trained"],
            "lora": self.cfg.model.lora.enabled,
        }
        summary.update(comm.summarize(steady))
        self.phases.write(self.run, self.ranks)
        self.checkpoints.export(self.strategy, self.model, self.hf_config, self.tokenizer)
        self.exported = True
        if self.ranks.is_main:
            write_summary(self.run, summary)
        return summary
