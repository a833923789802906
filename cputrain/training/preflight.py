"""What is checked before any work: no tokenizing, no model building, nothing written.

A run folder that cannot be written, or a model whose config cannot train on this sequence
length, would otherwise surface minutes later (after the data was tokenized) as a traceback.
Here each ends as one line, in the process the user started, before any rank exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from cputrain.run_folder.layout import RunFolder
from cputrain.config import Config
from cputrain.errors import ConfigError, RunFolderError, one_line


def check_before_work(cfg: Config, probe_output_dir: bool = True) -> None:
    check_objective_config(cfg)  # what the config alone refuses, before anything is touched
    if probe_output_dir:  # one process probes (ranks that all did would remove each other's folders)
        check_output_dir(cfg.output_dir)
        check_cache_dir(cfg.data.cache_dir)
    check_model_fits_seq_len(cfg)
    check_model_weights(cfg)
    check_report_to(cfg)
    check_objective_fits(cfg)
    check_rewards(cfg)
    check_fsdp_layout(cfg)


def world_and_node(cfg: Config) -> tuple[int, int]:
    """(ranks in the run, ranks on each node): a launcher's variables where one started this
    process, else --nnodes × --nproc-per-node."""
    from cputrain.distributed.env import normalize, started_by_launcher

    if started_by_launcher():
        ranks = normalize(dict(os.environ))
        return ranks.world_size, ranks.local_world_size
    return cfg.launch.nnodes * cfg.launch.nproc_per_node, cfg.launch.nproc_per_node


def check_fsdp_layout(cfg: Config) -> None:
    """parallel.layout set to a layout: the run's nodes admit it (the ranks divide into equal nodes,
    and node_reshard and hybrid have several nodes to work across), and, where the model's shape
    can be read here without fetching anything, its memory plan holds on this node by the rule
    parallel.layout=auto chooses by (cputrain.plan.layouts.choice). parallel.layout and
    parallel.reduce_dtype on another strategy are refused with the config (config.sections)."""
    if cfg.parallel.strategy != "fsdp" or cfg.parallel.layout == "auto":
        return
    from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT, layout_error

    world, per_node = world_and_node(cfg)
    error = layout_error(cfg.parallel.layout, world, per_node)
    if error:
        raise ConfigError(error)
    if cfg.parallel.layout != DEFAULT_LAYOUT and _shape_readable_here(cfg):  # the default holds the least
        _check_layout_memory(cfg, world, per_node)


def _shape_readable_here(cfg: Config) -> bool:
    from cputrain.plan.model_shape import known_hub_config

    name = cfg.model.name_or_path
    return (name is None or (Path(name).expanduser() / "config.json").is_file()
            or known_hub_config(name) is not None)


def _check_layout_memory(cfg: Config, world: int, per_node: int) -> None:
    """The layout's memory plan for this node's ranks (its precision, every block checkpointed
    where checkpointing is auto: the least memory) within the node's memory, each rank × 1.1."""
    from cputrain.config.resolve import precision_choice
    from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT
    from cputrain.hardware import detect
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.memory.fit import pod_memory_bytes
    from cputrain.plan.layouts import plans_by_layout
    from cputrain.training.choices import decide_for_plan

    hw = detect()
    here = cfg.model_copy(deep=True)
    here.hardware.precision = precision_choice(cfg.hardware.precision, hw)[0]
    decided = decide_for_plan(here, world, nproc_per_node=per_node).config
    plan = make_plan(decided, world, nproc_per_node=per_node)
    need = pod_memory_bytes(plan.peak_rank.total_bytes, per_node)
    if need <= hw.memory_gib * 2**30:
        return
    full = plans_by_layout(plan, per_node, [DEFAULT_LAYOUT])[DEFAULT_LAYOUT]
    full_gib = pod_memory_bytes(full.peak_rank.total_bytes, per_node) / 2**30
    raise ConfigError(f"parallel.layout={cfg.parallel.layout} does not fit this node: its memory plan needs "
                      f"{need / 2**30:.1f} GiB for {per_node} rank(s) (each × 1.1) of the node's "
                      f"{hw.memory_gib:.1f} GiB (full_shard: {full_gib:.1f} GiB); use parallel.layout=auto or "
                      "full_shard, or nodes with more memory (`cputrain plan` shows each layout's)")


def check_objective_config(cfg: Config) -> None:
    """The objective's rules of the config alone (its head's strategies, a batch in pairs)."""
    from cputrain.objectives.objective import objective_class

    objective_class(cfg.train.objective).check_config(cfg)


def check_objective_fits(cfg: Config) -> None:
    """train.objective and data.shared_prompt read the data's kind (dpo, simpo, reward and a shared
    prompt pairs, kto feedback, lm everything else). A hub dataset under data.format=auto is not opened here (that can
    take minutes): each rank checks it again once its format is decided."""
    from cputrain.data.sources import HF_PREFIX, format_choice
    from cputrain.errors import DataError
    from cputrain.objectives.objective import objective_class

    objective = objective_class(cfg.train.objective)
    objective.check_reference(cfg)
    data = cfg.data
    if data.format == "auto" and data.source.startswith(HF_PREFIX):
        fmt = objective.data_format  # decided by the rank
    else:
        try:
            fmt = format_choice(data)[0]
        except DataError:
            return  # a source that cannot be read is reported where the data is prepared
    objective.check_data(fmt)
    from cputrain.data.preference.rows import shared_prompt_choice

    shared_prompt_choice(data.shared_prompt, fmt)  # data.shared_prompt=true lays out pairs only


