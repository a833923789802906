"""The subcommands of `cputrain`, one module each: its parser (`add_parser(subparsers)`, which
returns it for the command line to add the common flags) and its body (`run(args)`, the exit code).

    train          a run here, or its ranks through the torchrun agent
    prepare        the tokenizer and token cache ahead of a run
    doctor         the machine, the torch build, every `auto` resolved here
    generate       text sampled from a finished model
    eval           a finished model on a dataset, or on benchmark tasks
    score          a reward model's score of each record of a file
    export         a LoRA run merged, or a model as one GGUF file
    plan           memory per rank and the smallest cluster that fits
    k8s            the Kubernetes manifests of a run
    resolved_here  the config prepare and eval read, resolved for one process on this machine

cputrain.cli builds the command line from them, runs the one named and maps errors to exit codes.
"""
