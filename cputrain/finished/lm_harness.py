"""Benchmark tasks through lm-evaluation-harness (`cputrain eval RUN --tasks …`): the model loaded
as `generate` loads it, wrapped in the harness's HFLM as an object (not a hub id, so nothing is
fetched and a LoRA run is its adapters on their base), evaluated in this process with the run's
precision and threads; one JSON file per task under RUN/eval/ and a table.

lm_eval is an optional extra (`pip install 'cputrain[eval]'`); nothing here imports it at module
level, so the rest of cputrain never pays for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cputrain.errors import ConfigError, DataError, UserError, first_line

log = logging.getLogger("cputrain")

INSTALL_HINT = "pip install 'cputrain[eval]' (or: pip install lm_eval)"


def require_lm_eval():
    """The lm_eval package, or a one-line refusal that says how to install it."""
    try:
        import lm_eval
        from lm_eval.evaluator import simple_evaluate  # noqa: F401 (the parts used below import)
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as exc:
        raise UserError(f"--tasks runs lm-evaluation-harness, which is not installed here ({first_line(exc)}); "
                        f"{INSTALL_HINT}") from None
    return lm_eval


@dataclass(frozen=True)
class TaskSelection:
    """What --tasks names: task names to evaluate, the folders the harness indexes for the local
    ones, and whether its own registry is needed (building that index reads ~15,000 YAML files:
    about 11 s on a loaded 2-core machine, so a run of local tasks alone skips it)."""

    names: list[str]
    include_paths: list[str]
    needs_registry: bool


def _yaml_task_name(path: Path, groups: bool = False) -> str | None:
    """The `task:` of a harness task YAML (with `groups`, a group YAML's `group:`), else None (a
    template without a name, or a group where only tasks are asked for). Read with
    a loader that keeps the harness's own tags (`!function …`) as plain text: only the name is
    needed here, and the harness resolves the rest itself."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        cfg = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"task file '{path}' could not be read: {first_line(exc)}") from None
    if not isinstance(cfg, dict):
        return None
    name = cfg.get("group") if groups and isinstance(cfg.get("group"), str) else cfg.get("task")
    return name if isinstance(name, str) else None


def select_tasks(tasks: str) -> TaskSelection:
    """--tasks a,b,path.yaml,folder/: registry names as they are; a YAML file is its task or
    group; a folder is every task YAML under it (its groups and templates are read by the harness
    where they are named or included, not evaluated on their own: a group would run its tasks twice)."""
    names, include, registry = [], [], False
    for word in (w.strip() for w in tasks.split(",")):
        if not word:
            continue
        path = Path(word).expanduser()
        if path.is_file():
            name = _yaml_task_name(path, groups=True)
            if name is None:
                raise ConfigError(f"task file '{path}' names no task (a harness task YAML has a `task:` key, "
                                  "a group's a `group:` key)")
            names.append(name)
            include.append(str(path.resolve().parent))
        elif path.is_dir():
            found = [n for p in sorted(path.rglob("*.yaml")) if (n := _yaml_task_name(p))]
            if not found:
                raise ConfigError(f"folder '{path}' holds no task YAML (a harness task YAML has a `task:` key)")
            names += found
            include.append(str(path.resolve()))
        elif word.endswith((".yaml", ".yml")) or os.sep in word:
            raise ConfigError(f"task file or folder '{word}' not found")
        else:
            names.append(word)
            registry = True
    if not names:
        raise ConfigError("--tasks names no task; give task names or a task YAML, comma-separated")
    # A folder inside another given one is indexed once (twice, the harness warns of every task in it).
    folders = sorted(set(include), key=len)
    outer = [f for i, f in enumerate(folders) if not any(Path(f).is_relative_to(o) for o in folders[:i])]
    return TaskSelection(list(dict.fromkeys(names)), outer, registry)


