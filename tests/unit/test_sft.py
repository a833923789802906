"""Chat and prompt/completion examples: which tokens are trained, the template's prefix rule, packing
without cross-talk (checked on a real model), and the bad records, each one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cputrain.data import chat_template, sequences
from cputrain.data.batch import IGNORE_INDEX
from cputrain.data.examples import tokenize as tokenize_examples
from cputrain.data.examples.rows import ExampleRows
from cputrain.data.examples.tokenize import ExampleSpec
from cputrain.data.sequences import pack_bounds
from cputrain.errors import DataError


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


CHAT = [
    {"role": "system", "content": "You answer about Python."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence of items."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "An immutable one."},
]


def _spec(tok, fmt="chat", train_on="assistant", template=None, seq_len=256, truncation="drop"):
    template = template or (chat_template.template_of(tok, None) if fmt == "chat" else None)
    return ExampleSpec(fmt, "messages", "prompt", "completion", train_on, template,
                       chat_template.template_variables(tok) if template else {}, seq_len, truncation)


class _Records:
    """What a worker reads of a datasets.Dataset (rows sliced into columns), for records whose
    fields change type from one to the next, as a JSON file's may (Arrow would refuse the list)."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __getitem__(self, rows: slice) -> dict:
        names = dict.fromkeys(name for record in self.records for name in record)
        return {name: [record.get(name) for record in self.records[rows]] for name in names}


def _tokenize(tok, spec, records, held_out=None):
    sequences.init_worker(None, _Records(records), spec, tok.backend_tokenizer.to_str(), tok.eos_token_id, "uint16")
    return tokenize_examples.tokenize_rows(0, len(records), np.zeros(len(records), bool) if held_out is None else held_out)


def _examples(chunk, split="train"):
    ids, mask, lengths = chunk.parts[f"{split}.bin"], chunk.parts[f"{split}.mask.bin"], chunk.parts[f"{split}.lengths.bin"]
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(bounds, bounds[1:])]


def _trained_runs(ids, mask) -> list[list[int]]:
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_chat_trains_each_answer_and_the_token_that_ends_it(tok):
    chunk = _tokenize(tok, _spec(tok), [{"messages": CHAT}])
    [(ids, mask)] = _examples(chunk)
    assert tok.decode(ids) == chat_template.render(chat_template.BUILTIN_TEMPLATE, CHAT, {})
    runs = [tok.decode(r) for r in _trained_runs(ids, mask)]
    # each assistant turn, with <|im_end|> (the model must learn to stop) and the newline after it
    assert runs == ["A mutable sequence of items.<|im_end|>\n", "An immutable one.<|im_end|>\n"]
    assert chunk.counts["trained_tokens"] == sum(mask) and mask[0] == 0


def test_train_on_all_trains_every_token_but_the_first(tok):
    [(ids, mask)] = _examples(_tokenize(tok, _spec(tok, train_on="all"), [{"messages": CHAT}]))
    assert mask[0] == 0 and all(mask[1:])


def test_prompt_completion_trains_the_completion_and_eos(tok):
    # The text is tokenized whole: the prompt's trailing space joins the answer's first word, as
    # the model reads it in any text (and as TRL does); training starts where the prompt's own
    # tokens part from the whole's.
    record = {"prompt": "Name a mutable sequence: ", "completion": "list"}
    [(ids, mask)] = _examples(_tokenize(tok, _spec(tok, fmt="prompt_completion", train_on="completion"), [record]))
    assert ids[-1] == tok.eos_token_id
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == "Name a mutable sequence:"
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == " list" + tok.eos_token


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    # renders the number of messages first: the start of the text changes once more turns follow
    template = "{{ messages|length }}" + chat_template.BUILTIN_TEMPLATE
    with pytest.raises(DataError, match="renders the start of a conversation differently"):
        _tokenize(tok, _spec(tok, template=template), [{"messages": CHAT}])


