"""Bad input: one line on stderr naming the problem, exit code 2, no traceback unless --debug,
and nothing already on disk changed: an earlier run's folder keeps every byte and mtime.

What is refused before any work (config keys and values, the run folder, the model folder's
files) is asserted in this process through the command's entry function (`run_cli_here`, which
fails the test if the command gets as far as the worker); one case of each kind also runs as its
own process, where exit code, stderr and the absence of a traceback are the process's."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides


def snapshot(folder) -> dict:
    """Every file under `folder` with its content hash and modification time."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory, trained_run):
    """A finished run whose folder must survive every bad command pointed at it."""
    out = tmp_path_factory.mktemp("bad") / "run"
    trained_run(out, **EXISTING)
    return out


EXISTING = {"train.max_steps": 4, "train.checkpoint_every": 2, "train.eval_every": 2}


@pytest.fixture
def fresh_dir(tmp_path):
    """An output_dir that holds only a file of the user's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    return out


def assert_refused(proc, *expected: str, debug: bool = False) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("cputrain: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0] == proc.stderr.strip().splitlines()[-1]  # the last word, nothing after it
    if not debug:
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def tiny(out, cache_dir, **extra) -> list[str]:
    return tiny_overrides(out, cache_dir, **{"train.max_steps": 2, **extra})


# --- config errors: refused before any work, so they can point at the existing run itself ----


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_step=5", "unknown config key 'train.max_step'; did you mean 'train.max_steps'?"),
        ("data.seqlen=64", "did you mean 'data.seq_len'?"),
        ("train.lr=0", "'train.lr'"),
        ("train.lr=-3e-4", "'train.lr'"),
        ("train.micro_batch_size=0", "'train.micro_batch_size'"),
        ("train.global_batch_size=-8", "'train.global_batch_size'"),
        ("data.seq_len=-1", "'data.seq_len'"),
        ("train.warmup_steps=-2", "'train.warmup_steps'"),
        ("hardware.threads=0", "hardware.threads"),
        ("train.keep_last=0", "'train.keep_last'"),
        ("seed=-1", "bad value for 'seed' (-1)"),  # numpy's generator refuses it: was a traceback mid-run
        # a value no member of a union takes: the key as written, and what it may be (not 'model.compile.bool')
        ("model.compile=abc", "bad value for 'model.compile' ('abc'): use true or false, or auto"),
        ("model.activation_checkpointing=-1", "a number of decoder blocks ≥ 0"),
        ("train.profile_step=0", "'train.profile_step'"),
        ("train.profile_step=3", "train.profile_step (3) is past train.max_steps (2): the run never reaches it"),
    ],
    ids=lambda v: v if "=" in v else "",
)
def test_bad_keys_and_values(existing_run, cache_dir, override, expected):
    before = snapshot(existing_run)
    proc = run_cli_here("train", *tiny(existing_run, cache_dir), override)
    assert_refused(proc, expected)
    assert snapshot(existing_run) == before


def test_bad_key_as_its_own_process(existing_run, cache_dir):
    """The process boundary: exit code 2, one line, no traceback, the run folder untouched."""
    before = snapshot(existing_run)
    proc = run_cli("train", *tiny(existing_run, cache_dir), "train.max_step=5")
    assert_refused(proc, "unknown config key 'train.max_step'; did you mean 'train.max_steps'?")
    assert proc.stdout == ""
    assert snapshot(existing_run) == before


def test_malformed_yaml(existing_run, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text(f"output_dir: {existing_run}\ntrain:\n  max_steps: 5\n   lr: 0.1\n")
    before = snapshot(existing_run)
    assert_refused(run_cli_here("train", config), "malformed YAML", "broken.yaml", "line 4")
    assert_refused(run_cli_here("train", tmp_path / "absent.yaml"), "not found")
    assert snapshot(existing_run) == before


def test_unknown_key_in_yaml_file(existing_run, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(f"output_dir: {existing_run}\ntrain:\n  learning_rate: 0.1\n")
    assert_refused(run_cli_here("train", config), "unknown config key 'train.learning_rate'")


# --- a run folder of another run -------------------------------------------------------------


@pytest.mark.parametrize("change", ["data.seq_len=16", "model.arch.hidden_size=32", "seed=7"])
def test_incompatible_output_dir_is_not_touched(existing_run, cache_dir, change):
    before = snapshot(existing_run)
    proc = run_cli("train", *tiny(existing_run, cache_dir), change)
    assert_refused(proc, "holds checkpoints of another run", change.split("=")[0], "choose a new output_dir")
    assert snapshot(existing_run) == before


def test_checkpoints_without_config_are_not_touched(existing_run, cache_dir, tmp_path):
    out = tmp_path / "orphan"
    shutil.copytree(existing_run / "checkpoints", out / "checkpoints")
    before = snapshot(out)
    assert_refused(run_cli("train", *tiny(out, cache_dir)), "holds checkpoints but no config.yaml")
    assert snapshot(out) == before


# --- model and data errors: found while loading, before anything is written -------------------


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """A tokenizer with more tokens (1024) than the tiny model's vocabulary (512)."""
    from cputrain.data.sources import _pydoc_documents
    from cputrain.data.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("tok") / "bpe-1024"
    train_bpe(_pydoc_documents()[:400], 1024, folder)
    return folder


