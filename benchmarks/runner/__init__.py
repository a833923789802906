"""What every benchmark script runs the same way, one idea a module:

    pages             where each block lives in docs/benchmarks/: its page and section (the registry)
    blocks            writing a block into its page, in its section
    machine           the machine a figure was measured on, and its physical cores
    timing            timed steps, medians
    processes         a measurement in a fresh process: its environment, its JSON line, its peak RSS;
                      a peer's side run in a child of the script, and that script's command line
    cputrain_run      one `cputrain train` measured from outside and read from its run folder
    hf_trainer_clock  a Hugging Face Trainer's steps timed and counted as cputrain's are
    base_model        the base model the fine-tuning benchmarks train: random weights, a shared tokenizer

The scripts themselves sit in one subpackage per page of docs/benchmarks/ (vs_hf_trainer,
step_time, memory, lora, network, data, export, sft_and_dpo, revision_parity).
"""
