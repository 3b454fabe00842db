"""The benchmark suite: five prefix-sharing workloads, radixrt with and without its cache, and transformers.

It lives inside the package (not only under the repository's bench/) so that
`radixrt bench` works from any install, editable or not; `bench/run_suite.py`
is a thin wrapper for running it from a checkout. Importing this package is
cheap: the suite loads models only when `suite.main` runs.

    prompts    deterministic, seeded text (passages, questions, chat turns)
    workloads  the workloads' inputs, tokenized with the model's tokenizer
    drivers    how each workload issues its requests to a system
    system_api the interface every system implements, and the Completion it returns
    systems    radixrt (cache on / off), and every system by name
    hf_system  Hugging Face transformers `generate`, the baseline
    metrics    per-repetition figures and their medians
    report     JSON, Markdown and machine description
    plots      PNG plots (needs matplotlib, the `bench` extra)
    suite      the command line: which systems, workloads, repetitions
"""