@contextlib.contextmanager
def _logger_level(name: str, level: int):
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def load_tasks(selection: TaskSelection) -> tuple[object, list]:
    """The harness's task index for `selection` and its tasks built (each reads its data then), so
    an unknown name, a task file the harness refuses or data that cannot be read is said before
    a model is loaded."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    with _logger_level("lm_eval", logging.WARNING):
        manager = TaskManager(include_path=selection.include_paths or None,
                              include_defaults=selection.needs_registry)
        unknown = [n for n in selection.names if n not in manager.all_tasks]
        if unknown:
            where = "lm-evaluation-harness's registry" if selection.needs_registry else "the task files given"
            raise ConfigError(f"unknown task {', '.join(repr(n) for n in unknown)}: not in {where}; "
                              "give a registry name, a task YAML or a folder of them")
        items = []
        for name in selection.names:
            try:
                loaded = manager.load([name])
            except OSError as exc:  # ConnectionError (a registry task without a hub), FileNotFoundError
                raise DataError(f"task '{name}': its data could not be loaded: {first_line(exc)}") from exc
            except (ValueError, KeyError, TypeError) as exc:  # the chain stays for --debug
                raise ConfigError(f"task '{name}' could not be built by lm-evaluation-harness: "
                                  f"{first_line(exc)}") from exc
            # a group as itself (its aggregate is reported); a task, or a tag's tasks, one by one
            items += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
        try:
            manager.load(items)  # what simple_evaluate does with them first: refuses a task asked twice
        except ValueError as exc:
            raise ConfigError(f"--tasks: {first_line(exc)}") from exc
    return manager, items


def run_tasks(model, tokenizer, manager, items: list, *, limit: int | None, num_fewshot: int | None,
              batch_size: int, bf16: bool) -> dict:
    """simple_evaluate on the model object, under the autocast training used (bf16 runs compute
    in bf16 on fp32 weights), samples kept (each answer's log-likelihood, for checking a result)."""
    import torch
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    # The harness logs each step at INFO; its warnings are shown.
    with _logger_level("lm_eval", logging.WARNING):
        # Its one warning here says the model is an object, not a hub id: that is on purpose.
        with _logger_level("lm_eval.models.huggingface", logging.ERROR):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return simple_evaluate(model=lm, tasks=items, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=True)


def _metric_rows(task_result: dict) -> list[tuple[str, float, float | None]]:
    """(metric, value, stderr) from the harness's "acc,none"/"acc_stderr,none" keys; a filter
    other than "none" is kept in the metric's name."""
    rows = []
    for key, value in task_result.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        metric, filt = key.split(",", 1)
        stderr = task_result.get(f"{metric}_stderr,{filt}")
        name = metric if filt == "none" else f"{metric} ({filt})"
        rows.append((name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None))
    return rows


def _free_name(folder: Path, stem: str) -> Path:
    """folder/stem.json, or stem-2.json, stem-3.json … where it exists: an earlier result (another
    --limit, --num-fewshot or model state) is never replaced."""
    n = 1
    while True:
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            path.open("x").close()  # claimed at once, so two evaluations cannot pick the same name
            return path
        except FileExistsError:
            n += 1


def write_results(results: dict, out_dir: Path, settings: dict) -> dict[str, Path]:
    """One file per task: out_dir/<task>.json (metrics, sample counts, the task's config and this
    run's settings) and beside it <task>.samples.jsonl (every document's requests and the
    log-likelihoods of its answers). Returns {task: path of its JSON}."""
    import json

    from lm_eval.utils import handle_non_serializable

    from cputrain.metrics.finite_json import dumps

    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for task, task_result in results["results"].items():
        path = _free_name(out_dir, task.replace(os.sep, "_"))
        record = {
            "task": task,
            "metrics": {m: {"value": v, "stderr": s} for m, v, s in _metric_rows(task_result)},
            "n_samples": _n_samples(results, task),
            **settings,
            "version": results.get("versions", {}).get(task),
            "lm_eval_version": results.get("lm_eval_version"),
        }
        if task in results.get("configs", {}):
            record["task_config"] = results["configs"][task]
        else:  # a group: its metrics aggregate its tasks', which have files of their own
            record["group_tasks"] = results.get("group_subtasks", {}).get(task, [])
        path.write_text(dumps(json.loads(json.dumps(record, default=handle_non_serializable)), indent=2) + "\n")
        if task in results.get("samples", {}):
            with open(path.with_suffix(".samples.jsonl"), "w") as f:
                for sample in results["samples"][task]:
                    f.write(json.dumps(sample, default=handle_non_serializable) + "\n")
        written[task] = path
    return written


def _n_samples(results: dict, task: str) -> dict | None:
    """{"original": documents in the task, "effective": documents evaluated (--limit)}; a group's
    effective count is its tasks' together."""
    counts = results.get("n-samples", {}).get(task)
    if counts is None and "sample_len" in results["results"].get(task, {}):
        counts = {"effective": results["results"][task]["sample_len"]}
    return counts


def table_lines(results: dict, written: dict[str, Path]) -> list[str]:
    """task | n | metric | value | stderr, one row per metric, then where each file went."""
    rows = [("task", "n", "metric", "value", "stderr")]
    for task in written:
        n = (_n_samples(results, task) or {}).get("effective", "")
        for metric, value, stderr in _metric_rows(results["results"][task]):
            rows.append((task, str(n), metric, f"{value:.4f}", "" if stderr is None else f"{stderr:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) if i in (0, 2) else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             .rstrip() for r in rows]
    return lines + [f"{task}: {path}" for task, path in written.items()]


def evaluate_run(path: str, selection: TaskSelection, cfg, settings_from: str, *, limit: int | None,
                 num_fewshot: int | None, batch_size: int | None, out_dir: Path) -> tuple[dict, dict[str, Path]]:
    """The model of `path` (a run's model/, a LoRA run's adapters on their base, or a model
    folder) loaded as `generate` loads it, evaluated with `cfg`'s precision and threads."""
    import torch

    from cputrain.finished.load import load_for_inference, model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder

    folder = model_folder(path)  # a run without a model is refused here, before anything loads
    manager, items = load_tasks(selection)  # and an unknown task or unreadable data
    threads, precision = cfg.hardware.threads, cfg.hardware.precision
    batch_size = batch_size or cfg.train.micro_batch_size
    torch.set_num_threads(threads)
    model, tokenizer = load_for_inference(path, cfg.model.trust_remote_code)
    kind = "LoRA adapters on their base" if is_adapter_folder(Path(folder)) else "Hugging Face model"
    compute = "bf16 autocast on fp32 weights" if precision == "bf16" else "fp32"
    log.info("eval: %s (%s), %s, %d thread(s), batch %d (from %s)", folder, kind, compute, threads, batch_size,
             settings_from)
    results = run_tasks(model, tokenizer, manager, items, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
                        bf16=precision == "bf16")
    settings = {"model": folder, "precision": precision, "threads": threads, "batch_size": batch_size,
                "limit": limit, "num_fewshot": num_fewshot}
    return results, write_results(results, out_dir, settings)