@pytest.mark.parametrize("messages, message", [
    ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}], "an assistant turn is empty"),
    ([{"role": "user"}], "needs a 'role' and a 'content'"),
    ([{"role": "user", "content": 3}], "needs a 'role' and a 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}],
     "a tool call needs a function with a name"),
    ([], "must be a non-empty list"),
])
def test_bad_chat_records_are_one_line(tok, messages, message):
    with pytest.raises(DataError, match=message) as err:
        _tokenize(tok, _spec(tok), [{"messages": CHAT}, {"messages": messages}])
    assert str(err.value).startswith("record 2:") and "\n" not in str(err.value)


def test_no_assistant_turn_is_skipped_and_counted_long_ones_dropped_or_truncated(tok):
    records = [{"messages": CHAT[:2]}, {"messages": CHAT}, {"messages": CHAT[:3]}]
    full = len(_examples(_tokenize(tok, _spec(tok), [{"messages": CHAT}]))[0][0])
    chunk = _tokenize(tok, _spec(tok, seq_len=full - 1), records)
    assert chunk.counts["no_answer"] == 1 and chunk.counts["dropped_long"] == 1 and chunk.counts["train_examples"] == 1
    cut = _tokenize(tok, _spec(tok, seq_len=full - 1, truncation="truncate"), records)
    assert cut.counts["truncated"] == 1 and max(cut.parts["train.lengths.bin"]) == full - 1


