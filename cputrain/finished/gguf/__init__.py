"""`cputrain export RUN --gguf TYPE`: a Llama as one GGUF file, the format llama.cpp and Ollama read.

    types.py   the output types (f32, f16, bf16, q8_0) and each tensor's conversion to one
    llama.py   a Llama's hyperparameters and tensors as llama.cpp's `llama` architecture reads them
    vocab.py   the tokenizer (byte-level BPE) and the chat template as GGUF metadata
    write.py   the source (a run, a LoRA run merged in memory, a Hugging Face folder) to the file

The `gguf` package (llama.cpp's own Python library) writes the file (GGUFWriter), quantizes
(gguf.quants), names the tensors (TensorNameMap) and reads the merges, special token ids and chat
template (SpecialVocab). Written here, because it gives none of them: the Q/K row permutation, the
token types of special tokens inside a BPE vocabulary, the pre-tokenizer's name, the f16 overflow
check and the choice of type per tensor.
"""
