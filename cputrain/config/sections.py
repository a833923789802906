"""Typed run configuration: YAML file + dotted `key=value` overrides, validated before any work.

Every section is a pydantic model with `extra="forbid"`, so an unknown key is refused; the
docstring under each field is its documentation (pydantic keeps it as the field description,
which `cputrain train --help-config` prints). Values left at "auto" are resolved later, with
a reason, by `cputrain.config.resolve` once the hardware is known, into a read-only
`cputrain.config.resolved.ResolvedConfig`. Reading YAML and overrides is `cputrain.config.file`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

# model.activation_checkpointing="N+selective": the first N blocks whole, the others selective.
MixedCheckpointing = Annotated[str, StringConstraints(pattern=r"^[0-9]+\+selective$")]

# The demo's model: a small Llama (~5M parameters with a 4096-token vocabulary).
DEFAULT_ARCH: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


class Section(BaseModel):
    # allow_inf_nan=False: no float setting means anything at inf or nan (train.lr=inf used to train
    # one step and export non-finite weights)
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


def _positive_or_auto(section: Section, dotted: str):
    value = getattr(section, dotted.rsplit(".", 1)[1])
    if isinstance(value, int) and value < 1:
        raise ValueError(f"{dotted} must be a positive integer or 'auto'")
    return section


def batch_key(train: "TrainConfig") -> str:
    """The key the batch was set with: in pairs, or in rows."""
    return "train.global_batch_pairs" if train.global_batch_pairs is not None else "train.global_batch_size"


def batch_error(train: "TrainConfig", world_size: int = 1) -> str | None:
    """The one batch-divisibility rule: whole micro-batches per step, and per rank once the
    world size is known (config validation asks with one rank, cputrain.config.resolve with all)."""
    key = batch_key(train)
    if train.global_batch_size % train.micro_batch_size:
        return (f"{key} ({train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({train.micro_batch_size})")
    if train.global_batch_size % (train.micro_batch_size * world_size):
        return (f"{key} ({train.global_batch_size}) is not divisible by "
                f"micro_batch_size × world size ({train.micro_batch_size} × {world_size}); "
                "change one of them so each rank gets whole micro-batches")
    return None


# The attention and MLP projections of Llama-style decoder blocks (Llama, Mistral, Qwen2, Gemma …).
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    enabled: bool = False
    """Train low-rank adapters (LoRA, through the peft library) instead of every weight. The base
    model stays frozen: stored in bf16 where the compute is bf16, with no gradients or optimizer
    state; checkpoints hold the adapters only. Needs model.name_or_path (a pretrained base)."""

    rank: int = 16
    """Rank r of each adapter: the update of a d_out × d_in weight is B·A with B d_out × r, A r × d_in."""

    alpha: float = Field(32.0, gt=0)
    """Scale of the adapters' output: alpha ÷ rank (peft's lora_alpha)."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input (peft's lora_dropout)."""

    target_modules: list[str] | Literal["auto"] = "auto"
    """Names of the linear layers that get adapters (a name matches a module whose name ends with
    it). auto: the attention and MLP projections of Llama-style models (q_proj … down_proj), else
    peft's default for the model type."""

    init_weights: bool | Literal["gaussian"] = True
    """peft's init_lora_weights: true (A like nn.Linear, B zero: the model starts as the base),
    gaussian (A normal with std 1/r, B zero) or false (both random: for tests only)."""

    base_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """How the frozen base is stored. auto: bf16 where the compute is bf16 or the model's files
    hold bf16 (Llama-3's do: a bf16 copy loses nothing, at half the bytes), else fp32. A bf16 base
    under fp32 compute (a CPU without bf16 units) converts each layer's weight to fp32 for its
    matmul: an 8B base then takes 15 GiB, not 30."""

    @field_validator("rank")
    @classmethod
    def _rank_positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"model.lora.rank must be a positive integer (8–64 is usual), not {value}")
        return value

    @field_validator("target_modules")
    @classmethod
    def _targets_named(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("model.lora.target_modules is empty; name linear layers (e.g. [q_proj, v_proj]) or use auto")
        return value


class ModelConfig(Section):
    name_or_path: str | None = None
    """Local Hugging Face model folder (or hub id where there is a network) to fine-tune.
    Leave empty to build a new model with random weights from `arch`."""

    arch: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_ARCH))
    """Architecture of a model built from scratch: keyword arguments of the transformers config
    class named by `model_type`. `vocab_size` is taken from the tokenizer. A llama arch given in
    part (`model.arch.num_hidden_layers=2`) keeps the demo's values for the keys it leaves out."""

    tokenizer: str | None = None
    """Tokenizer folder. Empty: the model folder's tokenizer, or for a model built from scratch a
    byte-level BPE trained on the training data and cached."""

    tokenizer_vocab_size: int = Field(4096, gt=255)
    """Vocabulary size of a tokenizer trained on the data (model built from scratch only)."""

    trust_remote_code: bool = False
    """Run Python code shipped with a model folder. Off unless you trust its author."""

    attn_implementation: Literal["auto", "sdpa", "eager"] = "auto"
    """Attention kernel: PyTorch's scaled_dot_product_attention (its CPU flash kernel), the eager
    reference (plain matmuls + softmax), or auto: both are timed, forward and backward, on this
    run's attention shape and dtype (up to 3 alternated rounds, each one's fastest), and eager is
    used where it is at least 10% faster, sdpa otherwise."""

    activation_checkpointing: bool | int | Literal["auto", "selective"] | MixedCheckpointing = False
    """Recompute decoder blocks' activations in the backward pass: less memory, more compute (a
    checkpointed block runs its forward twice: ~1.5× its FLOPs). true: every block; an integer N:
    the first N blocks, the others keep their activations; selective: every block keeps the
    outputs of its matmuls and attention and recomputes only the cheap operations between them
    (norms, RoPE, SiLU × up, casts): no matmul runs twice, and about half a block's activations
    are kept; "N+selective": the first N blocks whole, the others selective (selective and its
    mix not with parallel.strategy=zero3); auto: none where the memory plan fits this node
    without checkpointing, else selective where that fits, else the fewest whole blocks with the
    others selective (zero3: the others keeping everything) that fit, by
    `cputrain.plan.memory.checkpointing`."""

    compile: bool | Literal["auto"] = "auto"
    """Compile each decoder block with torch.compile (inductor). The first step is slower (its
    time is logged); later ones faster. auto: on for bf16 on AMX or AVX512-BF16 hardware, where
    it was measured to pay, except for models narrower than 512 (built from scratch or read from a
    local folder) and LoRA runs on AMX (compiled blocks with peft's layers measured slower and
    larger there; faster and smaller on AVX512-BF16 without AMX)."""

    chunked_loss: bool | Literal["auto"] = "auto"
    """Compute the head and its cross-entropy a block of tokens at a time, so the fp32 logits of
    the whole vocabulary never exist at once (1 GiB per copy for Llama-3 at 2,048 tokens); for DPO,
    SimPO, KTO, GRPO and RLOO each token's log-probability, the same way. auto:
    on in bf16; in fp32 on where one micro-batch's fp32 logits exceed 256 MiB (a large vocabulary),
    off below that, where the plain head measured as fast and its logits are small
    (benchmarks/step_time/fp32_choices.py)."""

    compile_cache_dir: str | None = None
    """Folder kept between runs for inductor's compiled kernels. Empty: `<data.cache_dir>/inductor`."""

    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("activation_checkpointing")
    @classmethod
    def _blocks_not_negative(cls, value):
        if not isinstance(value, bool) and isinstance(value, int) and value < 0:
            raise ValueError(f"model.activation_checkpointing is {value}; use true, false, selective, auto, a "
                             "number of decoder blocks ≥ 0, or N+selective")
        return value

    @field_validator("arch", mode="before")
    @classmethod
    def _fill_arch(cls, value):
        # Without this, one override replaces the whole dict and the rest falls back to
        # transformers' own defaults (a 7B-sized Llama) instead of the small demo model.
        if isinstance(value, dict) and value.get("model_type", DEFAULT_ARCH["model_type"]) == DEFAULT_ARCH["model_type"]:
            return {**DEFAULT_ARCH, **value}
        return value