def _broken_model(src, dst, how):
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3] if how == "truncated" else b"{" + bytes(range(256)) * 8)
    return dst


CASES = {
    "missing-model": (lambda t, m, k: [f"model.name_or_path={t / 'no-such-model'}"],
                      ["model folder", "not found", "model.name_or_path"]),
    "truncated-weights": (lambda t, m, k: [f"model.name_or_path={_broken_model(m, t / 'trunc', 'truncated')}"],
                          ["model.safetensors", "corrupt or truncated"]),
    "garbage-weights": (lambda t, m, k: [f"model.name_or_path={_broken_model(m, t / 'garbage', 'garbage')}"],
                        ["corrupt or truncated"]),
    "vocab-mismatch": (lambda t, m, k: [f"model.name_or_path={m}", f"model.tokenizer={k}"],
                       ["the tokenizer has 1024 tokens but the model's vocabulary is 512"]),
    "missing-data": (lambda t, m, k: [f"data.source={t / 'absent.jsonl'}"], ["absent.jsonl", "not found"]),
    "empty-data": (lambda t, m, k: [f"data.source={_write(t / 'empty.txt', '')}"], ["empty.txt", "is empty"]),
    "no-usable-text": (lambda t, m, k: [f"data.source={_write(t / 'blank.jsonl', chr(10).join([json.dumps({'text': ''}), json.dumps({'text': '   '})]))}"],
                       ["no usable text"]),
    "wrong-text-field": (lambda t, m, k: [f"data.source={_write(t / 'other.jsonl', json.dumps({'body': 'hello'}))}"],
                         ["no field 'text'", "data.text_field"]),
}


# Found by the worker, once it loads the model or reads the data: these run as processes.
FOUND_IN_THE_WORKER = {"missing-model", "vocab-mismatch", "missing-data", "empty-data", "no-usable-text",
                       "wrong-text-field"}


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_or_data(case, fresh_dir, tmp_path, cache_dir, tiny_model_dir, big_tokenizer):
    make_args, expected = CASES[case]
    args = make_args(tmp_path, tiny_model_dir, big_tokenizer)
    before = snapshot(fresh_dir)
    run = run_cli if case in FOUND_IN_THE_WORKER else run_cli_here
    proc = run("train", *tiny(fresh_dir, cache_dir), *args)
    assert_refused(proc, *expected)
    after = snapshot(fresh_dir)
    assert {k: after.get(k) for k in before} == before  # the user's file is untouched
    assert not any(k.startswith(("checkpoints/", "model/")) or k in ("config.yaml", "metrics.jsonl") for k in after)


def test_debug_shows_the_traceback(fresh_dir, cache_dir, tmp_path):
    proc = run_cli("train", "--debug", *tiny(fresh_dir, cache_dir), f"data.source={tmp_path / 'absent.txt'}")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "DataError" in proc.stderr


def test_generate_and_eval_of_a_missing_model(tmp_path):
    for command in ("generate", "eval"):
        assert_refused(run_cli_here(command, tmp_path / "nothing"), "neither a run folder nor a model folder")
    assert_refused(run_cli_here("generate", tmp_path, "--max-new-tokens", "0"), "--max-new-tokens")


def test_output_dir_that_is_a_file(tmp_path, cache_dir):
    target = tmp_path / "results"
    target.write_text("keep me\n")
    assert_refused(run_cli_here("train", *tiny(target, cache_dir)), "is a file, not a folder")
    assert target.read_text() == "keep me\n"


def test_eval_needs_at_least_one_sequence(existing_run):
    assert_refused(run_cli_here("eval", existing_run, "--max-sequences", "0"), "--max-sequences")


# --- checked before any work: nothing tokenized, no model built, nothing written -------------


def assert_no_work(cache) -> None:
    """The data cache of the command is still empty: it was refused before tokenizing."""
    assert not cache.exists() or not any(cache.rglob("*")), sorted(str(p) for p in cache.rglob("*"))


