"""What the distributed tests share: free ports, run figures, and a check that no rank outlives its test."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text` (a test's unique output folder)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in part for part in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_survivors(text: str, grace_s: float = 10.0) -> None:
    deadline = time.time() + grace_s
    while time.time() < deadline:
        if not processes_mentioning(str(text)):
            return
        time.sleep(0.2)
    left = processes_mentioning(str(text))
    for p in left:
        p.kill()
    raise AssertionError(f"{len(left)} process(es) outlived the run: {[p.pid for p in left]}")
