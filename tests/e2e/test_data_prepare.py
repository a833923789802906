"""`cputrain prepare` and the data path of `train` as a user runs them: bounded memory on
corpora the tests build, a killed preparation resumed, ranks that wait past the collective
timeout, and bad corpora refused in one line."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness.run_cli import run_cli
from harness.start_cli import start_cli
from harness.tiny_run import tiny_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from cputrain.data import sources, tokenizer

    folder = tmp_path_factory.mktemp("tok") / "bpe"
    tokenizer.train_bpe(sources._pydoc_documents(), 512, folder)
    return folder


def write_jsonl(path: Path, size_bytes: int, chat: bool = False) -> Path:
    """Python's documentation repeated, one paragraph per record, numbered so no two are alike;
    with `chat`, each paragraph is the answer of a conversation."""
    from cputrain.data.sources import _pydoc_documents

    docs, written, i = _pydoc_documents(), 0, 0
    with open(path, "w") as f:
        while written < size_bytes:
            text = f"{i}: {docs[i % len(docs)]}"
            record = {"messages": [{"role": "user", "content": f"Paragraph {i}?"},
                                   {"role": "assistant", "content": text}]} if chat else {"text": text}
            line = json.dumps(record) + "\n"
            f.write(line)
            written += len(line)
            i += 1
    return path


def prepare(corpus, cache, tokenizer_dir, *extra, **kw):
    return run_cli("prepare", f"data.source={corpus}", f"data.cache_dir={cache}", f"model.tokenizer={tokenizer_dir}",
                   "data.seq_len=64", *extra, **kw)


def stats_of(cache: Path) -> dict:
    return json.loads(next((cache / "packed").glob("*/stats.json")).read_text())


@pytest.mark.fresh_interpreter  # the processes' peak RSS is measured: each starts as a user's would
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_peak_memory_is_flat_with_corpus_size(tmp_path, tokenizer_dir, kind):
    """Chat records go through the same preparation: rendered, masked and written as they come."""
    peaks = {}
    chat = ("data.format=chat", "data.seq_len=512") if kind == "chat" else ()
    # 6× the text; below ~4 MB the workers' peak is still rising to its steady state (2 MB of chat
    # peaked at 0.36 GiB, 12 MB at 0.62): the smaller corpus must reach it
    small, large = 4, 24
    for mb in (small, large):
        corpus = write_jsonl(tmp_path / f"c{mb}.jsonl", mb * 10**6, chat=kind == "chat")
        prepare(corpus, tmp_path / f"cache{mb}", tokenizer_dir, "data.num_proc=2", *chat, check=True)
        stats = stats_of(tmp_path / f"cache{mb}")
        assert stats["num_proc"] == 2
        peaks[mb] = stats["peak_memory_gib"]
    # 6× the text, and the token cache of the larger one (~13 MB) is far from the bound:
    # what grows with the corpus lives on disk, not in the parent or its workers.
    assert peaks[large] <= peaks[small] * 1.15 + 0.05, peaks
    assert peaks[large] < 2.0, peaks


def _wait_for_progress(proc, cache: Path, beyond_rows: int) -> dict:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((cache / "packed").glob("*.partial/progress.json")) if (cache / "packed").exists() else []
        if found and json.loads(found[0].read_text())["rows_done"] > beyond_rows:
            return json.loads(found[0].read_text())
        time.sleep(0.2)
    proc.kill_tree()
    raise AssertionError(f"preparation committed no progress past record {beyond_rows}: {proc.stderr()[-2000:]}")


def test_stopped_and_killed_preparation_resumes_where_it_stopped(tmp_path, tokenizer_dir):
    """SIGTERM to the command (what `kill`, a Job's deletion or a pod's stop sends; the workers
    get nothing): one line, exit 75, the partial cache and its progress kept, the lock released
    and no process of the preparation left. Then a SIGKILL to every process, as a node loss
    would. Each resume goes on from what reached the disk, and the result is the same bytes as a
    preparation that was never interrupted."""
    import psutil

    # 32 chunks of ~1 MB: a stop, a kill and a resume. Progress is committed every 2 s, and the kill
    # must come after the resumed run's first commit and before its end. On a quiet core the first
    # commit came at 23,700 to 37,920 records (12,000–17,000 records/s), and on 12 MB (47,800
    # records) or 16 MB (63,800) the resumed run finished the rest before it committed anything.
    corpus = write_jsonl(tmp_path / "c.jsonl", 32 * 10**6)
    cache = tmp_path / "cache"
    args = ["prepare", f"data.source={corpus}", f"data.cache_dir={cache}", f"model.tokenizer={tokenizer_dir}",
            "data.seq_len=64", "data.num_proc=2"]
    with start_cli(*args) as proc:
        progress = _wait_for_progress(proc, cache, 0)
        under = psutil.Process(proc.pid).children(recursive=True)
        assert len(under) >= 3, under  # the builder and its 2 tokenizing workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    stderr = proc.stderr()
    assert proc.returncode == 75, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].startswith("cputrain: stopped by SIGTERM while preparing the data of ")
    assert "Traceback" not in stderr, stderr[-2000:]
    gone, alive = psutil.wait_procs(under, timeout=5)
    assert not alive, f"outlived the command: {alive}"
    assert not list((cache / "packed").glob("*.lock")), "the lock was not released"
    stopped_at = json.loads(next((cache / "packed").glob("*.partial/progress.json")).read_text())["rows_done"]
    assert stopped_at >= progress["rows_done"] > 0

    # One tokenizing process: the resumed run takes twice as long as the stopped one did per
    # record, so at any speed of the machine its first commit comes well before its end.
    with start_cli(*args[:-1], "data.num_proc=1") as proc:
        progress = _wait_for_progress(proc, cache, stopped_at)
        proc.kill_tree()  # the parent and its workers, as a node loss would
    assert not any(p.suffix == "" for p in (cache / "packed").iterdir()), "a half-built cache looks complete"

    # The lock of the killed process (same host, pid gone) is taken over at once, not after
    # data.lock_stale_s (300 s by default): the timeout below is shorter than that.
    again = prepare(corpus, cache, tokenizer_dir, "data.num_proc=2", timeout=240, check=True)
    assert "resuming an interrupted preparation" in again.stderr
    resumed = stats_of(cache)
    assert resumed["resumed_at_record"] >= progress["rows_done"] > stopped_at

    clean = tmp_path / "clean"
    prepare(corpus, clean, tokenizer_dir, "data.num_proc=1", check=True)
    for name in ("train.bin", "val.bin"):
        a = next((cache / "packed").glob(f"*/{name}")).read_bytes()
        b = next((clean / "packed").glob(f"*/{name}")).read_bytes()
        assert a == b, f"{name} differs from an uninterrupted preparation"


@pytest.mark.alone  # its collectives time out after 2 s: a test beside it on 2 cores can starve a rank that long
def test_two_ranks_wait_for_a_preparation_longer_than_the_collective_timeout(tmp_path, tokenizer_dir):
    # large enough that preparing it outlasts twice the timeout on a fast core (24 MB took 5.3 s on a Zen 4 EPYC)
    corpus = write_jsonl(tmp_path / "c.jsonl", 32 * 10**6)
    cache = tmp_path / "cache"
    timeout_s = 2
    proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache, **{
        "data.source": corpus, "model.tokenizer": tokenizer_dir, "data.max_documents": "null",
        "parallel.timeout_s": timeout_s, "train.max_steps": 4, "train.eval_every": 4, "train.checkpoint_every": 4,
        "data.num_proc": 1}), "--nproc-per-node", "2", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = stats_of(cache)
    assert stats["prepare_time_s"] > 2 * timeout_s  # the other rank waited this long, in no collective
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["world_size"] == 2


# --- bad corpora -----------------------------------------------------------------------


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("cputrain: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_malformed_jsonl_lines_fail_with_count_and_line_or_are_skipped(tmp_path, tokenizer_dir):
    corpus = tmp_path / "c.jsonl"
    good = [json.dumps({"text": f"record {i} " + "words " * 20}) for i in range(300)]
    good[41], good[200] = '{"text": "cut off', "[1, 2]"
    corpus.write_text("\n".join(good) + "\n")
    failed = prepare(corpus, tmp_path / "cache", tokenizer_dir)
    _one_line_error(failed, "2 of 300 lines", "line 42", "data.bad_records=skip")
    assert not (tmp_path / "cache" / "packed").exists() or not any((tmp_path / "cache" / "packed").iterdir())

    skipped = prepare(corpus, tmp_path / "cache", tokenizer_dir, "data.bad_records=skip", check=True)
    assert "skipping 2 of 300 lines" in skipped.stderr
    stats = stats_of(tmp_path / "cache")
    assert stats["skipped_records"] == 2 and stats["documents"] == 298


def test_folder_of_mixed_files(tmp_path, tokenizer_dir):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    (folder / "b.jsonl").write_text('{"text": "more"}\n')
    (folder / "notes.docx").write_bytes(b"PK\x03\x04")
    _one_line_error(prepare(folder, tmp_path / "cache", tokenizer_dir), "unsupported file type(s) .docx")
    (folder / "notes.docx").unlink()
    _one_line_error(prepare(folder, tmp_path / "cache", tokenizer_dir), "mixes file types", "one type per dataset")


def test_parquet_without_the_text_field(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a document"] * 10, "id": list(range(10))}), tmp_path / "d.parquet")
    _one_line_error(prepare(tmp_path / "d.parquet", tmp_path / "cache", tokenizer_dir),
                    "no field 'text'", "content", "data.text_field")


def test_binary_file_as_text(tmp_path, tokenizer_dir):
    path = tmp_path / "model.txt"
    path.write_bytes(b"fine text at first\n\n" + bytes(range(128, 256)) * 10)
    _one_line_error(prepare(path, tmp_path / "cache", tokenizer_dir), "is not UTF-8 text", "byte 20")


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs: a disk that fills during preparation (needs root; skipped where mount is refused)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_during_preparation(tmp_path, tokenizer_dir, small_disk):
    corpus = write_jsonl(tmp_path / "c.jsonl", 4 * 10**6)  # its Arrow copy fits; the tokens do not
    cache = small_disk / "cache"
    err = _one_line_error(prepare(corpus, cache, tokenizer_dir, "data.num_proc=1"), "no space left", "data.cache_dir")
    assert "larger disk" in err
    packed = cache / "packed"
    assert packed.exists() and not list(packed.glob("*/stats.json")), "a cache that ran out of disk looks complete"
    assert list(packed.glob("*.partial"))  # kept, to be resumed once there is room
    assert not list(packed.glob("*.lock")), "the writer's lock was not released"
