"""A finished model for inference: finding it in a run folder or model folder, loading it (a LoRA
adapter folder on its base), and sampling text from it."""

from __future__ import annotations

from pathlib import Path

import torch

from cputrain.errors import ModelError


def _is_model(folder: Path) -> bool:
    """A Hugging Face model folder, or a LoRA adapter folder (which names its base)."""
    from cputrain.lora.adapter_folder import is_adapter_folder

    return (folder / "config.json").is_file() or is_adapter_folder(folder)


def model_folder(path: str) -> str:
    """A run folder means its exported model/; a model folder is used as it is."""
    p = Path(path)
    if _is_model(p / "model"):
        return str(p / "model")
    if _is_model(p):
        return str(p)
    if (p / "checkpoints").is_dir():
        raise ModelError(f"run '{path}' has no exported model yet (it exports model/ when training ends)")
    raise ModelError(f"'{path}' is neither a run folder nor a model folder (no config.json)")


def load_for_inference(path: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    from cputrain.data.tokenizer import load_tokenizer

    from cputrain.lora.adapter_folder import is_adapter_folder, load_adapted

    folder = model_folder(path)
    tokenizer = load_tokenizer(folder, trust_remote_code)
    if is_adapter_folder(Path(folder)):  # adapters on their base, unmerged
        return load_adapted(Path(folder), trust_remote_code=trust_remote_code).eval(), tokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"could not load the model in '{folder}': {first}") from None
    return model.eval(), tokenizer


@torch.no_grad()
def generate_text(path: str, prompt: str, max_new_tokens: int = 80, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0, chat: bool = False, prompt_ids: list[int] | None = None) -> str:
    """The prompt and what the model writes after it. `chat`: the prompt is a user's message,
    rendered with the model's chat template and a generation prompt; the reply ends at the end of
    the turn and is returned alone. `prompt_ids`: token ids to continue instead of `prompt`."""
    from cputrain.data.chat_template import end_of_turn_ids, render, template_variables

    model, tokenizer = load_for_inference(path)
    # Sampling from NaN logits fails deep inside torch.multinomial; say what is wrong instead.
    damaged = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if damaged:
        raise ModelError(f"the model in '{model_folder(path)}' has non-finite weights (NaN or inf) in {len(damaged)} "
                         f"tensor(s), e.g. {damaged[0]}: it diverged in training; retrain with a lower train.lr")
    torch.manual_seed(seed)
    stop = end_of_turn_ids(tokenizer)  # EOS, and the end of a chat turn where the tokenizer has one
    if chat:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ModelError(f"the model in '{model_folder(path)}' has no chat template; train it on chat data "
                             "(data.format=chat) or generate without --chat")
        prompt = render(template, [{"role": "user", "content": prompt}], template_variables(tokenizer),
                        add_generation_prompt=True)
    if prompt_ids is not None:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
    else:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.eos_token_id]])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature or None,
        top_k=top_k, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, eos_token_id=stop,
    )
    if chat:
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return tokenizer.decode(out[0], skip_special_tokens=True)
