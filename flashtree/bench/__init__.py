"""``flashtree bench``: decoding methods side by side on the same prompts, in one process.

- methods.py: ``--methods ar,dflash,ddtree:64`` -> :class:`BenchMethod` specs
- datasets.py: prompt sets (HumanEval, ShareGPT held-out, JSONL files)
- runner.py: one engine per method over a shared target; timing and outputs
- metrics.py: tau, tokens/s, speedup, exactness against plain decoding
- report.py: JSON and markdown; plots.py: PNG figures; cli.py: the subcommand
"""
