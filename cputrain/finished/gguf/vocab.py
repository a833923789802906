"""The tokenizer and the chat template as GGUF metadata (llama.cpp's "gpt2" tokenizer model: a
byte-level BPE, the kind cputrain trains and Llama 3 ships).

From the gguf package: the merges, the special token ids, whether BOS/EOS are added and the chat
template (SpecialVocab reads them from the folder's tokenizer files). Written here:

- token types. A special token (EOS, ChatML's <|im_start|>/<|im_end|>) must be CONTROL, or
  llama.cpp splits it into pieces when it meets it in a prompt and prints it in a reply. The
  library's BpeVocab calls a token special only when it sits outside the BPE vocabulary, and
  cputrain's trainer puts its special tokens inside it (ids 0-3).
- the pre-tokenizer's name (tokenizer.ggml.pre), which picks llama.cpp's splitting regex.
  llama.cpp's converter recognises a tokenizer by hashing the ids of a probe text against the
  tokenizers it knows, so a tokenizer trained here is never among them. The name is chosen from
  what tokenizer.json says the pre-tokenizer is: a plain ByteLevel with its regex (cputrain's:
  tokenizers' ByteLevel(add_prefix_space=False)) splits with GPT-2's regex, which is llama.cpp's
  "gpt-2"; Llama 3's Split regex followed by a ByteLevel without one is its "llama-bpe".
- the end-of-turn token (tokenizer.ggml.eot_token_id), where the chat template uses one.
"""

from __future__ import annotations

import json
from pathlib import Path

from cputrain.errors import ModelError

# Llama 3's split regex, as its tokenizer.json writes it (llama.cpp's LLAMA3 pre-tokenizer).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer_name(tokenizer_json: dict, folder) -> str:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space", False):
        return "gpt-2"
    if (kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") == LLAMA3_SPLIT
            and not steps[1].get("use_regex", True)):
        return "llama-bpe"
    raise ModelError(f"the tokenizer in '{folder}' splits text with a pre-tokenizer llama.cpp is not told of here "
                     f"({' + '.join(map(str, kinds)) or 'none'}; GPT-2's ByteLevel and Llama 3's are); "
                     "convert it with llama.cpp's convert_hf_to_gguf.py")


def added_specials(tokenizer) -> tuple[bool, bool]:
    """Whether the tokenizer puts BOS before and EOS after a text of its own accord, as it does:
    llama.cpp then does the same (tokenizer.ggml.add_bos_token / add_eos_token)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    bos = len(full) > len(plain) and full[0] == tokenizer.bos_token_id
    eos = len(full) > len(plain) and full[-1] == tokenizer.eos_token_id
    return bos, eos


def add_tokenizer(writer, folder: Path, n_vocab: int) -> None:
    """tokenizer.ggml.*: model, pre, tokens, token types, merges, special ids; the chat template."""
    import gguf

    from cputrain.model.folder_description import generation_end_ids
    from cputrain.data.tokenizer import load_tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"'{folder}' has no tokenizer.json; --gguf exports byte-level BPE tokenizers (GPT-2 style, "
                         "Llama 3) from their tokenizer.json")
    tokenizer_json = json.loads(path.read_text())
    model, decoder = tokenizer_json.get("model") or {}, tokenizer_json.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise ModelError(f"the tokenizer in '{folder}' is not a byte-level BPE ({model.get('type')}, decoder "
                         f"{decoder.get('type')}); --gguf exports GPT-2 style and Llama 3 tokenizers only")
    pre = pre_tokenizer_name(tokenizer_json, folder)
    tokenizer = load_tokenizer(str(folder))
    vocab = tokenizer.get_vocab()
    if len(vocab) > n_vocab:
        raise ModelError(f"the tokenizer in '{folder}' has {len(vocab)} tokens, more than the model's {n_vocab} "
                         "embedding rows")
    by_id = {i: token for token, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:  # embedding rows beyond the tokenizer (a vocabulary padded to a round size)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ModelError(f"the tokenizer in '{folder}' has no BPE merges in tokenizer.json")
    # What the tokenizer does, not what its config says (cputrain's says nothing about BOS).
    add_bos, add_eos = added_specials(tokenizer)
    special.add_special_token.update(bos=add_bos, eos=add_eos)
    template = getattr(tokenizer, "chat_template", None)
    special.chat_template = template if isinstance(template, str) and template else None
    # The end of a chat turn (ChatML's <|im_end|>, Llama 3's <|eot_id|>) named, not left to llama.cpp's
    # guess by token text: generation stops there, as `cputrain generate --chat` stops.
    ends = [i for i in generation_end_ids(tokenizer) if i != tokenizer.eos_token_id and by_id.get(i, "") in (template or "")]
    if ends:
        special.special_token_ids["eot"] = ends[0]
    special.add_to_gguf(writer, quiet=True)
