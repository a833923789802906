"""Records in, the rows the trainer batches from out: sources → tokenizer → token cache → rows →
each rank's share per step.

Every kind of data is a package of the same files:

    text/        documents joined with EOS and cut into rows of data.seq_len (pretraining)
    examples/    chat, prompt/completion and Alpaca records, their answers trained (SFT)
    preference/  a prompt with a chosen and a rejected answer (DPO, SimPO, reward models)
    feedback/    a prompt and one answer with a thumbs-up or down (KTO), each with its KL sequence

        kind.py      the kind object (the DataKind protocol, kind.py): the record fields, the
                     tokenizing worker, the stream files and counters, stats.json, its part of
                     the cache key, how a complete entry opens
        tokenize.py  records → token ids (and trained masks) for the cache: what a worker runs
        rows.py      the entry opened as rows (the Rows protocol, rows.py) and their micro-batches

Beneath them: sequences.py (what the kinds made of sequences with a trained mask share: the
answer-token rule, chat rendering, the id/mask/length streams, SequenceKind, the rows' base),
cache_key.py (every kind's cache key), worker_corpus.py (the corpus as a worker reads it),
batch.py (a micro-batch), cache_builder.py (one path for every kind) and prepare.py (the front
door: picks the kind, has its entry built once, opens it).

A new kind is a package beside these and one line in prepare.kind_of for its data.format (a
value the config's data.format must also admit; sources.format_choice, if auto is to find it), as
feedback/ was added:

- tokenize.py: its spec (a frozen dataclass whose key() names everything that changes its tokens,
  with its own "format", so its keys never meet another kind's), its COUNTERS, and
  tokenize_rows(start, stop, held_out) made of the sequences module's pieces (init_worker's
  state, string_sequence, chat_sequence, messages, record_sequences, ChunkSequences); what a
  sequence carries beyond ids and mask (a label) is one more array in the chunk's parts;
- kind.py: a SequenceKind with its what, worker_module (whose COUNTERS are its counters), spec
  and tokenizer, fields, stats and open; its streams() those of every sequence kind plus that
  one; a kind of TRL's records (pairs, feedback) is a RecordsKind, which gives its spec (spec_of)
  the template for records and warns of what it left out;
- rows.py: a SequenceRows that sets its bounds and cuts its batches (reading that stream beside
  the others), and a SequenceData that describes the entry, opened with sequences.open_rows.

The cache builder takes it as it is: it asks a kind for its fields, streams, worker, counters,
stats and key, and never which kind it is.
"""
