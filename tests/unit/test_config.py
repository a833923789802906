"""Config: YAML + dotted overrides, refused early with one line naming the key; `auto` resolved with reasons."""

from __future__ import annotations

import json

import dataclasses
import warnings

import pytest
import yaml

from cputrain.config import Config

from cputrain.config.file import describe_fields, load_config
from cputrain.errors import ConfigError
from cputrain.hardware import detect
from cputrain.config.resolve import EMULATED_BF16_WARNING, resolve


def test_defaults_and_overrides_apply_dotted_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 7\ndata:\n  seq_len: 64\n")
    cfg = load_config(path, ["train.max_steps=20", "train.lr=3e-4", "model.arch.hidden_size=32", "output_dir=/x"])
    assert cfg.train.max_steps == 20  # the override wins over the file
    assert cfg.data.seq_len == 64  # the file wins over the default
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    # One arch key changes only that key; the rest of the demo's small Llama stays.
    assert cfg.model.arch == {**Config().model.arch, "hidden_size": 32}
    assert cfg.output_dir == "/x"


def test_dump_round_trips():
    cfg = load_config(None, ["train.max_steps=3", "hardware.threads=2"])
    again = Config.model_validate(yaml.safe_load(cfg.dump_yaml()))
    assert again == cfg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_step=5", "unknown config key 'train.max_step'; did you mean 'train.max_steps'?"),
        ("train.seq_len=64", "unknown config key 'train.seq_len'; did you mean 'data.seq_len'?"),
        ("trian.lr=1", "unknown config key 'trian'"),
    ],
)
def test_unknown_key_names_it_and_the_nearest(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(expected)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=0", "train.lr"),
        ("train.lr=-1e-3", "train.lr"),
        ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("train.global_batch_size=-8", "train.global_batch_size"),
        ("data.seq_len=0", "data.seq_len"),
        ("train.max_steps=-5", "train.max_steps"),
        ("hardware.threads=0", "hardware.threads"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("hardware.precision=fp8", "hardware.precision"),
        ("train.max_steps=ten", "train.max_steps"),
        ("train.profile_step=0", "train.profile_step"),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert key in message and "\n" not in message


def test_profile_step_past_the_last_step_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_steps=10", "train.profile_step=11"])
    assert str(err.value) == ("train.profile_step (11) is past train.max_steps (10): the run never reaches it; "
                              "choose a step from 1 to 10")
    assert load_config(None, ["train.max_steps=10", "train.profile_step=10"]).train.profile_step == 10


def test_batch_must_divide():
    with pytest.raises(ConfigError, match="multiple of train.micro_batch_size"):
        load_config(None, ["train.global_batch_size=10", "train.micro_batch_size=4"])


def test_the_batch_in_pairs_is_one_pair_a_row():
    """train.global_batch_pairs: TRL's batch (pairs per step); unpacked, a row is one pair, so it is
    the batch in rows too. Refused where it cannot be exact, or says something else."""
    pairs = ["train.objective=dpo", "data.format=preference", "data.packing=false", "train.micro_batch_size=2"]
    cfg = load_config(None, [*pairs, "train.global_batch_pairs=6"])
    assert cfg.train.global_batch_size == cfg.train.global_batch_pairs == 6
    assert Config(**cfg.model_dump()).train.global_batch_size == 6  # config.yaml read back
    with pytest.raises(ConfigError, match="set data.packing=false"):
        load_config(None, ["train.objective=dpo", "train.global_batch_pairs=8"])
    from cputrain.training.preflight import check_objective_config

    with pytest.raises(ConfigError, match="train.objective=lm trains no pairs"):  # the objective's rule
        check_objective_config(load_config(None, ["data.packing=false", "train.global_batch_pairs=8"]))
    with pytest.raises(ConfigError, match=r"global_batch_pairs \(8\) and train.global_batch_size \(16\) both set"):
        load_config(None, [*pairs, "train.global_batch_pairs=8", "train.global_batch_size=16"])
    with pytest.raises(ConfigError, match=r"^train.global_batch_pairs \(7\) must be a multiple"):
        load_config(None, [*pairs, "train.global_batch_pairs=7"])


def test_override_without_equals_and_value_as_section():
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["train.max_steps"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["seed=1", "seed.x=1"])


def test_malformed_yaml_gives_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: [1, 2\n  lr: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "malformed YAML" in str(err.value) and "line" in str(err.value) and "\n" not in str(err.value)


def test_yaml_that_is_not_a_mapping_and_missing_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_every_field_has_a_docstring():
    rows = describe_fields()
    assert len(rows) > 30
    undocumented = [key for key, _, doc in rows if not doc]
    assert undocumented == []


def _facts(**flags):
    hw = detect()
    return dataclasses.replace(hw, flags={k: flags.get(k, False) for k in hw.flags})


@pytest.mark.parametrize(
    "flags, expected",
    [({"amx_bf16": True, "amx_tile": True}, "bf16"), ({"avx512_bf16": True, "avx512f": True}, "bf16"),
     ({"avx512f": True}, "fp32"), ({"avx2": True, "fma": True}, "fp32")],
)
def test_auto_precision_follows_bf16_hardware(flags, expected):
    res = resolve(Config(), _facts(**flags), world_size=1, local_world_size=1)
    assert res.config.hardware.precision == expected
    reasons = {key: why for key, _, why in res.reasons}
    assert reasons["hardware.precision"]  # the choice comes with its reason


def test_auto_compile_for_lora_follows_what_was_measured_per_bf16_unit():
    """Compiled LoRA blocks measured 0.80× eager on AMX and 1.16× on AVX512-BF16 without AMX
    (benchmarks/lora/lora.py --only compile-timed); fp32 never compiles by auto."""
    lora = load_config(None, ["model.name_or_path=/models/base", "model.lora.enabled=true"])

    def compiled(**flags):
        res = resolve(lora, _facts(**flags), world_size=1, local_world_size=1)
        return res.config.model.compile, dict((k, why) for k, _, why in res.reasons)["model.compile"]

    on_amx, why = compiled(amx_bf16=True, amx_tile=True, avx512_bf16=True, avx512f=True)
    assert on_amx is False and "497 tokens/s" in why
    on_avx512_bf16, why = compiled(avx512_bf16=True, avx512f=True)
    assert on_avx512_bf16 is True and "1.16×" in why
    assert compiled(avx2=True, fma=True)[0] is False


def test_auto_compile_leaves_narrow_models_eager_whether_built_or_read(tmp_path):
    """The width rule reads a local folder's config.json too: a tiny pretrained model's short
    steps would not pay back the compile either."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    for extra in ([], ["model.lora.enabled=true"]):
        cfg = load_config(None, [f"model.name_or_path={tmp_path}", *extra])
        res = resolve(cfg, _facts(avx512_bf16=True, avx512f=True), world_size=1, local_world_size=1)
        assert res.config.model.compile is False
        assert "a model 64 wide" in dict((k, why) for k, _, why in res.reasons)["model.compile"]
    scratch = load_config(None, ["model.arch.hidden_size=256"])
    assert resolve(scratch, _facts(amx_bf16=True), world_size=1, local_world_size=1).config.model.compile is False


def test_forced_bf16_on_emulating_cpu_warns():
    cfg = load_config(None, ["hardware.precision=bf16"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve(cfg, _facts(avx2=True, fma=True), world_size=1, local_world_size=1)
    assert any(str(w.message) == EMULATED_BF16_WARNING for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where bf16 runs in hardware
        resolve(cfg, _facts(amx_bf16=True), world_size=1, local_world_size=1)


def test_auto_threads_split_cores_between_ranks():
    hw = detect()
    res = resolve(Config(), hw, world_size=2, local_world_size=2)
    assert res.config.hardware.threads == max(1, hw.physical_cores // 2)
    assert res.config.parallel.strategy == "ddp"
    resolved = res.config
    assert "auto" not in (resolved.hardware.precision, resolved.hardware.threads, resolved.parallel.backend)
    assert {key for key, _, _ in res.reasons} >= {"hardware.precision", "hardware.threads", "parallel.strategy"}


def test_world_size_must_divide_the_batch():
    cfg = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="not divisible"):
        resolve(cfg, detect(), world_size=3, local_world_size=3)


def test_chunked_loss_auto_follows_precision_and_the_logits_size():
    """bf16: chunked. fp32: plain where a micro-batch's fp32 logits are small (measured as fast),
    chunked where they exceed the 256 MiB block (a large vocabulary); an explicit value stays."""
    from cputrain.config.resolve import chunked_loss_choice

    assert chunked_loss_choice("auto", "bf16", 2048, 4096)[0] is True
    demo, why = chunked_loss_choice("auto", "fp32", 8 * 256, 4096)
    assert demo is False and "32 MiB" in why
    llama3, why = chunked_loss_choice("auto", "fp32", 2048, 128_256)
    assert llama3 is True and "1,002 MiB" in why
    assert chunked_loss_choice(True, "fp32", 16, 16) == (True, "")
    assert chunked_loss_choice(False, "bf16", 2048, 128_256) == (False, "")


def test_a_preference_run_plans_the_block_wise_head_it_runs():
    """DPO and SimPO read each answer's log-probabilities through the same block-wise head as the
    lm loss (kernels/chunked_logps.py): auto takes it in bf16 as for lm, and the plan counts it."""
    from harness.run_cli_here import run_cli_here
    from harness.tiny_run import TINY_ARCH

    proc = run_cli_here("plan", *TINY_ARCH, "train.objective=dpo", "data.source=builtin:pydoc-dpo",
                        "hardware.precision=bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["chunked_loss"] is True



def _float_keys(model=Config, prefix=""):
    """Every dotted key whose value may be a float, found from the config's own types."""
    import typing

    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                yield from _float_keys(kind, f"{prefix}{name}.")
        if float in kinds:
            yield f"{prefix}{name}"


FLOAT_KEYS = sorted(_float_keys())


def test_every_float_key_is_found():
    assert {"train.lr", "train.beta1", "train.grad_clip", "model.lora.alpha", "data.val_fraction"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_no_float_setting_takes_a_non_finite_value(key, value):
    """train.lr=inf used to train a step and export non-finite weights with exit 0."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}"])
    assert f"'{key}'" in str(err.value) and "finite" in str(err.value), str(err.value)


def test_key_null_on_the_command_line_unsets_a_key_a_config_file_set(tmp_path):
    """A refusal's fix must work from the command line: global_batch_pairs with a config file that
    sets global_batch_size is refused naming `train.global_batch_size=null`, which unsets it (a key
    that takes no null goes back to its default); an optional key takes null as its value."""
    from cputrain.config.file import load_config
    from cputrain.errors import ConfigError

    config = tmp_path / "run.yaml"
    config.write_text("train:\n  global_batch_size: 16\n  lr: 0.01\ndata:\n  packing: false\n  margin_field: m\n")
    with pytest.raises(ConfigError, match=r"both set the batch; .*train.global_batch_size=null on the command line"):
        load_config(config, ["train.global_batch_pairs=8"])
    cfg = load_config(config, ["train.global_batch_pairs=8", "train.global_batch_size=null", "train.lr=null",
                               "data.margin_field=null"])
    assert (cfg.train.global_batch_size, cfg.train.global_batch_pairs) == (8, 8)
    assert cfg.train.lr == type(cfg.train).model_fields["lr"].default and cfg.data.margin_field is None