def check_rewards(cfg: Config) -> None:
    """Online RL: every reward function of train.rewards importable (or a reward model's folder)
    before any work; the rank builds them again."""
    from cputrain.objectives.objective import objective_class

    if objective_class(cfg.train.objective).batches_from_rollouts:
        from cputrain.rewards.functions import reward_function

        for spec in cfg.train.rewards:
            reward_function(spec)


def check_report_to(cfg: Config) -> None:
    from cputrain.metrics.sinks import check_installed

    check_installed(cfg)


def check_output_dir(url: str) -> None:
    """The run folder can be created and a file written in it; whatever this creates is removed."""
    run = RunFolder(url)
    local = run.local_path()
    try:
        if local is not None:
            _probe_local(Path(local))
        else:
            probe = run.path(f".cputrain-write-test-{os.getpid()}")
            run.fs.makedirs(run.root, exist_ok=True)
            run.fs.pipe_file(probe, b"")
            run.fs.rm(probe)
    except RunFolderError:
        raise
    except Exception as exc:
        where = getattr(exc, "filename", None)
        reason = f"{exc.strerror}: '{where}'" if isinstance(exc, OSError) and exc.strerror and where else one_line(exc)
        raise RunFolderError(f"output_dir '{url}' cannot be created or written ({reason}); "
                             "choose an output_dir on a writable file system") from None


def check_cache_dir(cache_dir: str) -> None:
    """data.cache_dir can be created and written: the tokenizer and the token streams go there
    (a read-only mount, a path through a file). Whatever this creates is removed."""
    try:
        _probe_local(Path(cache_dir).expanduser())
    except RunFolderError:
        raise ConfigError(f"data.cache_dir '{cache_dir}' is a file, not a folder; choose another data.cache_dir") from None
    except OSError as exc:
        reason = f"{exc.strerror}: '{exc.filename}'" if exc.strerror and exc.filename else one_line(exc)
        raise ConfigError(f"data.cache_dir '{cache_dir}' cannot be created or written ({reason}); choose a writable "
                          "data.cache_dir (the tokenizer and the token cache are written there)") from None


# Tries at creating and writing a missing folder that nodes starting together probe at once.
PROBE_ATTEMPTS = 5


def _probe_local(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"output_dir '{folder}' is a file, not a folder; choose another output_dir")
    created: set[Path] = set()
    probe = folder / f".cputrain-write-test-{os.getpid()}"
    try:
        for attempt in range(PROBE_ATTEMPTS):
            created.update(p for p in (folder, *folder.parents) if not p.exists())
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe.write_bytes(b"")
                break
            except FileNotFoundError:
                # Another node probing the same missing shared folder removed it (its clean-up
                # below) between this one's mkdir and its write: make it again.
                if attempt == PROBE_ATTEMPTS - 1:
                    raise
        probe.unlink()
    finally:
        # A command refused later (bad data, a held lock) leaves no empty folder behind.
        for path in sorted(created, key=lambda p: len(p.parts), reverse=True):  # the deepest first
            try:
                path.rmdir()
            except OSError:
                break  # no longer empty (another run got there) or never made


def check_model_fits_seq_len(cfg: Config) -> None:
    """model.arch (or a local model folder's config.json) makes a valid config, and data.seq_len
    fits its positions: RoPE extrapolates silently past max_position_embeddings instead of failing."""
    from cputrain import model as models

    if cfg.model.name_or_path is None:
        # The vocabulary comes from the tokenizer later; no other key depends on it.
        hf_config = models.config_from_arch(cfg.model.arch, cfg.model.tokenizer_vocab_size)
        fix = f"raise model.arch.max_position_embeddings to {cfg.data.seq_len} or"
    else:
        folder = Path(cfg.model.name_or_path).expanduser()
        if not (folder / "config.json").is_file():
            return  # a hub id or a missing folder: reported where the model is fetched
        hf_config = models.folder_config(cfg.model, folder)
        fix = "the model was trained for no more positions;"
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and cfg.data.seq_len > limit:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) is longer than the model's max_position_embeddings "
                          f"({limit}); {fix} set data.seq_len={limit} or less")


def check_model_weights(cfg: Config) -> None:
    """A local model folder holds safetensors weights for every parameter of its config, in the
    config's shapes: read from the files' headers against the model built on the meta device
    (no tensor is read, no memory is taken), so a .bin-only folder or one whose weights belong to
    another config is refused before the data is tokenized, not after. The LoRA settings are
    checked against the same skeleton."""
    if cfg.model.name_or_path is None:
        return
    folder = Path(cfg.model.name_or_path).expanduser()
    if not (folder / "config.json").is_file():
        return  # a hub id or a missing folder: reported where the model is fetched
    from cputrain import model as models

    reader = models.SafetensorsReader(folder)  # no .safetensors, or a header that cannot be read
    skeleton = models.build_skeleton(models.ModelSource(folder, models.folder_config(cfg.model, folder)), cfg.model)
    models.matching_keys(skeleton, reader)
    if cfg.model.lora.enabled:  # targets that name no layer, a rank as wide as a layer
        from cputrain.lora.adapters import check_rank

        check_rank(skeleton, cfg.model.lora)