def test_content_parts_are_joined_and_a_non_text_part_skips_the_conversation(tok):
    """OpenAI's form: content as a list of parts. Text parts are joined with newlines (as vLLM does);
    a conversation with an image or audio part is left out and counted, not fatal for the corpus."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is a list?"}, {"type": "text", "text": "Briefly."}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A mutable sequence."}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                          {"type": "text", "text": "What is this?"}]},
             {"role": "assistant", "content": "A cat."}]
    chunk = _tokenize(tok, _spec(tok), [{"messages": parts}, {"messages": image}, {"messages": CHAT}])
    assert chunk.counts["non_text_parts"] == 1 and chunk.counts["train_examples"] == 2
    (ids, mask), _ = _examples(chunk)
    as_text = [{"role": "user", "content": "What is a list?\nBriefly."}, {"role": "assistant", "content": "A mutable sequence."}]
    assert tok.decode(ids) == chat_template.render(chat_template.BUILTIN_TEMPLATE, as_text, {})
    assert [tok.decode(r) for r in _trained_runs(ids, mask)] == ["A mutable sequence.<|im_end|>\n"]


TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "22 C, sunny"},
    {"role": "assistant", "content": "It is 22 C and sunny."},
]


def test_tool_calls_are_trained_and_tool_results_are_not(tok):
    chunk = _tokenize(tok, _spec(tok), [{"messages": TOOLS}])
    [(ids, mask)] = _examples(chunk)
    text = tok.decode(ids)
    # OpenAI's arguments string is read as JSON, so the template writes an object, not a quoted string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    runs = [tok.decode(r) for r in _trained_runs(ids, mask)]
    assert runs == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                    "It is 22 C and sunny.<|im_end|>\n"]
    assert "22 C, sunny" in text and not any("22 C, sunny" in r for r in runs)


def test_what_prepare_prints_names_the_conversations_left_out():
    from cputrain.data.examples.rows import ExampleData

    stats = {"format": "chat", "train_examples": 9, "val_examples": 1, "train_tokens": 900, "trained_token_share": 0.5,
             "packing": False, "skipped_no_answer": 0, "dropped_long": 0, "truncated": 0,
             "skipped_non_text_parts": 2, "skipped_tools_unsupported": 0}
    line = ExampleData(None, None, stats).describe()
    assert "skipped 0 without an answer, 2 with a part that is not text, dropped 0" in line
    assert "tool calls" not in line  # none of those


def test_tool_calls_under_a_template_that_cannot_write_them_are_skipped_and_counted(tok):
    assert not chat_template.renders_tools(chat_template.MARKED_CHATML)  # reads only role and content
    chunk = _tokenize(tok, _spec(tok, template=chat_template.MARKED_CHATML), [{"messages": TOOLS}, {"messages": CHAT}])
    assert chunk.counts["tools_unsupported"] == 1 and chunk.counts["train_examples"] == 1


def test_alpaca_records_use_stanford_alpacas_prompt_and_train_the_output(tok):
    records = [{"instruction": "Name a mutable sequence.", "input": "", "output": "A list."},
               {"instruction": "Translate.", "input": "bonjour", "output": "hello"}]
    spec = ExampleSpec("alpaca", "messages", "prompt", "completion", "completion", None, {}, 256, "drop")
    (plain_ids, plain_mask), (with_input_ids, with_input_mask) = _examples(_tokenize(tok, spec, records))
    untrained = tok.decode([i for i, m in zip(plain_ids, plain_mask) if not m])
    assert untrained == tokenize_examples.ALPACA_PROMPT_NO_INPUT.format(instruction="Name a mutable sequence.")
    assert "### Input:\nbonjour\n\n### Response:" in tok.decode(with_input_ids)
    trained = tok.decode([i for i, m in zip(with_input_ids, with_input_mask) if m], skip_special_tokens=False)
    assert trained.strip() == "hello" + tok.eos_token


def test_pack_bounds_is_next_fit_and_never_splits():
    assert pack_bounds(np.array([3, 4, 2, 5, 1]), 8).tolist() == [0, 2, 5]  # [3+4] [2+5+1]
    assert pack_bounds(np.array([3, 4, 2, 5, 2]), 8).tolist() == [0, 2, 4, 5]  # [3+4] [2+5] [2]
    assert pack_bounds(np.array([8, 8]), 8).tolist() == [0, 1, 2]
    assert pack_bounds(np.array([], dtype=np.int64), 8).tolist() == [0]


def _rows(lengths, packing, seq_len=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 100, int(sum(lengths))).astype(np.uint16)
    mask = rng.integers(0, 2, int(sum(lengths))).astype(np.uint8)
    return ExampleRows(ids, mask, np.array(lengths, dtype=np.uint32), seq_len, packing, pad_id=0)


def test_packed_rows_restart_positions_and_pad_with_no_target():
    rows = _rows([5, 4, 7, 2], packing=True)
    assert len(rows) == 2  # [5+4] [7+2]
    b = rows.batch([0, 1])
    assert b.input_ids.shape == (2, 12)
    assert b.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert (b.labels[:, 9:] == IGNORE_INDEX).all() and (b.input_ids[:, 9:] == 0).all()
    unpacked = _rows([5, 4, 7, 2], packing=False).batch([0, 1])
    assert unpacked.input_ids.shape == (2, 5) and unpacked.position_ids is None
    assert b.trained_targets + 0 == int((b.labels[:, 1:] != IGNORE_INDEX).sum())


def test_packed_and_unpacked_give_the_same_loss_on_a_real_model(tiny_model_dir):
    """No token attends to another example: the per-target loss is the same packed or padded. With
    transformers' KV cache on, its block-diagonal mask from position ids is silently skipped and
    this fails (the second example of a row sees the first)."""
    from transformers import AutoModelForCausalLM

    from cputrain.objectives.validation_loss import summed_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    lengths = [9, 14, 5, 20, 11, 7, 16]
    packed, unpacked = _rows(lengths, True, seq_len=32, seed=3), _rows(lengths, False, seq_len=32, seed=3)
    assert len(packed) < len(unpacked)
    a = summed_loss(model, packed, np.arange(len(packed)), 2)
    b = summed_loss(model, unpacked, np.arange(len(unpacked)), 3)
    assert a[1] == b[1] > 0
    assert abs(a[0] / a[1] - b[0] / b[1]) < 1e-4


@pytest.mark.parametrize("chunked", [False, True])
def test_a_batch_without_trained_tokens_has_loss_zero_not_nan(tiny_model_dir, chunked):
    from transformers import AutoModelForCausalLM

    from cputrain.data.batch import Batch
    from cputrain.kernels.chunked_head import install_chunked_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if chunked:
        install_chunked_loss(model)
    ids = torch.randint(5, 100, (2, 16))
    batch = Batch(ids, torch.full_like(ids, IGNORE_INDEX))
    loss = model(**batch.model_inputs(), num_items_in_batch=1.0).loss  # the trainer's divisor is never 0
    loss.backward()
    assert batch.trained_targets == 0 and float(loss) == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
