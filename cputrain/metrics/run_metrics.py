"""The figures of one training session, owned in one place so the loop only loops.

Per step: the step's memory peak (the high-water mark is reset around every step, so "training
step peak" is a step alone; what evaluation and checkpoint saves add between steps is folded into
the run's peak, which is never understated). Per logged step: the throughput window (steps and
seconds since the last record, evaluation and saves left out), MFU against the theoretical peak
of the cores this rank was given and against the measured matmul peak of this machine, the
communication meter's window, and the record sent to metrics.jsonl and the report_to sinks;
inside a Kubeflow TrainJob, the job's progress (trainjob_progress) at most every
train.progress_every_s and at the end.
At the end: summary.json's figures, from the steady records (the first window holds warm-up).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from cputrain.config.resolved import ResolvedConfig
from cputrain.distributed import comm, process_group as pg
from cputrain.distributed.env import RankEnv
from cputrain.hardware import HardwareFacts
from cputrain.metrics import flops, memory, trainjob_progress
from cputrain.metrics.jsonl import MetricsJsonl
from cputrain.metrics.measured_peak import measured_peak_flops
from cputrain.metrics.sinks import ReportSinks
from cputrain.run_folder.layout import RunFolder

log = logging.getLogger("cputrain")


class RunMetrics:
    def __init__(self, cfg: ResolvedConfig, hw: HardwareFacts, ranks: RankEnv, run: RunFolder, counts: dict,
                 hf_config, meter: comm.CommMeter, total_steps: int, summary_figures: tuple[str, ...] = (),
                 perplexity: bool = True, items: str = "preference pairs"):
        """`summary_figures`: the objective's figures summary.json carries (its summary_figures;
        empty for the language-model loss, which has none and counts no pairs). `perplexity`:
        whether the loss is a mean per trained target (else exp of it is no perplexity: not
        reported); `items`: what the objective's batch counts (preference pairs, feedback examples)."""
        self.cfg, self.hw, self.ranks, self.run, self.counts = cfg, hw, ranks, run, counts
        self.summary_figures, self.perplexity, self.items = summary_figures, perplexity, items
        self.meter, self.total_steps = meter, total_steps
        self.sinks: ReportSinks | None = None  # rank 0's, opened by open_sinks() once the resume step is known
        self.guard: Callable[[], None] = lambda: None  # raises if this run no longer owns its folder
        self.progress: trainjob_progress.TrainJobProgress | None = None  # rank 0's, inside a TrainJob
        self.flops_per_token = flops.flops_per_token(
            counts["non_embedding"], hf_config.num_hidden_layers, hf_config.hidden_size, cfg.data.seq_len,
            trained_params=counts["trained_non_embedding"],  # LoRA: weight gradients of the adapters only
        )
        # MFU is against the cores this rank was given, so it reads the same at any rank count.
        share = cfg.hardware.threads / max(1, hw.physical_cores)
        self.peak_flops = hw.peak_flops[cfg.hardware.precision] * min(1.0, share) * ranks.world_size
        measured, self.measured_peak_how = measured_peak_flops(hw.cpu_model, hw.flags, cfg.hardware.threads,
                                                               cfg.hardware.dtype, apart=True)
        self.measured_peak_flops = measured * ranks.world_size
        self.start_step = self._step = 0
        self.steps_this_session = 0
        self.step_peak_gib = self.run_peak_gib = 0.0
        self.last_val_loss: float | None = None
        self.wall_s = 0.0
        self._wall0 = self._window_t0 = 0.0
        self._window_steps = 0
        self._window_trained = self._window_tokens = 0  # of the global batches in the window
        self._window_pairs = 0  # preference pairs of those global batches (0 for other objectives)
        self._bar: tqdm | None = None
        # A live bar where a person watches a terminal; plain log lines in CI logs and pod logs.
        self._live = ranks.is_main and sys.stderr.isatty()

    def open_sinks(self, resumed_step: int, guard: Callable[[], None]) -> None:
        """Rank 0: metrics.jsonl loses the rows of steps trained again; the report_to sinks open."""
        if self.ranks.is_main:
            self.sinks, self.guard = ReportSinks(self.run, self.cfg, resumed_step), guard
            self.progress = trainjob_progress.from_env(os.environ, self.cfg.train.progress_every_s, self.total_steps)
            if self.progress is not None:
                log.info("TrainJob progress: reported to %s at most every %g s", self.progress.url,
                         self.progress.every_s)

    def end_progress(self, step: int, status: str) -> None:
        """Rank 0, inside a TrainJob: the ending's report (100% once finished, else the step and
        the status: stopped, diverged, failed, interrupted)."""
        if self.progress is not None:
            self.progress.end(step, status)
            self.progress = None

    def close_sinks(self) -> None:
        if self.sinks is not None:  # flushes the sinks' files, also on an error exit
            self.sinks.close()
            self.sinks = None
        if self.progress is not None:  # an exit before any ending was reported
            self.progress.close()
            self.progress = None

    # --------------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        self.start_step = self._step = step
        if self.progress is not None:
            self.progress.start(step)
        self._bar = tqdm(total=self.total_steps, initial=step, disable=not self._live, desc="train", unit="step",
                         dynamic_ncols=True, mininterval=1.0)
        self._wall0 = self._window_t0 = time.perf_counter()
        memory.reset_peak()

    @contextlib.contextmanager
    def step(self):
        """Around one optimizer step: its own memory peak, counted into the window."""
        self.run_peak_gib = max(self.run_peak_gib, memory.peak_rss_gib())
        memory.reset_peak()
        yield
        self.step_peak_gib = max(self.step_peak_gib, memory.peak_rss_gib())
        self._window_steps += 1
        self.steps_this_session += 1

    def record(self, step: int, loss: float, grad_norm: float, lr: float, epoch: float, trained: int,
               tokens: int, figures: dict | None = None, pairs: int | None = None) -> dict | None:
        """Counts a step's trained targets and processed tokens (of the global batch), and returns
        the row of a logged step (every train.log_every and the last), None between them. Every
        rank calls it: the loss is averaged over the ranks. `figures`: the objective's, of the
        step's global batch (preference: TRL's rewards/… and logps/…), already the same on every rank;
        `pairs`: the preference pairs of the global batch (pairs_per_s), None for other objectives."""
        self._step = step
        self._window_trained += trained
        self._window_tokens += tokens
        self._window_pairs += pairs or 0
        if step % self.cfg.train.log_every != 0 and step != self.total_steps:
            return None
        elapsed_s = time.perf_counter() - self._window_t0
        # every token the model ran on (padding included), which MFU counts; and those that carried loss
        tps = self._window_tokens / elapsed_s
        mfu = flops.mfu(tps, self.flops_per_token, self.peak_flops)
        row = {
            "step": step,
            "loss": pg.all_reduce_mean(loss),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "trained_tokens_per_s": self._window_trained / elapsed_s,
            # the pairs of a step's global batch (TRL's batch), a mean over the window's steps: packed
            # rows hold a varying number of pairs
            **({"pairs_per_s": self._window_pairs / elapsed_s, "pairs_per_step": self._window_pairs /
                self._window_steps} if pairs is not None else {}),
            "mfu": mfu,
            "mfu_of_measured_peak": flops.mfu(tps, self.flops_per_token, self.measured_peak_flops),
            "step_time_s": elapsed_s / self._window_steps,
            "rss_gib": memory.rss_gib(),
            "peak_rss_gib": max(self.run_peak_gib, memory.peak_rss_gib()),
            "epoch": epoch,
        }
        row.update(figures or {})
        row.update(self.meter.window())
        self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{mfu:.1%}")
        if self.ranks.is_main and not self._live:
            pairs = (f"  {row['pairs_per_step']:.4g} pairs/step  {row['pairs_per_s']:.1f} pairs/s  reward acc "
                     f"{row['rewards/accuracies']:.2f} margin {row['rewards/margins']:.4f}"
                     if "rewards/accuracies" in row else "")
            log.info("step %d/%d  loss %.4f  lr %.2e  %s tok/s  MFU %.1f%%%s", step, self.total_steps,
                     row["loss"], row["lr"], f"{tps:,.0f}", 100 * mfu, pairs)
        self._window_t0, self._window_steps = time.perf_counter(), 0
        self._window_trained = self._window_tokens = self._window_pairs = 0
        return row

    def with_validation(self, row: dict | None, step: int, val_loss: float, figures: dict | None = None) -> dict:
        self.last_val_loss = val_loss
        row = row or {"step": step}
        row["val_loss"] = val_loss
        if self.perplexity:
            row["val_ppl"] = math.exp(min(val_loss, 50))
        row.update(figures or {})
        if figures and self.ranks.is_main and "eval_rewards/accuracies" in figures:
            log.info("step %d  validation: loss %.4f  reward accuracy %.3f  margin %.4f", step, val_loss,
                     figures["eval_rewards/accuracies"], figures["eval_rewards/margins"])
        self.exclude_pause()  # evaluation time is not training throughput
        return row

    def exclude_pause(self) -> None:
        """Time since the last step (an evaluation, a checkpoint save) is left out of the window."""
        self._window_t0 = time.perf_counter()

    def exclude_s(self, seconds: float) -> None:
        """Leave `seconds` of work done since the window began, outside any step's own work (starting
        and stopping the profiler of train.profile_step, writing its files), out of the window."""
        self._window_t0 += seconds

    def publish(self, row: dict | None) -> None:
        """Rank 0 writes the row (metrics.jsonl and the sinks); the bar moves one step."""
        if row and self.sinks is not None:
            self.guard()  # another run took the folder over: stop before writing beside it
            self.sinks.log(row)
        if self.progress is not None:  # every step: between reports it only reads a clock
            self.progress.step(self._step, row)
        self._bar.update(1)

    def stop(self) -> None:
        self._bar.close()
        self.run_peak_gib = max(self.run_peak_gib, memory.peak_rss_gib())
        self.wall_s = time.perf_counter() - self._wall0

    # --------------------------------------------------------------------------------------
    def summary(self, final_step: int) -> dict:
        """summary.json's figures: medians of the steady windows, peaks, and what the run was."""
        rows = MetricsJsonl(self.run).rows()
        train_rows = [r for r in rows if "tokens_per_s" in r]
        steady = train_rows[1:] or train_rows  # the first window holds warm-up (allocation, compile)

        def steady_median(key: str) -> float:
            return float(np.median([r.get(key, 0.0) for r in steady])) if steady else 0.0

        cfg, val_loss = self.cfg, self.last_val_loss
        summary = {
            "final_step": final_step,
            "final_loss": train_rows[-1]["loss"] if train_rows else None,
            "val_loss": val_loss,
            **({"val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None} if self.perplexity else {}),
            "first_val_loss": next((r["val_loss"] for r in rows if "val_loss" in r), None),
            "tokens_per_s": steady_median("tokens_per_s"),
            "trained_tokens_per_s": steady_median("trained_tokens_per_s"),
            "mfu": steady_median("mfu"),
            "mfu_of_measured_peak": steady_median("mfu_of_measured_peak"),
            "peak_rss_gib": max([self.run_peak_gib] + [r.get("peak_rss_gib", 0) for r in rows]),
            "wall_time_s": self.wall_s,
            "steps_this_session": final_step - self.start_step,
            "world_size": self.ranks.world_size,
            "strategy": cfg.parallel.strategy,
            "precision": cfg.hardware.precision,
            "threads_per_rank": cfg.hardware.threads,
            "parameters": self.counts["total"],
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak_flops,
            "peak_flops_how": self.hw.peak_formula[cfg.hardware.precision],
            "measured_peak_flops": self.measured_peak_flops,
            "measured_peak_flops_how": self.measured_peak_how,
            "attn_implementation": cfg.model.attn_implementation,
            "compile": cfg.model.compile,
            "chunked_loss": cfg.model.chunked_loss,
            "trained_parameters": self.counts["trained"],
            "lora": cfg.model.lora.enabled,
        }
        summary.update(comm.summarize(steady))
        summary.update(_objective_figures(rows, cfg.train.objective, self.summary_figures))
        # online RL logs no pairs_per_s on its steps (its objective logs_item_rate=False)
        if self.summary_figures and (not train_rows or any("pairs_per_s" in r for r in train_rows)):
            summary["items"] = self.items  # what pairs_per_s and pairs_per_step count
            summary["pairs_per_s"] = steady_median("pairs_per_s")
            # every logged step's, not only the steady ones: a count, not a speed
            per_step = [r["pairs_per_step"] for r in train_rows if "pairs_per_step" in r]
            summary["pairs_per_step"] = float(np.mean(per_step)) if per_step else None
        return summary


def _objective_figures(rows: list[dict], objective: str, figures: tuple[str, ...]) -> dict:
    """The figures of a run whose objective has them (TRL's names: `figures`, those of them it
    logged, all of them before any step), the last logged step's, the first and last validation's
    (eval_…, with first_eval_… of the accuracy and margin to read what training changed)."""
    if not figures:
        return {}
    out = {"objective": objective}
    keys = [key for key in figures if any(key in r for r in rows)] or list(figures)
    trained = [r for r in rows if keys[0] in r]
    evals = [r for r in rows if f"eval_{keys[0]}" in r]
    for key in keys:
        out[key] = trained[-1].get(key) if trained else None
        out[f"eval_{key}"] = evals[-1].get(f"eval_{key}") if evals else None
    for key in ("rewards/accuracies", "rewards/margins", "accuracy", "margin"):
        if key in keys:
            out[f"first_eval_{key}"] = evals[0].get(f"eval_{key}") if evals else None
    return out
