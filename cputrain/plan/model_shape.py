"""Every parameter of a model, counted on the meta device: a config is enough, no weights.

The estimator needs shapes, not only a total, because sharding works per tensor: FSDP2 splits
each parameter along dim 0 and DeepSpeed pads each flattened parameter, so two models with the
same total can hold different bytes per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cputrain.config import ModelConfig
from cputrain.errors import ModelError, one_line


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    unit: str  # the FSDP unit it belongs to: "layers.N" for a decoder block, "root" otherwise

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

    def unit_params(self) -> dict[str, int]:
        """Elements per FSDP unit (each decoder block, and the root with embeddings, norm, head)."""
        units: dict[str, int] = {}
        for p in self.params:
            units[p.unit] = units.get(p.unit, 0) + p.numel
        return units


def _unit_of(name: str) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return f"layers.{parts[i + 1]}"
    return "root"


def shape_of(model) -> ModelShape:
    """Read the shapes of a built (meta) model and the sizes its config declares."""
    params, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        params.append(ParamInfo(name, tuple(p.shape), _unit_of(name)))
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


def hf_config_for(model_cfg: ModelConfig, vocab_size: int | None = None, config_json: str | None = None):
    """The transformers config a plan is made for.

    `config_json` (a config.json file or a folder holding one) wins; then model.name_or_path;
    then model.arch with `vocab_size` (the tokenizer's size, or model.tokenizer_vocab_size).
    """
    from cputrain import model as models

    if config_json:
        path = Path(config_json)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"--model-config '{config_json}' is not a config.json file or a folder holding one")
        from transformers import CONFIG_MAPPING

        from cputrain.model_config_file import read_config_json

        fields = dict(read_config_json(path))
        model_type = fields.pop("model_type")
        try:
            return CONFIG_MAPPING[model_type](**fields)
        except Exception as exc:
            raise ModelError(f"'{path}' does not make a valid {model_type} config: {one_line(exc)}") from None
    return models.resolve_source(model_cfg, vocab_size or model_cfg.tokenizer_vocab_size).hf_config


def model_shape(model_cfg: ModelConfig, vocab_size: int | None = None, config_json: str | None = None) -> ModelShape:
    from cputrain import model as models

    hf_config = hf_config_for(model_cfg, vocab_size, config_json)
    skeleton = models.build_skeleton(models.ModelSource(None, hf_config), model_cfg)  # meta: no memory
    return shape_of(skeleton)
