"""Every "auto" that needs more than the hardware, decided once per run, in one fixed order.

cputrain.config.resolve resolves the machine's facts (precision, threads, compile, tokenizing
processes, strategy, backend). What is left needs the data, the model or the process group:

    1. data.format          from the first record's fields                     (data.sources)
    2. data.train_on        from the format                                    (data.examples.kind)
       data.shared_prompt   from the format; a resumed run's from its folder  (data.preference.rows)
    3. model.lora.target_modules   from the model's linear layers              (lora.adapters)
    4. model.lora.base_dtype       from the compute dtype and the weight files (lora.base_storage)
    5. model.attn_implementation   timed on rank 0 on the run's shape          (kernels.attention_choice)
    6. model.chunked_loss          from the precision and the head's size      (config.resolve)
    7. parallel.reduce_dtype       fsdp: from the precision and the node count (config.reduction)
    8. parallel.layout             fsdp: the fastest by the time plan of those
                                   whose memory plan fits                      (plan.layouts.choice)
    9. model.activation_checkpointing  from the plan on this node's memory     (plan.memory.checkpointing)
   10. hardware.allocator          what this process was started with          (native.allocator)

Each rule lives with its domain and returns (value, why); this module only calls them and records
each answer (_Walk.record) as it walks, so the run's config.yaml holds every key's value with
its reason, and nothing downstream decides again. The config is validated once, at the walk's end,
into the type that admits no "auto" there. Every rank decides alike (the attention kernel is rank
0's, broadcast, and so is the layout: a node a little short of memory must not shard otherwise).
A resumed run's recorded values come from its config.yaml, read once per rank
(run_folder.run_config.read_recorded) and handed to the rules that keep them.

The layout comes before checkpointing: where both are auto, each layout is planned with every
block checkpointed (the least memory), and checkpointing then keeps what the chosen layout leaves
room for.

`cputrain plan` and `cputrain k8s` walk the same list (decide_for_plan) before any run exists,
with a plan's facts instead of a running rank's: the precision and strategy as resolve_for_plan
resolves them for the planned instance, the model's config as the plan reads it (a built-in shape
for a known hub id, --model-config), no process group and no node yet: the layout is planned on
the instance the plan sizes (the smallest that holds full_shard, the least memory, or the one
given), with its link. What a plan's facts cannot
decide as a run would is decided for the most memory a run may take, and says so: sdpa (a run
times both kernels and mostly keeps sdpa), every block checkpointed (a run checkpoints fewer
where its node holds more). The data's format and what is trained, and the allocator, are left to
the run: no byte of the plan depends on them, and a plan reads no data (its file may not be on
the planning machine).

The verbs: `resolve` the machine's autos (config.resolve), `decide` this walk (decide for a run,
decide_for_plan for a plan, decide_data for the data's keys alone), recording each answer, and
`*_choice` a domain's pure (value, reason) rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cputrain.config import Config
from cputrain.config.resolve import Resolution, chunked_loss_choice, resolve_for_plan
from cputrain.config.resolved import DecidedConfig, PlannedConfig
from cputrain.distributed.env import RankEnv
from cputrain.hardware import HardwareFacts
from cputrain.run_folder.run_config import RecordedConfig

if TYPE_CHECKING:
    from cputrain.plan.instances import Instance
    from cputrain.plan.memory.build import Plan
    from cputrain.plan.time import Network

# A plan's answers where a run's need its node or its process group.
PLANNED_ATTENTION = ("sdpa", ("planned with sdpa's flash kernel, which keeps no attention matrix: a run times both "
                              "kernels on its shape (rank 0) and mostly takes sdpa; where it takes eager, its "
                              "plan.json counts each block's attention matrix"))
PLANNED_CHECKPOINTING = (True, ("planned with every block checkpointed (the least memory); a run checkpoints fewer "
                                "blocks where its node holds more, and writes its plan.json with them"))


def decide(res: Resolution, hw: HardwareFacts, ranks: RankEnv, recorded: RecordedConfig) -> Resolution:
    """Every key of the list above, in its order. Called by each rank once its process group
    exists; `recorded`: its run folder as run_folder.run_config.read_recorded read it."""
    facts = _RunFacts(hw, ranks, recorded)
    walk = _walk(res, facts)
    # From here no key is "auto", by type: a rule that left one is a bug, named here.
    return Resolution(DecidedConfig.model_validate(walk.config.model_dump()), walk.reasons)


def decide_for_plan(cfg: Config, world_size: int, *, nproc_per_node: int | None = None,
                    instances: list[Instance] | None = None, network: Network | None = None,
                    config_json: str | None = None, vocab_size: int | None = None) -> Resolution:
    """The keys a plan reads, decided along the list above with a plan's facts, each with its
    reason. `config_json` and `vocab_size` as make_plan takes them (the model the plan is for);
    `nproc_per_node` (None: the plan's fit chooses), `instances` (None: the built-in table) and
    `network` (None: each instance's published link, no placement group) where parallel.layout is
    planned."""
    return _decide_for_plan(cfg, world_size, _PlanFacts(world_size, nproc_per_node, instances, network,
                                                        config_json, vocab_size))


def _decide_for_plan(cfg: Config, world_size: int, facts: _PlanFacts) -> Resolution:
    from cputrain.objectives.objective import objective_class

    objective_class(cfg.train.objective).check_config(cfg)  # what the config alone refuses, as train's preflight
    walk = _walk(resolve_for_plan(cfg, world_size), facts)
    # No key a plan reads is "auto" any more, by type.
    return Resolution(PlannedConfig.model_validate(walk.config.model_dump()), walk.reasons)


def decide_data(res: Resolution) -> Resolution:
    """Step 1 and 2 alone: data.format, data.train_on and data.shared_prompt, what `prepare` and
    `eval` need (data.shared_prompt=true on data other than preference pairs is refused here)."""
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import read_recorded

    recorded = read_recorded(RunFolder(res.config.output_dir))
    walk = _Walk(res)
    _record_data_choices(walk, recorded)
    return Resolution(type(res.config).model_validate(walk.config.model_dump()), walk.reasons)


def decide_and_plan(cfg: Config, world_size: int, *, nproc_per_node: int | None = None,
                    instances: list[Instance] | None = None, network: Network | None = None,
                    config_json: str | None = None, vocab_size: int | None = None) -> Plan:
    """The plan `cputrain plan` and `cputrain k8s` print and size pods by: `cfg`'s keys decided
    (decide_for_plan), then cputrain.plan.memory.build.make_plan, the decisions' reasons as its notes.
    Where parallel.layout=auto chose the ranks per node (none given), the plan keeps them."""
    from cputrain.plan.memory.build import make_plan

    facts = _PlanFacts(world_size, nproc_per_node, instances, network, config_json, vocab_size)
    res = _decide_for_plan(cfg, world_size, facts)
    return make_plan(res.config, world_size, nproc_per_node=nproc_per_node or facts.fitted_ranks_per_node,
                     instances=instances, config_json=config_json, vocab_size=vocab_size, reasons=res.reasons)


class _Walk:
    """The walk's record: the config as decided so far, and every reason (resolve's first). Each
    decision is set in a copy of the config without validating it, so the rules after it read it;
    the walk's caller validates the config once, at the end."""

    def __init__(self, res: Resolution):
        self.config, self.reasons = res.config, list(res.reasons)

    def record(self, key: str, value, why: str) -> None:
        """`key` dotted (e.g. model.lora.base_dtype) decided as `value`, for `why`."""
        self.config = _with_value(self.config, key.split("."), value)
        self.reasons.append((key, str(value), why))


def _with_value(section, path: list[str], value):
    head, *rest = path
    return section.model_copy(update={head: _with_value(getattr(section, head), rest, value) if rest else value})


def _walk(res: Resolution, facts: _RunFacts | _PlanFacts) -> _Walk:
    """The list above, in its order, each rule asked with `facts` (a _RunFacts or a _PlanFacts),
    each answer recorded; not validated yet."""
    walk = _Walk(res)
    facts.data_choices(walk)
    cfg = walk.config
    source = None
    layout_auto = cfg.parallel.strategy == "fsdp" and cfg.parallel.layout == "auto"
    if cfg.model.lora.enabled or layout_auto or "auto" in (cfg.model.chunked_loss, cfg.model.activation_checkpointing,
                                                           cfg.model.attn_implementation):
        source = facts.model_source(cfg)
    if cfg.model.lora.enabled:
        _record_lora_choices(walk, source, facts)
    if walk.config.model.attn_implementation == "auto":
        walk.record("model.attn_implementation", *facts.attention(walk.config, source.hf_config))
    now = walk.config
    vocab = source.hf_config.vocab_size if source is not None else None
    if now.model.chunked_loss == "auto":  # by precision and the head's size: the same on every rank
        from cputrain.model.score_head import SCORE
        from cputrain.objectives.objective import objective_class

        objective = objective_class(now.train.objective)
        score = now.train.objective if objective.head == SCORE else None
        walk.record("model.chunked_loss", *chunked_loss_choice(
            "auto", now.hardware.precision, now.train.micro_batch_size * now.data.seq_len, vocab, score))
    if walk.config.parallel.strategy == "fsdp":
        _record_fsdp_choices(walk, facts, vocab)
    if walk.config.model.activation_checkpointing == "auto":
        walk.record("model.activation_checkpointing", *facts.checkpointing(walk.config, vocab))
    if walk.config.hardware.allocator == "auto":
        allocator = facts.allocator(walk.config)
        if allocator is not None:
            walk.record("hardware.allocator", *allocator)
    return walk


def _record_fsdp_choices(walk: _Walk, facts: _RunFacts | _PlanFacts, vocab: int | None) -> None:
    """fsdp's reduce dtype (by the precision and the node count), then its layout (by the time
    plan, with the reduce dtype decided)."""
    from cputrain.config.reduction import reduce_dtype_choice

    parallel = walk.config.parallel
    if parallel.reduce_dtype == "auto":
        nnodes = facts.nnodes(walk.config, vocab)
        if nnodes is None:
            walk.record("parallel.reduce_dtype", "fp32", "the nodes are not known to this plan (no ranks per node "
                        "given, no instance table): fp32, as on one node; --nproc-per-node plans bf16 across nodes")
        else:
            walk.record("parallel.reduce_dtype", *reduce_dtype_choice("auto", walk.config.hardware.precision, nnodes))
    if walk.config.parallel.layout == "auto":
        walk.record("parallel.layout", *facts.layout(walk.config, vocab))


def _record_data_choices(walk: _Walk, recorded: RecordedConfig) -> None:
    from cputrain.data.examples.kind import train_on_choice
    from cputrain.data.preference.rows import shared_prompt_choice
    from cputrain.data.sources import format_choice

    data = walk.config.data
    if data.format == "auto":
        walk.record("data.format", *format_choice(data))
    data = walk.config.data
    if data.train_on == "auto":
        walk.record("data.train_on", *train_on_choice(data.train_on, data.format))
    data = walk.config.data
    shared, why = shared_prompt_choice(data.shared_prompt, data.format)
    if why:
        walk.record("data.shared_prompt", *_resumed_layout(recorded, shared, why))


def _resumed_layout(recorded: RecordedConfig, shared: bool, why: str) -> tuple[bool, str]:
    """data.shared_prompt=auto on a run folder with preference checkpoints: the layout the run
    started with, so its rows, and each step's pairs, stay those of a run never stopped; a folder
    written before the key existed laid its pairs out whole. Elsewhere auto's own choice."""
    from cputrain.run_folder.run_config import recorded_identity

    values = recorded.values
    if values is None or recorded_identity(values, "data.format")[0] != "preference":
        return shared, why  # nothing to resume (another format is refused by the folder's check)
    value, held = recorded_identity(values, "data.shared_prompt")
    if not held:
        return False, ("this run folder's config.yaml was written before data.shared_prompt existed: its pairs "
                       "were laid out as two whole sequences, and the resumed run keeps them so")
    if value in (True, False):
        return value, "chosen when this run started (config.yaml)"
    return shared, why  # "auto" recorded: decided now, as the folder's check allows


def _record_lora_choices(walk: _Walk, source, facts: _RunFacts | _PlanFacts) -> None:
    lora = walk.config.model.lora
    if lora.target_modules == "auto":
        from cputrain import model as models
        from cputrain.lora.adapters import target_modules_choice

        skeleton = models.build_skeleton(source, walk.config.model)  # on the meta device: no memory
        walk.record("model.lora.target_modules", *target_modules_choice(skeleton, lora))
    if lora.base_dtype == "auto":
        import torch

        from cputrain.lora.base_storage import base_dtype_choice, base_dtype_name

        compute = torch.bfloat16 if walk.config.hardware.precision == "bf16" else torch.float32
        files_bf16 = facts.files_are_bf16(source, walk.config)
        dtype, why = base_dtype_choice("auto", compute, files_bf16)
        walk.record("model.lora.base_dtype", base_dtype_name(dtype), why)


class _RunFacts:
    """A running rank's: its model folder, its node's memory, its process group, its process and
    its run folder's recorded values."""

    def __init__(self, hw: HardwareFacts, ranks: RankEnv, recorded: RecordedConfig):
        self.hw, self.ranks, self.recorded = hw, ranks, recorded

    def data_choices(self, walk: _Walk) -> None:
        _record_data_choices(walk, self.recorded)

    def model_source(self, cfg):
        from cputrain import model as models

        # Every rank reads the model config, so a bad one stops all ranks alike. A model built from
        # scratch is sized with data.tokenizer_vocab_size before its tokenizer exists.
        return models.resolve_source(cfg.model, vocab_size=cfg.model.tokenizer_vocab_size)

    def files_are_bf16(self, source, cfg) -> bool:
        from cputrain.lora.base_storage import files_are_bf16

        return source.folder is not None and files_are_bf16(source.folder)

    def attention(self, cfg, hf_config) -> tuple[str, str]:
        """model.attn_implementation=auto: rank 0 times both kernels on the model's attention shape
        and every rank takes its choice; a resumed run keeps the kernel it started with."""
        from cputrain.distributed import process_group as pg
        from cputrain.kernels.attention_choice import attention_choice

        # Timing again could pick the other kernel, and the losses after the resume would no
        # longer be those of a run never stopped.
        resumed_with = self.recorded.value("model.attn_implementation")
        if resumed_with in ("sdpa", "eager"):
            return resumed_with, "chosen when this run started (config.yaml)"
        mine = attention_choice(hf_config, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.hardware.dtype) \
            if self.ranks.is_main else None
        choice = pg.broadcast_from_main(mine)
        return choice.implementation, choice.reason

    def nnodes(self, cfg, vocab: int | None) -> int:
        return self.ranks.world_size // max(self.ranks.local_world_size, 1)

    def layout(self, cfg, vocab: int | None) -> tuple[str, str]:
        """Rank 0's choice on its node, every rank's: a layout must be the same on every rank."""
        from cputrain.distributed import process_group as pg

        from cputrain.plan.layouts import layout_on_node

        mine = (layout_on_node(cfg, self.ranks.world_size, self.ranks.local_world_size, self.hw, vocab)
                if self.ranks.is_main else None)
        return tuple(pg.broadcast_from_main(mine))

    def checkpointing(self, cfg, vocab: int | None) -> tuple[bool | int, str]:
        """By the plan on this node's memory: the same on every rank."""
        from cputrain.plan.memory.checkpointing import checkpointing_choice

        return checkpointing_choice(cfg, self.ranks.world_size, self.ranks.local_world_size, self.hw.memory_gib, vocab)

    def allocator(self, cfg) -> tuple[str, str]:
        from cputrain.native.allocator import running_allocator_choice

        return running_allocator_choice(cfg.hardware.precision, cfg.parallel.strategy)


class _PlanFacts:
    """A plan's: the model as the plan reads it (nothing fetched for a known hub id), no node yet;
    the layout planned on the instance the plan sizes."""

    def __init__(self, world_size: int, nproc_per_node: int | None, instances: list[Instance] | None,
                 network: Network | None, config_json: str | None, vocab_size: int | None):
        self.world_size, self.nproc_per_node = world_size, nproc_per_node
        self.instances, self.network = instances, network
        self.config_json, self.vocab_size = config_json, vocab_size
        self.fitted_ranks_per_node: int | None = None  # where the layout's fit chose them
        self._fit = None

    def _full_shard_fit(self, cfg, vocab: int | None):
        """full_shard's plan and the cluster it fits, or None where no instance of the table holds
        it (the plan, or the render, then says so in its own words)."""
        if self._fit is None:
            from cputrain.errors import ConfigError
            from cputrain.plan.instances import builtin_instances
            from cputrain.plan.layouts import full_shard_fit

            try:
                self._fit = full_shard_fit(cfg, self.world_size, self.nproc_per_node,
                                           self.instances or builtin_instances(), config_json=self.config_json,
                                           vocab_size=self.vocab_size)
            except ConfigError:
                self._fit = False
        return self._fit or None

    def _ranks_per_node(self, cfg, vocab: int | None) -> int | None:
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        if self.instances is None:
            return None
        fitted = self._full_shard_fit(cfg, vocab)
        return fitted.fit.nproc_per_node if fitted else None

    def nnodes(self, cfg, vocab: int | None) -> int | None:
        per_node = self._ranks_per_node(cfg, vocab)
        return None if per_node is None else self.world_size // per_node

    def layout(self, cfg, vocab: int | None) -> tuple[str, str]:
        """On the instance the plan sizes for full_shard, or --instance-type's."""
        from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT
        from cputrain.plan.layouts import layout_on_instance
        from cputrain.plan.time import Network

        per_node = self._ranks_per_node(cfg, vocab)
        if per_node is None:
            return DEFAULT_LAYOUT, ("the ranks per node are not known to this plan (none given, no instance table): "
                                  "full_shard, which any node count runs; --nproc-per-node plans the layouts")
        fitted = self._full_shard_fit(cfg, vocab)
        if fitted is None:
            return DEFAULT_LAYOUT, ("no instance of the table holds full_shard's ranks, the least memory of the "
                                  "layouts: full_shard")
        if self.nproc_per_node is None:
            self.fitted_ranks_per_node = per_node
        return layout_on_instance(cfg, fitted, self.network or Network())

    def data_choices(self, walk: _Walk) -> None:
        pass  # left to the run: no byte of the plan depends on them, and a plan reads no data

    def model_source(self, cfg):
        from cputrain import model as models
        from cputrain.plan.model_shape import hf_config_for, model_folder

        folder = model_folder(cfg.model.name_or_path) if cfg.model.name_or_path else None
        return models.ModelSource(folder, hf_config_for(cfg.model, self.vocab_size, self.config_json))

    def files_are_bf16(self, source, cfg) -> bool:
        """Read from the files' headers where they are on this machine; a known hub id that is not
        is planned as published, in bf16."""
        from cputrain.lora.base_storage import files_are_bf16
        from cputrain.plan.model_shape import known_hub_config

        if source.folder is not None and any(source.folder.glob("*.safetensors")):
            return files_are_bf16(source.folder)
        return known_hub_config(cfg.model.name_or_path) is not None

    def attention(self, cfg, hf_config) -> tuple[str, str]:
        return PLANNED_ATTENTION

    def checkpointing(self, cfg, vocab: int | None) -> tuple[bool | int, str]:
        return PLANNED_CHECKPOINTING

    def allocator(self, cfg) -> None:
        return None  # the run's process decides it; the plan does not count the allocator