def test_empty_output_dir_is_refused(tmp_path, cache_dir):
    """`output_dir=` used to spread the whole run folder over the current directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_cli_here("train", *tiny(tmp_path / "unused", tmp_path / "cache"), "output_dir=", cwd=cwd)
    assert_refused(proc, "output_dir is empty", "output_dir=runs/my-run")
    assert not any(cwd.iterdir())
    assert_no_work(tmp_path / "cache")


@pytest.mark.parametrize("target", ["/proc/cputrain-test/run", "/sys/cputrain-test/run"], ids=["proc", "sys"])
def test_output_dir_that_cannot_be_written(tmp_path, target):
    """A pseudo file system refuses the folder: one line, before tokenizing (was a traceback after it)."""
    cache = tmp_path / "cache"
    proc = run_cli_here("train", *tiny(target, cache))
    assert_refused(proc, f"output_dir '{target}' cannot be created or written", "writable file system")
    assert_no_work(cache)


def test_cache_dir_that_cannot_be_written(tmp_path):
    """A read-only mount (root ignores file modes, so a real one) and a pseudo file system: one
    line naming data.cache_dir, before anything is tokenized or written."""
    import subprocess

    read_only = tmp_path / "ro"
    read_only.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                             capture_output=True).returncode == 0
    try:
        for cache in ([read_only / "cache"] if mounted else []) + [Path("/proc/cputrain-test/cache")]:
            proc = run_cli_here("train", *tiny(tmp_path / "run", cache))
            assert_refused(proc, f"data.cache_dir '{cache}' cannot be created or written", "writable data.cache_dir")
            assert not (tmp_path / "run").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(read_only)], check=True)


def test_output_dir_check_leaves_nothing_behind(tmp_path):
    """The write probe removes the folders it made, so a command refused later leaves no empty run folder."""
    out = tmp_path / "a" / "b" / "run"
    proc = run_cli("train", *tiny(out, tmp_path / "cache"), f"data.source={tmp_path / 'absent.txt'}")
    assert_refused(proc, "absent.txt")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("override, expected", [
    ("model.arch.hidden_size=abc", "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int, got str"),
    ("model.arch.hidden_size=64.5", "expected int, got float"),
    ("model.arch.num_attention_heads=5", "The hidden size (64) is not a multiple of the number of attention heads (5)"),
], ids=["not-an-integer", "a-float", "heads-do-not-divide"])
def test_bad_arch_is_reported_whole_before_the_data(tmp_path, override, expected):
    cache = tmp_path / "cache"
    line = assert_refused(run_cli_here("train", *tiny(tmp_path / "run", cache), override),
                          "model.arch does not make a valid llama config", expected)
    assert not line.endswith(":")
    assert_no_work(cache)
    assert not (tmp_path / "run").exists()


def test_seq_len_longer_than_the_models_positions(tmp_path, tiny_model_dir):
    cache = tmp_path / "cache"
    # the tiny arch has 128 positions
    assert_refused(run_cli_here("train", *tiny(tmp_path / "run", cache, **{"data.seq_len": 256})),
                   "data.seq_len (256) is longer than the model's max_position_embeddings (128)",
                   "raise model.arch.max_position_embeddings to 256", "data.seq_len=128")
    # a model folder's config.json says 256
    assert_refused(run_cli_here("train", *tiny(tmp_path / "run", cache, **{"data.seq_len": 512}),
                           f"model.name_or_path={tiny_model_dir}"),
                   "max_position_embeddings (256)", "data.seq_len=256")
    assert_no_work(cache)


@pytest.mark.parametrize("how", ["bin-only", "other-shapes", "lora-rank"])
def test_model_weights_that_cannot_load_are_refused_before_tokenizing(tmp_path, tiny_model_dir, how):
    """Read from the files' headers against the config, before any data is touched."""
    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    extra = ()
    if how == "lora-rank":  # the tiny model's k_proj has 32 outputs
        extra = ("model.lora.enabled=true", "model.lora.rank=48")
        expected = ("model.lora.rank 48 is not below the width of", "(32)")
    elif how == "bin-only":
        (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
        expected = ("has no .safetensors weights", "safe_serialization=True")
    else:  # the config says a wider model than the weights hold
        fields = json.loads((broken / "config.json").read_text())
        fields["intermediate_size"] *= 2
        (broken / "config.json").write_text(json.dumps(fields))
        expected = ("have shape", "the weights do not belong to this model config")
    assert_refused(run_cli_here("train", *tiny(tmp_path / "run", tmp_path / "cache"), f"model.name_or_path={broken}",
                           *extra), *expected)
    assert_no_work(tmp_path / "cache")


def test_model_folder_config_without_hidden_size(tmp_path, tiny_model_dir):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    fields = json.loads((broken / "config.json").read_text())
    del fields["hidden_size"]
    (broken / "config.json").write_text(json.dumps(fields))
    assert_refused(run_cli_here("train", *tiny(tmp_path / "run", tmp_path / "cache"), f"model.name_or_path={broken}"),
                   "config.json' lacks hidden_size", "hidden_size=4096")
    assert_no_work(tmp_path / "cache")


# --- no NaN in the run's files -----------------------------------------------------------------


def strict_json(text: str):
    """json.loads as a strict reader (jq, JSON.parse) reads: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_empty_validation_split_is_skipped_with_one_warning(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = run_cli("train", *tiny(out, cache_dir, **{"train.max_steps": 4, "train.eval_every": 2,
                                                     "data.val_fraction": 0.0}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("the validation split has 0 sequences") == 1, proc.stderr[-3000:]
    rows = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not any("val_loss" in r for r in rows)
    summary = strict_json((out / "summary.json").read_text())
    assert summary["val_loss"] is None and summary["val_ppl"] is None
    assert "nan" not in proc.stderr.lower()