def checkpointing_split(setting: bool | int | str, layers: int) -> tuple[int, int]:
    """(whole, selective): how many decoder blocks a resolved model.activation_checkpointing
    recomputes whole (the first ones, whose backward runs last, after the other blocks' kept
    activations are freed) and how many of the others keep only their matmul outputs; the rest
    keep everything."""
    if setting == "auto":
        raise ValueError("model.activation_checkpointing=auto is resolved by the run (cputrain.plan.memory.checkpointing)")
    if isinstance(setting, str):  # "selective" or "N+selective"
        whole = min(int(setting.split("+")[0]), layers) if "+" in setting else 0
        return whole, layers - whole
    if isinstance(setting, bool):
        return (layers if setting else 0), 0
    return min(setting, layers), 0


def checkpointed_blocks(setting: bool | int | str, layers: int) -> int:
    """How many decoder blocks a resolved model.activation_checkpointing recomputes whole."""
    return checkpointing_split(setting, layers)[0]


def uses_selective(setting: bool | int | str) -> bool:
    """Whether some blocks are checkpointed selectively ("selective" or "N+selective")."""
    return isinstance(setting, str) and setting.endswith("selective")


# data.format values renamed since configs were written: read as the new name.
DATA_FORMAT_RENAMED = {"unpaired": "feedback"}


