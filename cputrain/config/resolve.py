"""Turn every "auto" in the config into a concrete value, and say why.

The reasons are logged at start and the resolved config is written to the run folder, so a
run can be repeated exactly and nobody has to guess what "auto" meant on that machine.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

from cputrain.config import Config, batch_error

from cputrain.config.resolved import ResolvedConfig
from cputrain.errors import ConfigError
from cputrain.hardware import HardwareFacts

# Measured on an AMD EPYC (AVX2, no AVX512-BF16/AMX) with torch 2.13: a 2048² matmul ran at
# 0.3 GFLOP/s in bf16 against 116–127 GFLOP/s in fp32.
EMULATED_BF16_WARNING = (
    "bf16 was forced on a CPU without AMX or AVX512-BF16: its matmuls are emulated and run "
    "100–300× slower than fp32 (measured: 0.3 vs 116–127 GFLOP/s for a 2048² matmul on an AVX2 EPYC). "
    "Use hardware.precision=auto or fp32 here."
)


@dataclass
class Resolution:
    config: Config  # a ResolvedConfig once resolve() returns
    reasons: list[tuple[str, str, str]] = field(default_factory=list)  # (key, value, why)

    def note(self, key: str, value, why: str) -> None:
        self.reasons.append((key, str(value), why))


def resolve(cfg: Config, hw: HardwareFacts, world_size: int, local_world_size: int,
            bound_by_launcher: bool = False) -> Resolution:
    """A read-only copy of `cfg` with every "auto" decided, and the reason for each choice. One key
    needs more than the hardware: model.attn_implementation=auto is timed on the model's shape on
    this rank's threads, once the process group exists: cputrain.training.choices decides the keys that
    need more than the hardware."""
    cfg = cfg.model_copy(deep=True)
    res = Resolution(cfg)

    precision, why = precision_choice(cfg.hardware.precision, hw)
    if cfg.hardware.precision == "bf16" and not hw.has_fast_bf16:
        warnings.warn(EMULATED_BF16_WARNING, stacklevel=2)
    if why:
        cfg.hardware.precision = precision
        res.note("hardware.precision", precision, why)

    # mpirun bound this rank to its own cores (Open MPI's and Intel MPI's default binding): the
    # cores it sees are its share already, not the node's to divide again
    sharing = 1 if bound_by_launcher else max(1, local_world_size)
    per_rank = max(1, hw.physical_cores // sharing)
    if cfg.hardware.threads == "auto":
        cfg.hardware.threads = per_rank
        res.note(
            "hardware.threads",
            per_rank,
            f"mpirun bound this rank to {hw.physical_cores} physical core(s) of its own (Open MPI binds each "
            "of 2 or fewer ranks to one core: pass --bind-to none to let cputrain divide the node's cores)"
            if bound_by_launcher else
            f"{hw.physical_cores} physical cores ÷ {local_world_size} rank(s) on this node "
            "(hyper-threads add nothing to matmul throughput)",
        )
    elif cfg.hardware.threads * sharing > hw.logical_cpus:
        asked = cfg.hardware.threads
        cfg.hardware.threads = per_rank
        why = (f"hardware.threads={asked} × {sharing} rank(s) is more than the {hw.logical_cpus} CPUs usable "
               f"here: using {per_rank} per rank (threads beyond the cores only wait for each other)")
        res.note("hardware.threads", per_rank, why)  # logged at start as one line, and kept in config.yaml

    if cfg.model.compile == "auto":
        width = model_width(cfg)
        if cfg.hardware.precision != "bf16" or not hw.has_fast_bf16:
            cfg.model.compile = False
            why = "fp32 or emulated bf16: compiled blocks were measured at 1.01× eager in fp32 (benchmarks/step_time/step_profile.py)"
        elif width is not None and width < 512:
            cfg.model.compile = False
            why = (f"a model {width} wide: its steps are short, and compiling (tens of seconds on the first run) "
                   "would not be paid back; set model.compile=true to compile anyway")
        elif cfg.model.lora.enabled and hw.flags.get("amx_bf16"):
            cfg.model.compile = False
            why = ("LoRA on AMX: blocks with peft's adapter layers ran slower and larger compiled; measured on a 300M "
                   "Llama in bf16: 497 tokens/s and 4.9 GiB eager vs 399 and 5.8 compiled (on AVX512-BF16 without AMX "
                   "the same shape ran 1.16× faster compiled); set model.compile=true to compile anyway (graph breaks "
                   "are not the cause: benchmarks/lora/lora_compile.py)")
        elif cfg.model.lora.enabled:
            cfg.model.compile = True
            why = ("LoRA on AVX512-BF16 without AMX: compiled blocks with peft's adapter layers measured 1.16× eager's "
                   "tokens/s at 0.81× its step peak on a 300M Llama in bf16 (249 vs 214 tokens/s, 4.57 vs 5.64 GiB; "
                   "benchmarks/lora/lora.py --only compile-timed); on AMX they measured slower, and stay off there")
        else:
            cfg.model.compile = True
            why = ("bf16 on AMX/AVX512-BF16: inductor fuses the norms, rotary and SiLU that run between the "
                   "matmuls (measured +4–7% tokens/s on a 97M Llama, benchmarks/step_time/bf16_step.py); kernels are cached")
        res.note("model.compile", cfg.model.compile, why)

    if cfg.data.num_proc == "auto":
        cfg.data.num_proc = hw.physical_cores
        res.note("data.num_proc", hw.physical_cores,
                 "one tokenizing process per physical core: the other ranks only wait for the token cache")

    if cfg.parallel.strategy == "auto":
        cfg.parallel.strategy, why = strategy_choice(cfg.parallel.strategy, world_size)
        res.note("parallel.strategy", cfg.parallel.strategy, why)

    if cfg.parallel.backend == "auto":
        backend = "ccl" if hw.backends.get("ccl") else "gloo"
        cfg.parallel.backend = backend
        why = "oneccl_bindings_for_pytorch imports" if backend == "ccl" else "oneCCL bindings not installed; gloo ships with torch"
        res.note("parallel.backend", backend, why)

    error = batch_error(cfg.train, world_size)
    if error:
        raise ConfigError(error)
    res.config = ResolvedConfig.model_validate(cfg.model_dump())
    return res


def resolve_for_plan(cfg: Config, world_size: int) -> Resolution:
    """The machine's keys a plan reads, as they resolve on what it plans for: the precision on
    the built-in instances (every one has AMX) and the strategy for `world_size` ranks. Threads,
    tokenizing processes, compile and the backend are left to the run's node: no byte of the
    plan depends on them. cputrain.training.choices.decide_for_plan decides the rest, and validates
    the config once at its end."""
    cfg = cfg.model_copy(deep=True)
    res = Resolution(cfg)
    precision, why = precision_choice(cfg.hardware.precision, hw=None)
    if why:
        cfg.hardware.precision = precision
        res.note("hardware.precision", precision, why)
    strategy, why = strategy_choice(cfg.parallel.strategy, world_size)
    if why:
        cfg.parallel.strategy = strategy
        res.note("parallel.strategy", strategy, why)
    return res


def model_width(cfg: Config) -> int | None:
    """The model's hidden size where it is known before loading: the arch of a model built from
    scratch, or a local folder's config.json (a hub id's is not read here)."""
    if cfg.model.name_or_path is None:
        return cfg.model.arch.get("hidden_size", 0)
    config_json = os.path.join(cfg.model.name_or_path, "config.json")
    try:
        with open(config_json) as f:
            width = json.load(f).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return None
    return width if isinstance(width, int) else None


def precision_choice(setting: str, hw: HardwareFacts | None) -> tuple[str, str]:
    """hardware.precision as it resolves on `hw`, and why ("" when the config fixed it). The plan
    passes hw=None: it sizes the built-in instance families, which all have AMX."""
    if setting == "bf16" and hw is not None and not hw.has_fast_bf16:
        return "bf16", "forced by the config (emulated on this CPU)"
    if setting != "auto":
        return setting, ""
    if hw is None:
        return "bf16", "what auto resolves to on the AMX instances the plan sizes"
    if hw.has_fast_bf16:
        unit = "AMX" if hw.flags.get("amx_bf16") else "AVX512-BF16"
        return "bf16", f"the CPU has {unit}: bf16 matmuls run in hardware"
    return "fp32", "no AMX or AVX512-BF16: bf16 would be emulated, 100–300× slower"


def strategy_choice(setting: str, world_size: int) -> tuple[str, str]:
    """parallel.strategy for `world_size` ranks, and why ("" when the config fixed it)."""
    if setting != "auto":
        return setting, ""
    if world_size == 1:
        return "single", "one rank"
    return "ddp", f"{world_size} ranks; the model is replicated (use fsdp to shard it)"


# Measured in fp32 on a 2-core AVX2 EPYC (benchmarks/step_time/fp32_choices.py, blocks fp32_choices-*).
FP32_LARGE_VOCAB_WHY = ("at a 128,256-token vocabulary it measured 1.05× the plain head's speed in fp32 with 1.2 GiB "
                        "less step peak (benchmarks/step_time/fp32_choices.py)")


def chunked_loss_choice(setting, precision: str, tokens_per_micro_batch: int, vocab: int,
                        score_head_of: str | None = None) -> tuple[bool, str]:
    """model.chunked_loss for this precision and head shape, and why ("" when the config fixed it).
    `score_head_of`: the objective, where it trains a score head in place of the vocabulary's."""
    from cputrain.kernels.chunked_loss import BLOCK_BYTES

    if setting != "auto":
        return setting, ""
    if score_head_of is not None:
        return False, f"train.objective={score_head_of}: a score head of one output, no vocabulary of logits to cut"
    if precision == "bf16":
        return True, ("bf16: the fp32 logits of one block of tokens at a time instead of the whole vocabulary's, and "
                      "+1% tokens/s on a 97M Llama on AMX (benchmarks/step_time/bf16_step.py)")
    logits_mib = tokens_per_micro_batch * vocab * 4 / 2**20
    if logits_mib * 2**20 > BLOCK_BYTES:
        return True, (f"fp32, {logits_mib:,.0f} MiB of fp32 logits per micro-batch ({tokens_per_micro_batch:,} tokens × "
                      f"{vocab:,}): the plain head keeps about three such copies, the chunked one about one; "
                      + FP32_LARGE_VOCAB_WHY)
    return False, (f"fp32, {logits_mib:,.0f} MiB of fp32 logits per micro-batch: the plain head measured 1.01× the "
                   "chunked one's speed at the demo's shape and 1.03× at ~100M (benchmarks/step_time/fp32_choices.py), and its "
                   "logits are small")


# The keys "auto" may stand for, and the environment variable in which the torchrun agent hands
# its resolved values to the ranks it starts.
AUTO_KEYS = ("hardware.precision", "hardware.threads", "data.num_proc", "parallel.strategy", "parallel.backend",
             "model.compile")
AGENT_SETTINGS_VAR = "CPUTRAIN_AGENT_SETTINGS"


def settings_of(cfg: Config) -> dict:
    """The values of the keys "auto" may stand for, as `section.key` → value."""
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in AUTO_KEYS}


def check_agent_agrees(cfg: Config, environ: dict | None = None) -> None:
    """A rank started by cputrain's agent resolved "auto" as the agent did (the agent printed its
    plan and set each rank's threads from it); a rank that differs stops, naming the key."""
    text = (os.environ if environ is None else environ).get(AGENT_SETTINGS_VAR)
    if not text:
        return
    agent, mine = json.loads(text), settings_of(cfg)
    for key in AUTO_KEYS:
        if key in agent and agent[key] != mine[key]:
            raise ConfigError(f"{key} resolved to {mine[key]!r} in this rank but to {agent[key]!r} in the agent "
                              "that started it; set it explicitly in the config")


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * world_size)
