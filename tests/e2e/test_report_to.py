"""train.report_to: the rows of metrics.jsonl, read back from each tool's own files with that tool's
own reader (TensorBoard's event reader, MLflow's client, W&B's offline run folder), and the
one line a missing extra prints."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides

OPTIONAL = [name for name in ("mlflow", "wandb") if importlib.util.find_spec(name) is not None]


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory, cache_dir):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is part of the test install (EXTRAS_TEST)")
    out = tmp_path_factory.mktemp("report") / "run"
    sinks = ",".join(["jsonl", "tensorboard", *OPTIONAL])
    env = cli_env(WANDB_MODE="offline", WANDB_SILENT="true")
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        env.pop(key, None)
    run_cli("train", *tiny_overrides(out, cache_dir, **{"train.report_to": f"[{sinks}]"}), env=env, check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)  # event files hold float32


def test_tensorboard_event_file_holds_the_same_scalars(reported_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, rows = reported_run
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss"} <= tags
    for key in ("loss", "lr", "val_loss"):
        logged = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        read = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in read] == [s for s, _ in logged], key
        assert all(_close(a, b) for (_, a), (_, b) in zip(read, logged)), key
    # The resolved config as hyperparameters: no "auto" left in them.
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["train.max_steps"].number_value == 10
    assert hparams["parallel.strategy"].string_value == "single"
    assert hparams["hardware.threads"].number_value == 1


@pytest.mark.skipif("mlflow" not in OPTIONAL, reason="the mlflow extra is not installed")
def test_mlflow_local_store_holds_the_same_scalars(reported_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    out, rows = reported_run
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = (out / "mlruns" / "cputrain_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.data.params["train.max_steps"] == "10" and run.data.params["parallel.strategy"] == "single"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    logged = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in history] == [s for s, _ in logged]
    assert all(_close(a, b) for (_, a), (_, b) in zip(history, logged))
    assert run.info.status == "FINISHED"


@pytest.mark.skipif("wandb" not in OPTIONAL, reason="the wandb extra is not installed")
def test_wandb_writes_an_offline_run_in_the_run_folder(reported_run):
    out, _ = reported_run
    offline = list((out / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, offline
    assert list(offline[0].glob("*.wandb")), "the offline run's data file (what `wandb sync` uploads)"


def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, monkeypatch):
    """A tool that does not import ends the run before any work, in one line, with exit code 2
    (in this process: the refusal comes before the worker, which run_cli_here would fail on)."""
    # tensorboard is hidden from cputrain's own check only: hiding it from the import system
    # would also break libraries that probe for it while importing (accelerate, when installed).
    import cputrain.metrics.sinks as sinks

    found = sinks._importable
    monkeypatch.setattr(sinks, "_importable", lambda module: module != "tensorboard" and found(module))
    out = tmp_path / "run"
    proc = run_cli_here("train", f"output_dir={out}", "train.report_to=[tensorboard]", cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("cputrain: error: train.report_to=tensorboard needs the tensorboard package, which is not "
                         "installed: pip install 'cputrain[tensorboard]' (scripts/install.sh tensorboard)")
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # refused before anything was written
