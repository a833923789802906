"""The model: a Hugging Face causal LM, built as a skeleton first and filled from safetensors.

Loading a pretrained model goes skeleton-on-meta → (strategy shards it) → materialize → copy
tensors from the safetensors files. Three jobs, a module each: which model and its config
(source), the structure and what is done to it (skeleton), filling it (weights). Beside them:
what a run does to the model beyond building and loading it (converter: the protocol, whose
identity is full fine-tuning), a reward model's score head (score_head), which keywords its forward
takes (forward_keywords), the finished model written as a plain Hugging Face folder (export), and
what such a folder says about the model it holds: its class, the dtype of its weights, where a
generation ends (folder_description).
"""

from cputrain.model.skeleton import (  # noqa: F401
                                     build_skeleton,
                                     compile_blocks,
                                     decoder_blocks,
                                     enable_activation_checkpointing,
                                     parameter_counts,
)
from cputrain.model.score_head import fit_head  # noqa: F401
from cputrain.model.source import (  # noqa: F401
                                     ModelSource,
                                     check_vocab,
                                     config_from_arch,
                                     folder_config,
                                     local_folder,
                                     resolve_source,
)
from cputrain.model.weights import (  # noqa: F401
                                     SafetensorsReader,
                                     checkpoint_name,
                                     copy_full_into,
                                     load_into,
                                     matching_keys,
                                     materialize,
                                     random_init,
                                     safetensors_files,
                                     safetensors_header,
)
