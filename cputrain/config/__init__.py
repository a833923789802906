"""The config: its typed sections (sections), a YAML file with key=value overrides (file), the
machine's "auto"s turned into values with reasons (resolve), the read-only config after every
"auto" is decided (resolved), a model folder's config.json
checked (model_file), and the configuration reference page rendered from the fields' docs
(reference). The sections' names are handed on here, as `from cputrain.config import Config`."""

from cputrain.config.sections import (DEFAULT_ARCH, LLAMA_PROJECTIONS, Config, DataConfig,  # noqa: F401
                                      HardwareConfig, LaunchConfig, LoraConfig, ModelConfig, ParallelConfig,
                                      TrainConfig, batch_error, checkpointed_blocks,
                                      checkpointing_split, uses_selective)
