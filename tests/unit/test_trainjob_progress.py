"""TrainJob progress (cputrain.metrics.trainjob_progress) against a local HTTPS endpoint that
stands in for the Kubeflow Trainer controller's status server: a certificate made here (its own
CA file), a token file, the body in the TrainJob's status format, the rate limit, a rotated
token, and an endpoint that fails, hangs or goes away mid-run without training seeing it."""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cputrain.config.file import load_config
from cputrain.errors import ConfigError
from cputrain.metrics import trainjob_progress
from cputrain.metrics.trainjob_progress import TrainJobProgress

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides

PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/llama-ft/status"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, which is also the CA file the reporter trusts."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "ca.crt", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class StatusServer:
    """The controller's endpoint as far as a client sees it: POSTs recorded with their time,
    answered with `status` (200, or 500 to fail), after `delay_s`."""

    def __init__(self, cert: Path, key: Path):
        self.requests: list[dict] = []
        self.status, self.delay_s = 200, 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(server.delay_s)
                server.requests.append({"path": self.path, "headers": dict(self.headers),
                                        "body": json.loads(body), "at": time.monotonic(),
                                        "answered": server.status})
                answer = b'{"status": "Failure", "message": "Internal error", "code": 500}'
                self.send_response(server.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        class QuietServer(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                # a client that gave up (the hanging endpoint) or refused the certificate (the CA
                # test) ends its connection mid-request: expected here, not worth a traceback
                server.dropped_connections += 1

        self.dropped_connections = 0
        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}{PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def bodies(self) -> list[dict]:
        return [r["body"]["trainerStatus"] for r in self.requests]

    def wait_for(self, n: int, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.requests) < n:
            assert time.monotonic() < deadline, f"{len(self.requests)} POSTs arrived, expected {n}"
            time.sleep(0.01)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(certificate):
    s = StatusServer(*certificate)
    yield s
    s.stop()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-1\n")
    return path


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _metrics(body: dict) -> dict[str, str]:
    return {m["name"]: m["value"] for m in body["metrics"]}


def _reporter(server, certificate, token_file, every_s: float, total_steps: int, **kw) -> TrainJobProgress:
    """A reporter posting to the test server with its token file and CA file."""
    return TrainJobProgress(server.url, str(token_file), str(certificate[0]), every_s=every_s, total_steps=total_steps,
                            **kw)


ROW = {"step": 2, "loss": 2.5, "lr": 3e-4, "grad_norm": 1.25, "tokens_per_s": 1234.5, "mfu": 0.125,
       "epoch": 0.5, "val_loss": float("nan"), "rss_gib": 1.0}


def test_the_body_is_the_trainjob_status_format_with_token_and_ca(server, certificate, token_file):
    clock = Clock()
    reporter = _reporter(server, certificate, token_file, 1.0, 10, clock=clock)
    reporter.start(0)
    server.wait_for(1)
    clock.now += 30  # the first step: warm-up, left out of the pace
    reporter.step(1, None)
    server.wait_for(2)
    clock.now += 2  # then 2 s a step: 8 steps left, 16 s
    reporter.step(2, ROW)
    server.wait_for(3)
    reporter.end(10, "finished")
    server.wait_for(4)

    first, after_warmup, mid, final = server.bodies()
    request = server.requests[2]
    assert request["path"] == PATH
    assert request["headers"]["Authorization"] == "Bearer token-1"
    assert request["headers"]["Content-Type"] == "application/json"
    assert first["progressPercentage"] == 0 and "estimatedRemainingSeconds" not in first
    assert after_warmup["progressPercentage"] == 10 and "estimatedRemainingSeconds" not in after_warmup
    assert mid["progressPercentage"] == 20 and mid["estimatedRemainingSeconds"] == 16
    assert _metrics(mid) == {"loss": "2.5", "lr": "0.0003", "grad_norm": "1.25", "tokens_per_s": "1234.5",
                             "mfu": "0.125", "epoch": "0.5", "current_step": "2", "total_steps": "10"}
    assert time.strptime(mid["lastUpdatedTime"], "%Y-%m-%dT%H:%M:%SZ")
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    assert _metrics(final)["status"] == "finished" and _metrics(final)["loss"] == "2.5"
    assert reporter.posted == 4 and reporter.failed == 0


@pytest.mark.parametrize("step, status, percent", [
    (10, "stopped", 99),  # even at the last step: 100 is for a run that finished it
    (5, "finished", 50),  # a session ended by train.stop_at_step
])
def test_an_ending_short_of_the_last_step_says_where_and_why(server, certificate, token_file, step, status, percent):
    reporter = _reporter(server, certificate, token_file, 60.0, 10)
    reporter.end(step, status)
    server.wait_for(1)
    (body,) = server.bodies()
    assert body["progressPercentage"] == percent and "estimatedRemainingSeconds" not in body
    assert _metrics(body)["status"] == status and _metrics(body)["current_step"] == str(step)


def test_a_rotated_token_file_is_read_again(server, certificate, token_file):
    clock = Clock()
    reporter = _reporter(server, certificate, token_file, 1.0, 10, clock=clock)
    reporter.start(0)
    server.wait_for(1)
    token_file.write_text("token-2\n")  # as the kubelet does before the old token expires
    clock.now += 1
    reporter.step(1, ROW)
    server.wait_for(2)
    reporter.close()
    assert [r["headers"]["Authorization"] for r in server.requests] == ["Bearer token-1", "Bearer token-2"]


def test_at_most_one_post_per_interval_and_one_at_the_end(server, certificate, token_file):
    every_s = 0.25
    reporter = _reporter(server, certificate, token_file, every_s, 1000)
    reporter.start(0)
    t0, step = time.monotonic(), 0
    while time.monotonic() - t0 < 1.1:  # a step every 5 ms
        step += 1
        reporter.step(step, ROW)
        time.sleep(0.005)
    reporter.end(1000, "finished")
    times = [r["at"] for r in server.requests]
    assert 3 <= len(times) <= 7, len(times)  # ~1.1 s / 0.25 s, plus the start and the end
    gaps = [b - a for a, b in zip(times[:-1], times[1:-1])]  # the end's POST is not held back
    assert min(gaps) >= every_s * 0.8, gaps
    assert server.bodies()[-1]["progressPercentage"] == 100


def test_a_failing_endpoint_costs_one_warning_and_never_raises(server, certificate, token_file, caplog):
    reporter = _reporter(server, certificate, token_file, 0.05, 100)
    caplog.set_level(logging.INFO, logger="cputrain")

    def steps(first: int, last: int) -> None:
        for step in range(first, last + 1):
            reporter.step(step, ROW)
            time.sleep(0.01)

    reporter.start(0)
    steps(1, 20)
    server.status = 500  # the controller answers with an error …
    steps(21, 40)
    server.status = 200  # … recovers …
    steps(41, 60)
    server.stop()  # … and goes away
    steps(61, 80)
    reporter.end(80, "finished")

    answered = [r["answered"] for r in server.requests]
    assert answered.count(500) >= 2 and answered[-1] == 200
    assert reporter.failed > answered.count(500)  # the POSTs to no server failed as well
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"TrainJob progress: POST to {server.url} failed (HTTP 500: Internal error); training "
                        "goes on, and further failures are not logged"]
    recovered = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert len(recovered) == 1


def test_a_hanging_endpoint_never_slows_a_step(server, certificate, token_file, caplog):
    server.delay_s = 1.0
    reporter = _reporter(server, certificate, token_file, 0.05, 100, timeout_s=0.3)
    slowest_s = 0.0
    for step in range(1, 60):
        t0 = time.perf_counter()
        reporter.step(step, ROW)
        slowest_s = max(slowest_s, time.perf_counter() - t0)
        time.sleep(0.01)
    t0 = time.perf_counter()
    reporter.end(60, "finished")
    assert time.perf_counter() - t0 < 0.3 + 1.5  # the end waits one timeout at most
    assert slowest_s < 0.05
    assert reporter.failed >= 1 and reporter.posted == 0
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1


def test_the_certificate_is_checked_against_the_ca_file(server, token_file, caplog):
    reporter = TrainJobProgress(server.url, str(token_file), None, every_s=1.0, total_steps=10)  # system CAs
    reporter.end(1, "finished")
    assert reporter.failed == 1 and not server.requests
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text


def test_on_only_where_the_controller_set_the_endpoint(token_file):
    assert trainjob_progress.from_env({}, 5.0, 10) is None
    env = {"KUBEFLOW_TRAINER_SERVER_URL": "https://127.0.0.1:9/status",
           "KUBEFLOW_TRAINER_SERVER_TOKEN": str(token_file), "KUBEFLOW_TRAINER_SERVER_CA_CERT": "/ca.crt"}
    assert trainjob_progress.from_env({**env, "DISABLE_KUBEFLOW_INTEGRATION": "TRUE"}, 5.0, 10) is None
    reporter = trainjob_progress.from_env(env, 5.0, 10)
    reporter.close()
    assert (reporter.url, reporter.token_file, reporter.ca_file, reporter.every_s) == (
        env["KUBEFLOW_TRAINER_SERVER_URL"], str(token_file), "/ca.crt", 5.0)


@pytest.mark.parametrize("value", ["0.5", "0", "-1"])
def test_progress_every_s_has_a_floor_of_one_second(value):
    with pytest.raises(ConfigError, match="train.progress_every_s"):
        load_config(None, [f"train.progress_every_s={value}"])


@pytest.mark.slow
def test_a_training_run_reports_its_progress(server, certificate, token_file, tmp_path, cache_dir):
    env = cli_env(KUBEFLOW_TRAINER_SERVER_URL=server.url, KUBEFLOW_TRAINER_SERVER_TOKEN=token_file,
                  KUBEFLOW_TRAINER_SERVER_CA_CERT=certificate[0])
    proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir, **{"train.progress_every_s": 1}),
                   env=env, check=True)
    assert f"TrainJob progress: reported to {server.url} at most every 1 s" in proc.stderr
    bodies = server.bodies()
    assert bodies[0]["progressPercentage"] == 0 and _metrics(bodies[0])["current_step"] == "0"
    final = _metrics(bodies[-1])
    assert bodies[-1]["progressPercentage"] == 100 and final["status"] == "finished"
    assert final["current_step"] == final["total_steps"] == "10"
    assert {"loss", "tokens_per_s", "mfu", "val_loss"} <= set(final)
    assert all(r["headers"]["Authorization"] == "Bearer token-1" for r in server.requests)
    times = [r["at"] for r in server.requests]
    assert all(b - a >= 0.9 for a, b in zip(times[:-1], times[1:-1]))
