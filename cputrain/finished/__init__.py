"""What uses a finished model: a run's exported model/, a LoRA run's adapters on their base, or a
Hugging Face model folder.

    load             find the model (a run's model/ or a model folder) and load it
    generate         sample text from it (`cputrain generate`, the sample a run writes when it ends)
    dataset_eval     loss and perplexity on a dataset, or a preference run's figures (`cputrain eval`)
    preference_eval  a DPO, SimPO, KTO or reward run's objective and figures on held-out pairs or feedback
    score            a reward model's score of each record of a file (`cputrain score`)
    lm_harness       benchmark tasks through lm-evaluation-harness (`cputrain eval --tasks`)
    gguf             a Llama written as one GGUF file (`cputrain export --gguf`)
    after_export     a local run folder's loss.png and sample.txt, once its model is exported

It sits above objectives (a preference run is scored with its own objective) and below the run,
whose trainer plots the losses and samples the exported model when it ends.
"""
