"""Where logged rows go: metrics.jsonl always, and each tool `train.report_to` names.

Every sink receives the same rows as metrics.jsonl (one dict per logged step, the keys as
they are there) and the resolved config as hyperparameters. All are offline by default, so a
run never needs a network: TensorBoard event files in <output_dir>/tensorboard, MLflow's local
store in <output_dir>/mlruns (unless MLFLOW_TRACKING_URI points elsewhere), W&B in offline mode
under <output_dir>/wandb (unless WANDB_MODE says otherwise; `wandb sync` uploads it later).
Each tool is an optional extra, imported only when named; rank 0 alone writes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

from cputrain.run_folder.layout import RunFolder
from cputrain.config import Config
from cputrain.errors import ConfigError
from cputrain.metrics.jsonl import MetricsJsonl

# report_to name -> (module that must import, the extra that installs it)
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(cfg: Config) -> None:
    """Before any work: each tool report_to names can be imported, else one line naming the install."""
    for name in cfg.train.report_to:
        if name in EXTRAS and not _importable(EXTRAS[name][0]):
            extra = EXTRAS[name][1]
            raise ConfigError(f"train.report_to={name} needs the {extra} package, which is not installed: "
                              f"pip install 'cputrain[{extra}]' (scripts/install.sh {extra})")
        if name in EXTRAS and RunFolder(cfg.output_dir).local_path() is None:
            raise ConfigError(f"train.report_to={name} writes its files into the run folder, which must be local "
                              f"for it (output_dir is '{cfg.output_dir}'); drop {name} from train.report_to")


def hyperparameters(cfg: Config) -> dict[str, str | int | float | bool]:
    """The resolved config as flat `section.key` → scalar (lists, dicts and None as JSON text)."""
    flat: dict = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and not dotted.startswith("model.arch"):
                walk(value, dotted + ".")
            elif isinstance(value, (bool, int, float, str)):
                flat[dotted] = value
            else:
                flat[dotted] = json.dumps(value, sort_keys=True)

    walk(cfg.model_dump(mode="json"), "")
    return flat


def _scalars(record: dict) -> dict[str, float]:
    """The numbers of a row, less `step` and any null (no validation data, a diverged value)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardSink:
    def __init__(self, folder: Path, cfg: Config, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: TensorBoard hides what an earlier session logged after the checkpoint this
        # one resumes from, as metrics.jsonl drops those rows (the steps are trained again).
        self.writer = SummaryWriter(str(folder / "tensorboard"), purge_step=resumed_step + 1 if resumed_step else None)
        flat = hyperparameters(cfg)
        for summary in hparams(flat, {}):  # in this run's own event file, not a sub-run as add_hparams makes
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flat.items()))

    def log(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class MLflowSink:
    def __init__(self, folder: Path, cfg: Config, resumed_step: int):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the plain-file store (no database, no server); MLflow 3 asks for this opt-in
            uri = (folder / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "cputrain")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run_id_file = folder / "mlruns" / "cputrain_run_id"
        run_id = run_id_file.read_text().strip() if resumed_step and run_id_file.is_file() else None
        if run_id is None:  # a resumed session continues the same MLflow run
            run_id = self.client.create_run(experiment_id, run_name=folder.name).info.run_id
            run_id_file.parent.mkdir(parents=True, exist_ok=True)
            run_id_file.write_text(run_id + "\n")
            params = [Param(k, str(v)[:500]) for k, v in hyperparameters(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
        self.run_id = run_id

    def log(self, record: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["step"]) for k, v in _scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbSink:
    def __init__(self, folder: Path, cfg: Config, resumed_step: int):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # no network unless the user asks for it
        os.environ.setdefault("WANDB_SILENT", "true")
        import hashlib

        run_id = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]  # one W&B run per run folder
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "cputrain"), name=folder.name, id=run_id,
                              resume="allow", dir=str(folder), config=hyperparameters(cfg))

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MLflowSink, "wandb": WandbSink}


class ReportSinks:
    """Rank 0's logged rows: appended to metrics.jsonl, then handed to every other sink."""

    def __init__(self, run: RunFolder, cfg: Config, resumed_step: int):
        self.file = MetricsJsonl(run)
        self.file.drop_after(resumed_step)
        local = run.local_path()
        self.sinks = [SINKS[name](Path(local), cfg, resumed_step) for name in dict.fromkeys(cfg.train.report_to)
                      if name in SINKS]

    def log(self, record: dict) -> None:
        self.file.append(record)
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