class DataConfig(Section):
    source: str = "builtin:pydoc"
    """What to train on: `builtin:pydoc` (Python's own documentation, ships with Python), a local
    .txt/.jsonl/.parquet file or a folder of them, or `hf:NAME` for a Hugging Face dataset."""

    hf_config: str | None = None
    """Configuration name of a Hugging Face dataset (`hf:` sources only)."""

    hf_split: str = "train"
    """Split of a Hugging Face dataset to read (`hf:` sources only)."""

    text_field: str = "text"
    """Field holding the text in .jsonl/.parquet/Hugging Face records (data.format=text)."""

    format: Literal["text", "chat", "prompt_completion", "alpaca", "preference", "feedback", "prompt", "auto"] = "text"
    """What a record is. text: raw text, every token trained (pretraining). chat: a list of
    {role, content} messages (roles system, user, assistant, tool; content text or a list of text
    parts; assistant tool_calls) in data.messages_field, rendered with the chat template.
    prompt_completion: a prompt and its answer (data.prompt_field, data.completion_field). alpaca:
    instruction, optional input, output, the prompt written as Stanford Alpaca's. preference: a
    prompt with a chosen and a rejected answer (data.prompt_field, data.chosen_field,
    data.rejected_field; strings, or conversations rendered with the chat template; without a
    prompt, chosen and rejected are whole conversations and their shared leading messages are the
    prompt), for train.objective=dpo, simpo or reward. feedback (TRL's "unpaired preference";
    unpaired, its former name, is read as feedback): one answer with a thumbs-up or thumbs-down, a
    prompt (data.prompt_field), its completion (data.completion_field) and a boolean label
    (data.label_field: true desirable, false undesirable); strings, or conversations rendered with
    the chat template; without a prompt, the completion is the whole conversation and its closing
    assistant turns are the answer; for train.objective=kto. prompt (TRL's prompt-only): a prompt
    alone (data.prompt_field; a string, or a conversation rendered through the assistant's header),
    its other columns (e.g. `answer`) handed to the reward functions, for train.objective=grpo and
    rloo. auto: preference if the first record has data.chosen_field and data.rejected_field, else
    feedback if it has data.label_field and data.completion_field, else chat if it has
    data.messages_field, else prompt_completion if it has both of those fields, else alpaca if it
    has instruction and output, else prompt if it has data.prompt_field alone, else text; the
    choice is logged."""

    messages_field: str = "messages"
    """Field holding a conversation's messages (data.format=chat)."""

    prompt_field: str = "prompt"
    """Field holding the prompt (data.format=prompt_completion, preference, feedback)."""

    completion_field: str = "completion"
    """Field holding the answer (data.format=prompt_completion, feedback)."""

    chosen_field: str = "chosen"
    """Field holding the preferred answer (data.format=preference)."""

    rejected_field: str = "rejected"
    """Field holding the answer that is not preferred (data.format=preference)."""

    label_field: str = "label"
    """Field holding an answer's thumbs-up (true) or thumbs-down (false) (data.format=feedback)."""

    margin_field: str | None = None
    """Field holding how much better the chosen answer is than the rejected one, a number per pair
    (data.format=preference; TRL's `margin` column): train.objective=reward subtracts it inside the
    Bradley–Terry loss, -logσ(r_chosen - r_rejected - margin). Empty: under train.objective=reward, a
    local file's `margin` column by TRL's name for it (data.margin_field=null: none), else no margin.
    Other objectives read no margin: setting it there is refused."""

    train_on: Literal["auto", "assistant", "completion", "all"] = "auto"
    """Which tokens carry loss: assistant (the assistant turns of a chat, each with the token that
    ends it), completion (the answer of a prompt/completion record, with EOS), or all. auto:
    assistant for chat, completion for prompt_completion and alpaca; text trains on all tokens."""

    chat_template: str | None = None
    """A Jinja file that replaces the tokenizer's chat template. Empty: the tokenizer's own, or
    for a tokenizer without one the built-in ChatML template (cputrain.data.chat_template)."""

    packing: bool = True
    """chat and prompt_completion: pack whole examples into sequences of data.seq_len, positions
    restarting at each example and no token attending to another example. false: one example per
    row, each micro-batch padded to its longest example. (Text is always packed.)"""

    shared_prompt: bool | Literal["auto"] = "auto"
    """preference: lay each pair out as prompt + chosen, then the rejected answer after one copy
    of the prompt's last token, attending to the prompt through a 4D attention mask, so the prompt
    is computed once per pair instead of twice (the pair's log-probabilities are the same). false:
    the two sequences whole, one after the other. A pair is kept where it fits data.seq_len as laid
    out. auto: true for data.format=preference, false otherwise, and on a run folder to resume what
    its config.yaml recorded (false for a folder from before this key); true on other data is
    refused."""

    truncation: Literal["drop", "truncate"] = "drop"
    """An example longer than data.seq_len: drop it, or keep its first data.seq_len tokens. Counted
    in the cache's stats.json and logged."""

    seq_len: int = Field(256, gt=1)
    """Tokens per packed training sequence. Documents are joined with EOS and cut to this length: no padding."""

    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of documents held out for validation (chosen by a seeded shuffle)."""

    cache_dir: str = ".cache/cputrain"
    """Where tokenized data and trained tokenizers are cached, keyed by content."""

    max_documents: int | None = Field(None, gt=0)
    """Read at most this many documents (for quick trials)."""

    num_proc: int | Literal["auto"] = "auto"
    """Processes that tokenize while the token cache is built. auto: the node's physical cores
    (the other ranks only wait for the cache, so the whole node can tokenize)."""

    bad_records: Literal["fail", "skip"] = "fail"
    """A .jsonl line that is not a JSON object: fail (name how many and the first line number)
    or skip such lines (their count is logged and kept in the cache's stats.json)."""

    tokenizer_sample_mb: float = Field(256, gt=0)
    """Text read to train a tokenizer for a model built from scratch: evenly spaced documents up
    to this many MB, so a 10B-token corpus trains one in minutes and bounded memory."""

    lock_stale_s: int = Field(300, gt=0)
    """Seconds without a heartbeat after which a cache writer (tokenizer or token cache) is taken
    for dead; another process then takes over and resumes its half-built cache."""

    @field_validator("format", mode="before")
    @classmethod
    def _format_renamed(cls, value):
        # configs and run folders written before the rename still load, resume and read their cache
        return DATA_FORMAT_RENAMED.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _positive_num_proc(self):
        return _positive_or_auto(self, "data.num_proc")

    @model_validator(mode="after")
    def _format_fits(self):
        answer = ("auto", "completion", "all")
        fits = {"chat": ("auto", "assistant", "all"), "prompt_completion": answer, "alpaca": answer,
                "text": ("auto", "all"), "preference": ("auto", "completion"), "feedback": ("auto", "completion")}
        if self.format in fits and self.train_on not in fits[self.format]:
            raise ValueError(f"data.train_on={self.train_on} does not apply to data.format={self.format}; "
                             f"choose one of {', '.join(fits[self.format])}")
        if self.format in ("chat", "prompt_completion", "alpaca", "preference", "feedback", "prompt") and \
                self.source.lower().endswith(".txt"):
            raise ValueError(f"data.format={self.format} needs records with fields (.jsonl, .parquet or hf:), "
                             f"but '{self.source}' is plain text; use data.format=text or convert it to .jsonl")
        return self


class TrainConfig(Section):
    max_steps: int | None = Field(100, gt=0)
    """Optimizer steps to run. Empty: run `epochs` passes over the data instead."""

    epochs: float | None = Field(None, gt=0)
    """Passes over the training data; used only when `max_steps` is empty."""

    global_batch_size: int = Field(8, gt=0)
    """Rows per optimizer step, summed over all ranks and accumulation steps: a row is a
    sequence of data.seq_len tokens, or (data.packing=false) one example or one preference pair.
    Fixed across world sizes, so a run resumed on another number of ranks trains the same way.
    At most the training rows: a step takes each row once, and a larger batch is refused (the
    run says how many rows, and pairs, the data made) rather than trained with rows repeated
    inside a step. Packed preference data holds several pairs a row, a varying number: each
    step logs its pairs (pairs_per_step), and train.global_batch_pairs sets the batch in pairs."""

    global_batch_pairs: int | None = Field(None, gt=0)
    """Preference pairs per optimizer step, the batch as TRL counts it (per_device_train_batch_size
    × gradient_accumulation_steps × processes), for train.objective dpo or simpo. Each row then
    holds one pair, so data.packing=false is required (packing puts a varying number of pairs in
    each row, and a step's pairs would vary with it); train.global_batch_size takes this value and
    train.micro_batch_size counts pairs. Empty: the batch is train.global_batch_size rows."""

    micro_batch_size: int = Field(4, gt=0)
    """Rows per forward pass on one rank. Accumulation = global ÷ (micro × world size)."""

    lr: float = Field(3e-3, gt=0)
    """Peak learning rate of AdamW."""

    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine schedule ends at lr × this."""

    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps before the cosine decay."""

    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay, applied to matrices only (not norms or biases)."""

    beta1: float = Field(0.9, gt=0, lt=1)
    """AdamW beta1."""

    beta2: float = Field(0.95, gt=0, lt=1)
    """AdamW beta2."""

    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 turns clipping off."""

    max_bad_steps: int = Field(3, gt=0)
    """Optimizer steps in a row whose loss or gradient norm is not finite (NaN or inf) before the
    run stops. Such a step is skipped: no weight, optimizer moment or checkpoint sees it; its
    batch counts as consumed and the schedule moves on. zero3 steps inside DeepSpeed's engine and
    cannot skip, so there the first such step stops the run, before any checkpoint of it."""

    eval_every: int = Field(25, gt=0)
    """Compute validation loss every this many steps (and at the end)."""

    eval_batches: int = Field(8, gt=0)
    """Micro-batches of validation data per evaluation."""

    log_every: int = Field(5, gt=0)
    """Write a metrics.jsonl line every this many steps."""

    checkpoint_every: int = Field(50, gt=0)
    """Save a checkpoint every this many steps (and at the end)."""

    checkpoint_every_s: float | None = Field(None, gt=0)
    """Also save once this many seconds have passed since the last save (or the session's start):
    at 8B a step takes minutes, so a step count alone can mean hours of work between saves. Rank
    0's clock decides for every rank (in the step's all-reduce). Empty: by steps only."""

    keep_last: int = Field(2, gt=0)
    """Complete checkpoints to keep; older ones are deleted."""

    sample_tokens: int = Field(80, ge=0)
    """Tokens of text generated at the end of the run into sample.txt; 0 skips it."""

    report_to: list[Literal["jsonl", "tensorboard", "mlflow", "wandb"]] = Field(default_factory=lambda: ["jsonl"])
    """Where the logged scalars go. metrics.jsonl is always written (summary.json, loss.png and a
    resumed run read it); tensorboard (event files in <output_dir>/tensorboard), mlflow (a local
    <output_dir>/mlruns unless MLFLOW_TRACKING_URI is set) and wandb (offline unless WANDB_MODE is
    set) each need their extra, e.g. pip install 'cputrain[tensorboard]'. Rank 0 writes them."""

    progress_every_s: float = Field(5.0, ge=1.0)
    """Inside a Kubeflow TrainJob (where the Trainer controller sets KUBEFLOW_TRAINER_SERVER_URL),
    rank 0 reports the job's progress, remaining time and latest metrics at most this often, and
    once at the end; each report is a write through the Kubernetes API, hence the floor of 1 s.
    Elsewhere nothing is sent."""

    objective: Literal["lm", "dpo", "simpo", "kto", "reward", "grpo", "rloo"] = "lm"
    """What a step minimises. lm: the next-token loss on the trained tokens. dpo: Direct Preference
    Optimization's sigmoid loss on preference pairs (data.format=preference), against a reference:
    the base model with the LoRA adapters off (model.lora.enabled=true). simpo: SimPO's
    reference-free loss on the answers' mean log-probabilities (full weights or LoRA). kto:
    Kahneman-Tversky Optimization's loss (TRL's KTOTrainer) on answers with a thumbs-up or down
    (data.format=feedback), against a reference (the starting weights; with LoRA the base, adapters
    off) and its KL estimate from mismatched prompt/completion pairs. reward: a reward model, a
    scalar score head on the model (transformers' sequence classifier, num_labels=1) trained with
    the Bradley–Terry loss on preference pairs (TRL's RewardTrainer); its model/ loads with
    AutoModelForSequenceClassification and `cputrain score` scores records with it. grpo and rloo:
    online reinforcement learning (TRL's GRPOTrainer and RLOOTrainer) on prompts (data.format=prompt):
    each step samples train.num_generations completions of each of its prompts from the policy,
    scores them with train.rewards, and trains on their advantages within each prompt's group."""

    dpo_beta: float = Field(0.1, gt=0)
    """DPO's β: how far the policy may move from the reference (TRL's default, 0.1)."""

    dpo_reference: Literal["precompute", "live"] = "precompute"
    """Where DPO's reference log-probabilities come from. precompute: one no-grad pass over the
    pairs before the first step (the weights as loaded; with LoRA the base, adapters off), kept in
    memory (8 bytes a pair), so no step runs the reference: with LoRA 1.35× the trained tokens/s of
    live on a 2-core AVX512-BF16 EPYC (docs/benchmarks/sft-and-dpo.md, block dpo). live (LoRA only): the base
    with the adapters off on every micro-batch, which costs less only where a run sees fewer pairs
    than the data holds. Full weights precompute always: live would need a second model. KTO's
    reference is always precomputed so, its KL completions included."""

    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """DPO's label smoothing: the share of pairs taken as wrongly labelled (conservative DPO); 0: none."""

    simpo_beta: float = Field(2.0, gt=0)
    """SimPO's β, the scale of the mean log-probabilities (the SimPO paper's default, 2.0)."""

    simpo_gamma: float = Field(0.5, ge=0)
    """SimPO's target reward margin γ (the SimPO paper's default, 0.5)."""

    kto_beta: float = Field(0.1, gt=0)
    """KTO's β: how far the policy may move from the reference (TRL's default, 0.1)."""

    kto_desirable_weight: float = Field(1.0, gt=0)
    """KTO's weight on the losses of desirable answers (label true; TRL's desirable_weight, 1.0).
    Where the data holds more of one label than the other, the run warns as TRL does with the range
    the KTO paper recommends for the weights (desirable × its count over undesirable × its count
    in [1, 4/3])."""

    kto_undesirable_weight: float = Field(1.0, gt=0)
    """KTO's weight on the losses of undesirable answers (label false; TRL's undesirable_weight, 1.0)."""

    center_rewards_coefficient: float | None = Field(None, ge=0)
    """reward: a penalty on the squared sum of each pair's two rewards, times this, that keeps the
    rewards centred on zero (TRL's center_rewards_coefficient; 0.01 is its recommendation). Empty: none."""

    num_generations: int = Field(8, ge=2)
    """grpo, rloo: completions sampled per prompt, one group whose rewards make each other's baseline
    (TRL's num_generations, 8). train.global_batch_size counts completions, as TRL's batch does,
    and must be a multiple of it: a step trains global_batch_size ÷ num_generations prompts, each
    prompt's group on one rank."""

    max_completion_length: int = Field(256, gt=0)
    """grpo, rloo: the most tokens sampled for one completion (TRL's max_completion_length, 256); a
    completion that reaches it unfinished counts in completions/clipped_ratio. A prompt longer than
    data.seq_len − this is refused before any work."""

    temperature: float = Field(1.0, gt=0)
    """grpo, rloo: the sampling temperature of the rollouts (TRL's, 1.0)."""

    top_p: float = Field(1.0, gt=0, le=1)
    """grpo, rloo: nucleus sampling's share of probability kept (1.0: off, TRL's)."""

    top_k: int = Field(0, ge=0)
    """grpo, rloo: sample among the k most likely tokens only (0: off, TRL's)."""

    rewards: list[str] = Field(default_factory=list)
    """grpo, rloo: the reward functions, each one of: a Python callable `module:function` with TRL's
    signature f(prompts, completions, completion_ids, **columns) -> list[float | None] (the
    prompts' other columns, e.g. `answer`, as lists); a built-in, `exact_answer` (1.0 where the
    completion's text, stripped, equals the record's `answer` column, else 0.0),
    `starts_with_answer` (1.0 where it opens with `answer`, case aside) or `regex:<pattern>` (1.0
    where the completion matches the pattern from its start, else 0.0); or a
    reward model's run folder (`train.objective=reward`), scored in process. Each is logged as
    rewards/<name>/mean."""

    reward_weights: list[float] | None = None
    """grpo, rloo: one weight per entry of train.rewards; a completion's reward is the weighted sum
    (TRL's reward_weights). Empty: every weight 1.0."""

    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """grpo: how the per-token losses are summed (TRL's loss_type, dapo by default). grpo: the mean
    over each completion's tokens, then over the completions; dapo: over every completion token of
    the global batch; dr_grpo: the sum ÷ (completions × train.max_completion_length). Each is
    normalised over the global batch, whatever the micro-batches and ranks."""

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo: the advantage is the reward minus its group's mean, divided by the standard deviation
    of the rewards of the group (group, TRL's default), of the whole global batch (batch), or not
    divided (none: Dr. GRPO's advice)."""

    normalize_advantages: bool = False
    """rloo: scale the leave-one-out advantages of the global batch to mean 0 and standard deviation
    1 (TRL's normalize_advantages, false)."""

    epsilon: float = Field(0.2, gt=0, lt=1)
    """grpo, rloo: the clipping range's lower side: the probability ratio to the policy that
    sampled is clipped at 1 − epsilon (TRL's, 0.2)."""

    epsilon_high: float | None = Field(None, gt=0)
    """grpo, rloo: the clipping range's upper side, 1 + epsilon_high (DAPO recommends 0.28). Empty:
    train.epsilon."""

    num_iterations: int = Field(1, gt=0)
    """grpo, rloo: optimizer steps taken on each batch of rollouts (TRL's μ, 1): one sampling every
    this many steps, the later steps against the log-probabilities of the policy that sampled."""

    rl_beta: float = Field(0.0, ge=0)
    """grpo, rloo: the weight of the KL divergence to the reference (TRL's beta; 0: none, and no
    reference pass). grpo adds it to each token's loss, rloo subtracts β × the completion's
    summed log-ratio from its reward, as TRL does. The reference is the model with the LoRA adapters
    off; with full weights it would need a frozen copy of the starting model (twice the weights'
    memory), which is not kept: with full weights rl_beta > 0 is refused."""

    stop_at_step: int | None = Field(None, gt=0)
    """Stop after this optimizer step, with a checkpoint, leaving the schedule (set by max_steps)
    untouched: for time-boxed or preemptible jobs. Run again without it to continue."""

    profile_step: int | None = Field(None, gt=0)
    """Profile this optimizer step (1-based, as the log counts them: all its micro-batches, forward
    and backward, clipping and the optimizer) with torch.profiler on rank 0 only, so one rank pays
    the profiler's cost; the other ranks run unprofiled. Writes profile_step<N>.json (the step's
    time by operator family: matmuls with their GFLOP/s, attention, cross-entropy, optimizer,
    checkpointing's recompute, compiled kernels, casts, elementwise; the top 10 operators) and
    profile_step<N>.trace.json.gz (a Chrome trace, tens of MB unpacked at 8B) into the run folder,
    and logs one line. That step runs slower (every operator and Python call is recorded) and its
    time counts so in metrics.jsonl; starting the profiler and writing the files are left out. The
    first step holds one-time work (allocation, compiling): profile a later one. It also takes
    memory the plan does not count: a Llama-3-8B LoRA step planned at 18.3 GiB was killed for
    memory on a 24 GiB machine in its profiled step, and ran its unprofiled ones; leave headroom,
    or profile a smaller model of the same shape. Empty: no profile."""


class HardwareConfig(Section):
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision. auto: bf16 only where the CPU has AMX or AVX512-BF16, else fp32."""

    threads: int | Literal["auto"] = "auto"
    """Compute threads per rank. auto: physical cores on this node ÷ ranks on this node."""

    pin_cores: bool = True
    """Pin each rank to its own disjoint set of cores (whole NUMA nodes where they divide evenly)."""

    allocator: Literal["auto", "tcmalloc", "jemalloc", "glibc-tuned", "system"] = "auto"
    """The malloc every rank runs on. auto: tcmalloc where installed (measured 1.00–1.17× glibc's
    tokens/s in fp32; jemalloc 0.92–1.00×); else, on single and ddp, glibc-tuned; else glibc as is.
    tcmalloc/jemalloc: that one, preloaded; glibc-tuned: glibc keeping what a step frees (no mmap,
    no trimming: tcmalloc's speed and memory without a system package); system: glibc as is."""

    @model_validator(mode="after")
    def _positive_threads(self):
        return _positive_or_auto(self, "hardware.threads")


class ParallelConfig(Section):
    strategy: Literal["auto", "single", "ddp", "fsdp", "zero3"] = "auto"
    """How ranks share the work. auto: single for one rank, ddp for several."""

    backend: Literal["auto", "gloo", "ccl"] = "auto"
    """Collective backend. auto: ccl where oneccl_bindings_for_pytorch imports, else gloo."""

    deepspeed_config: str | None = None
    """A DeepSpeed JSON file to use with strategy zero3; its "auto" values are filled from this config."""

    offload_optimizer: bool = False
    """zero3: keep optimizer state on the host and step it there (DeepSpeed's CPU Adam)."""

    offload_param: bool = False
    """zero3: keep parameters off the compute path until needed (DeepSpeed parameter offload)."""

    timeout_s: int = Field(600, gt=0)
    """Seconds a collective (all-reduce, barrier) may wait for the slowest rank before the run
    fails. Data preparation never waits in a collective, so it may take longer than this."""

    layout: Literal["auto", "full_shard", "node_reshard", "gather_once", "hybrid"] = "auto"
    """fsdp: how parameters are sharded and how often they cross the network. full_shard: over every
    rank, gathered for each micro-batch's forward and again for its backward. node_reshard: the
    same, but after the forward each block keeps the node's share, so the backward gathers within
    the node (2 or more nodes of 2 or more ranks). gather_once: gathered once per optimizer step
    and kept (and gradients reduced once) across its micro-batches: every block's parameters and
    the unsharded gradients held through the step. hybrid: sharded within a node, replicated
    across nodes (HSDP, 2 or more nodes), the gradients all-reduced across nodes once per step;
    each rank holds 1/(ranks per node) of the state. Every layout keeps the root (embeddings,
    final norm, head) gathered across a step's micro-batches. auto: the fastest by the time plan
    among the layouts whose memory plan fits each rank's share of the node (one node too:
    gather_once where it fits). Other strategies: leave it auto."""

    reduce_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """fsdp: the dtype gradients are reduced in. bf16 halves the reduce traffic (the weights and
    the optimizer stay fp32). auto: bf16 where several nodes communicate and the compute is bf16,
    else fp32 (the loss drift measured: docs/reference/auto.md). Other strategies: leave it auto
    (zero3 reduces in the parameters' dtype)."""

    reduce_scatter: Literal["auto", "native", "all_to_all"] = "auto"
    """fsdp and zero3: how gradients are reduce-scattered. gloo has no reduce-scatter of its own: it runs
    an all-reduce and keeps a slice (twice the bytes). all_to_all: each rank sends every other
    rank its slice once and sums what it receives. auto: all_to_all on gloo, native on ccl."""

    prefetch: bool = True
    """fsdp: gather the next block's parameters while this one computes (the forward's next block,
    the backward's previous one), on gloo's own thread: one more block's gathered parameters held,
    and part of each gather hidden where the network is slower than the compute (measured: block
    fsdp_prefetch of docs/benchmarks/network.md). false: each block gathered when it runs."""

    overlap_reduction: bool = True
    """fsdp, gather_once with the all-to-all reduce-scatter: each block's gradients are sent on
    gloo's own thread and summed later, while the next blocks' backward computes (two blocks' slices
    held meanwhile; measured: block fsdp_overlap of docs/benchmarks/network.md). false: each
    block's reduce-scatter waits whole, as FSDP2 runs it on CPU. Other layouts reduce as FSDP2 does."""


class LaunchConfig(Section):
    nproc_per_node: int = Field(1, gt=0)
    """Ranks started on this node by the torchrun agent."""

    nnodes: int = Field(1, gt=0)
    """Nodes taking part."""

    node_rank: int = Field(0, ge=0)
    """This node's index, 0 … nnodes-1 (static rendezvous)."""

    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous (node 0's address). Empty on one node: a free local port."""

    rdzv_timeout_s: int = Field(120, gt=0)
    """Seconds to wait for all nodes to join before failing."""

    stop_timeout_s: int = Field(600, gt=0)
    """After a SIGTERM, how long the agent lets its ranks finish their step and save a checkpoint
    before it kills them (torchrun's --shutdown-timeout; its own default, 30 s, is shorter than
    one step of an 8B model). The rendered pods' terminationGracePeriodSeconds must cover it."""

    max_restarts: int = Field(0, ge=0)
    """Times the agent restarts the whole group after a rank dies; each restart resumes from the newest checkpoint."""


class Config(Section):
    output_dir: str = "runs/default"
    """Run folder (a local path or an fsspec URL): config, metrics, checkpoints, exported model."""

    seed: int = Field(1337, ge=0, lt=2**63)
    """Seed for weights, data order and dropout (numpy's generator takes no negative seed)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @field_validator("output_dir")
    @classmethod
    def _output_dir_named(cls, value: str) -> str:
        # An empty path is the current directory: the run folder would be spread over it.
        if not value.strip():
            raise ValueError("output_dir is empty; name a run folder, e.g. output_dir=runs/my-run")
        return value

    @model_validator(mode="after")
    def _batch_fits(self):
        self._batch_in_pairs()
        error = batch_error(self.train)
        if error:
            raise ValueError(error)
        if self.train.max_steps is None and self.train.epochs is None:
            raise ValueError("set train.max_steps or train.epochs")
        return self

    def _batch_in_pairs(self) -> None:
        """train.global_batch_pairs is the batch in rows of one pair each: global_batch_size takes it."""
        train, pairs = self.train, self.train.global_batch_pairs
        if pairs is None:
            return
        if "global_batch_size" in train.model_fields_set and train.global_batch_size != pairs:
            raise ValueError(f"train.global_batch_pairs ({pairs}) and train.global_batch_size "
                             f"({train.global_batch_size}) both set the batch; set one of them (to unset one a "
                             "config file sets: train.global_batch_size=null on the command line)")
        if self.data.packing:
            raise ValueError("train.global_batch_pairs lays one pair in each row: set data.packing=false "
                             "(packing puts a varying number of pairs in a row), or set the batch in rows "
                             "with train.global_batch_size")
        if train.global_batch_size != pairs:
            train.global_batch_size = pairs

    @model_validator(mode="after")
    def _profile_step_reached(self):
        # With train.epochs the run's length is known once the data is: the trainer checks it then.
        profile, last = self.train.profile_step, self.train.max_steps
        if profile is not None and last is not None and profile > last:
            raise ValueError(f"train.profile_step ({profile}) is past train.max_steps ({last}): the run never "
                             f"reaches it; choose a step from 1 to {last}")
        return self

    @model_validator(mode="after")
    def _fsdp_keys_on_fsdp(self):
        """A sharding key set away from its default where no strategy of its reads it would do nothing
        and still be written to config.yaml as if it had: refused, naming the strategies it needs."""
        parallel = self.parallel
        which = "auto, which resolves to single or ddp" if parallel.strategy == "auto" else parallel.strategy
        # key: (its default, the strategies that read it)
        for key, (default, strategies) in {"layout": ("auto", ("fsdp",)), "reduce_dtype": ("auto", ("fsdp",)),
                                           "reduce_scatter": ("auto", ("fsdp", "zero3")),
                                           "prefetch": (True, ("fsdp",)), "overlap_reduction": (True, ("fsdp",))}.items():
            value = getattr(parallel, key)
            if value != default and parallel.strategy not in strategies:
                def shown(v):  # as it is written on the command line
                    return str(v).lower() if isinstance(v, bool) else v
                needs = " or ".join(f"parallel.strategy={s}" for s in strategies)
                raise ValueError(f"parallel.{key}={shown(value)} needs {needs} (here {which}); set "
                                 f"parallel.strategy={strategies[0]} or leave parallel.{key}={shown(default)}")
        return self

    @model_validator(mode="after")
    def _selective_fits(self):
        # DeepSpeed gathers and releases each linear's weight in hooks inside the block, and its
        # collectives would pass through the selective policy's dispatch mode: untested, refused.
        if uses_selective(self.model.activation_checkpointing) and self.parallel.strategy == "zero3":
            raise ValueError(f"model.activation_checkpointing={self.model.activation_checkpointing} does not take "
                             "parallel.strategy=zero3; use "
                             "true, a number of blocks, or strategy fsdp (which shards the same way)")
        return self

    @model_validator(mode="after")
    def _lora_fits(self):
        if not self.model.lora.enabled:
            return self
        if self.model.name_or_path is None:
            raise ValueError("model.lora needs pretrained weights to adapt: set model.name_or_path to a model folder "
                             "(or set model.lora.enabled=false to train a model from scratch)")
        if self.parallel.strategy == "zero3":
            raise ValueError("parallel.strategy=zero3 does not take model.lora: the frozen bf16 base of an 8B model "
                             "fits one node (cputrain plan); use single, ddp or fsdp")
        return self

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
