"""Every parameter of a model, counted on the meta device: a config is enough, no weights.

The estimator needs shapes, not only a total, because sharding works per tensor: FSDP2 splits
each parameter along dim 0 and DeepSpeed pads each flattened parameter, so two models with the
same total can hold different bytes per rank.

It also needs to know which parameters are trained. With model.lora the skeleton gets peft's
adapters (cputrain.lora.adapters.add_adapters, the function the trainer calls, so the targets
and shapes are the run's own): each targeted linear keeps its weight frozen as
`<name>.base_layer.weight`, stored in model.lora.base_dtype, and gains `lora_A` (r × in) and
`lora_B` (out × r), trained in fp32. A frozen parameter costs its stored bytes and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from cputrain.config import ModelConfig
from cputrain.errors import ModelError, one_line
from cputrain.lora.adapters import base_file_name, is_adapter_parameter
from cputrain.model.score_head import LM_HEAD, SCORE

# Shapes of models on the Hugging Face hub that `cputrain plan` knows without fetching anything
# (model.name_or_path as a hub id, no local folder): the fields of their config.json that decide
# a parameter's shape. Meta-Llama-3-8B and its siblings share one shape.
_LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
}
KNOWN_HUB_CONFIGS = {
    name: _LLAMA3_8B
    for name in ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Llama-3.1-8B",
                 "meta-llama/Llama-3.1-8B-Instruct")
}


def known_hub_config(name_or_path: str | None) -> dict | None:
    """The built-in config fields for a hub id cputrain plans without the hub, unless a local
    folder of that name exists (then it is read, as the trainer would)."""
    if name_or_path is None or name_or_path not in KNOWN_HUB_CONFIGS or Path(name_or_path).expanduser().exists():
        return None
    return KNOWN_HUB_CONFIGS[name_or_path]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    unit: str  # the FSDP unit it belongs to: "layers.N" for a decoder block, "root" otherwise
    trainable: bool = True  # False: frozen (LoRA's base), no gradient, no optimizer state
    stored_bytes: int = 4  # bytes per element as the model stores it (fp32 masters; a frozen base in bf16: 2)
    file_bytes: int = 0  # bytes per element in the model folder's safetensors files (0: not read from a file)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelShape:
    params: tuple[ParamInfo, ...]  # unique parameters (a tied lm_head is counted once)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def frozen_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def lora(self) -> bool:
        return any(is_adapter_parameter(p.name) for p in self.params)

    @property
    def config_sizes(self) -> dict[str, int]:
        """Its sizes under a transformers config's names (what the rollout sizers read)."""
        return {"num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "vocab_size": self.vocab}

    def adapter_inputs(self) -> list[ParamInfo]:
        """Each adapted linear's lora_A (r × in): one per targeted layer, in model order."""
        return [p for p in self.params if ".lora_A." in p.name]

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the hidden states between blocks: the input embedding's dtype
        (fp32 masters: fp32 under autocast too; a frozen bf16 embedding makes a bf16 stream)."""
        embed = [p for p in self.params if p.unit == "root" and "embed" in p.name]
        return embed[0].stored_bytes if embed else 4

    def unit_params(self, trainable_only: bool = False) -> dict[str, int]:
        """Elements per FSDP unit (each decoder block, and the root with embeddings, norm, head)."""
        units: dict[str, int] = {}
        for p in self.params:
            if p.trainable or not trainable_only:
                units[p.unit] = units.get(p.unit, 0) + p.numel
        return units


def _unit_of(name: str) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return f"layers.{parts[i + 1]}"
    return "root"


def shape_of(model) -> ModelShape:
    """Read the shapes of a built (meta) model and the sizes its config declares; which
    parameters are trained and how each is stored come from the parameters themselves."""
    params, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        params.append(ParamInfo(name, tuple(p.shape), _unit_of(name), trainable=p.requires_grad,
                                stored_bytes=p.element_size()))
    c = model.config
    heads = getattr(c, "num_attention_heads", 1)
    return ModelShape(
        params=tuple(params),
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        intermediate=getattr(c, "intermediate_size", 4 * c.hidden_size),
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        vocab=c.vocab_size,
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
    )


# safetensors header dtypes → bytes per element
_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class _Keys:
    """What cputrain.model.checkpoint_name looks keys up in (a SafetensorsReader's `where`)."""

    def __init__(self, keys):
        self.where = keys


def model_folder(name_or_path: str) -> Path | None:
    """model.name_or_path's folder where it is on this machine (a folder, or a hub id already in
    the Hugging Face cache); None otherwise. Nothing is fetched."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path.count("/") != 1 or name_or_path.startswith((".", "/", "~")):
        return None
    try:  # a hub id already in the Hugging Face cache; nothing is fetched
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:
        return None


def weight_file_bytes(model_cfg: ModelConfig) -> dict[str, int] | None:
    """Bytes per element of every tensor in model.name_or_path's safetensors files, by key (from
    their headers: no weight is read); None when there is no model folder to read. A hub id of
    KNOWN_HUB_CONFIGS not on this machine is planned as its published files are: bf16."""
    if model_cfg.name_or_path is None:
        return None
    folder = model_folder(model_cfg.name_or_path)
    files = sorted(folder.glob("*.safetensors")) if folder is not None else []
    if not files:
        return {"*": 2} if known_hub_config(model_cfg.name_or_path) is not None else None
    from cputrain.model import safetensors_header

    out = {}
    for path in files:
        try:
            header = safetensors_header(path)
        except (OSError, ValueError):
            return None  # the trainer names a broken file; the plan leaves the files out
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict):
                out[key] = _SAFETENSORS_BYTES.get(entry.get("dtype"), 4)
    return out


def with_weight_files(shape: ModelShape, model_cfg: ModelConfig) -> ModelShape:
    """`shape` with each parameter's element size in the weight files it is loaded from (LoRA's
    adapters and tied copies are in no file)."""
    files = weight_file_bytes(model_cfg)
    if files is None:
        return shape
    from cputrain.model import checkpoint_name

    keys = _Keys(files)
    params = []
    for p in shape.params:
        in_files = base_file_name(p.name)
        if in_files is None:
            size = 0
        elif "*" in files:
            size = files["*"]
        else:
            key = checkpoint_name(in_files, keys)
            size = files[key] if key is not None else 0
        params.append(replace(p, file_bytes=size))
    return replace(shape, params=tuple(params))


def hf_config_for(model_cfg: ModelConfig, vocab_size: int | None = None, config_json: str | None = None):
    """The transformers config a plan is made for.

    `config_json` (a config.json file or a folder holding one) wins; then model.name_or_path
    (a hub id of KNOWN_HUB_CONFIGS from the built-in fields, nothing fetched); then model.arch
    with `vocab_size` (the tokenizer's size, or model.tokenizer_vocab_size).
    """
    from cputrain import model as models

    if config_json:
        path = Path(config_json)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"--model-config '{config_json}' is not a config.json file or a folder holding one")
        from transformers import CONFIG_MAPPING

        from cputrain.config.model_file import read_config_json

        fields = dict(read_config_json(path))
        model_type = fields.pop("model_type")
        try:
            return CONFIG_MAPPING[model_type](**fields)
        except Exception as exc:
            raise ModelError(f"'{path}' does not make a valid {model_type} config: {one_line(exc)}") from None
    known = known_hub_config(model_cfg.name_or_path)
    if known is not None:
        from transformers import CONFIG_MAPPING

        fields = dict(known)
        return CONFIG_MAPPING[fields.pop("model_type")](**fields)
    return models.resolve_source(model_cfg, vocab_size or model_cfg.tokenizer_vocab_size).hf_config


def model_shape(model_cfg: ModelConfig, vocab_size: int | None = None, config_json: str | None = None,
                compute_dtype=None, seed: int = 0, head: str = LM_HEAD) -> ModelShape:
    """Every parameter of the model the config trains. With model.lora enabled the adapters are
    added as the trainer adds them, on the targets and with the base dtype decided for the run
    (cputrain.training.choices), under `compute_dtype` (default fp32)."""
    import torch

    from cputrain import model as models

    if model_cfg.lora.enabled and "auto" in (model_cfg.lora.target_modules, model_cfg.lora.base_dtype):
        raise ValueError("model.lora.target_modules and model.lora.base_dtype are read decided "
                         "(cputrain.training.choices.decide_for_plan decides them for a plan)")
    hf_config = hf_config_for(model_cfg, vocab_size, config_json)
    if head == SCORE:  # a reward model's score head in place of the vocabulary's (model.score_head)
        models.fit_head(hf_config, head, 0)
    skeleton = models.build_skeleton(models.ModelSource(None, hf_config), model_cfg)  # meta: no memory
    if model_cfg.lora.enabled:
        from cputrain.lora.adapters import add_adapters
        from cputrain.lora.base_storage import BASE_DTYPES

        add_adapters(skeleton, model_cfg.lora, frozen_dtype=BASE_DTYPES[model_cfg.lora.base_dtype], seed=seed,
                     compute_dtype=compute_dtype or torch.float32)
    return shape_of(skeleton)
