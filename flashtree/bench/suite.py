"""One benchmark run: load the prompts and the target once, run every method, compare.

The result is the report dict (see report.py); writing files is the command line's job.
"""

from __future__ import annotations

import sys

from flashtree.bench import llamacpp
from flashtree.bench.datasets import load_prompts
from flashtree.bench.environment import environment
from flashtree.bench.methods import BenchMethod
from flashtree.bench.metrics import summarize, tokens_per_second
from flashtree.bench.report import build_report
from flashtree.bench.runner import BenchSetup, MethodRun, load_shared_target, run_method
from flashtree.errors import ConfigError
from flashtree.models.build import resolve_device, resolve_dtype


def run_suite(setup: BenchSetup, methods: list[BenchMethod], dataset: str, num_prompts: int,
              progress: bool = True) -> dict:
    """``methods[0]`` must be plain decoding: every other method is compared with it."""
    if not methods or not methods[0].is_plain:
        raise ConfigError("the first benchmark method must be plain decoding (ar)")
    configs = [setup.engine_config(m) for m in methods]  # validates every method before loading
    if any(m.is_llamacpp for m in methods):
        llamacpp.check_usable(setup.engine.target.model, setup.engine.target.device, setup.temperature)
    prompts = load_prompts(dataset, num_prompts)
    target = load_shared_target(configs[0])
    prompt_ids, skipped = fitting_prompts([p.encode(target.tokenizer) for p in prompts], setup)
    runs = [run_with_progress(setup, m, target, prompt_ids, progress) for m in methods]
    summaries = [summarize(run, runs[0]) for run in runs]
    config = session_config(setup, dataset, len(prompt_ids), skipped, prompt_ids)
    return build_report(config, summaries)


def fitting_prompts(prompt_ids: list[list[int]], setup: BenchSetup) -> tuple[list[list[int]], int]:
    """Prompts whose tokens plus ``max_new_tokens`` fit in the context; and how many did not."""
    max_context = setup.engine.cache.max_context
    fitting = [ids for ids in prompt_ids if len(ids) + setup.max_new_tokens <= max_context]
    skipped = len(prompt_ids) - len(fitting)
    if skipped:
        print(f"flashtree bench: skipped {skipped} prompt(s) longer than --max-context {max_context} "
              f"minus --max-new-tokens {setup.max_new_tokens}", file=sys.stderr)
    if not fitting:
        raise ConfigError(f"no prompt fits in --max-context {max_context} with "
                          f"--max-new-tokens {setup.max_new_tokens}; raise --max-context")
    return fitting, skipped


def run_with_progress(setup: BenchSetup, method: BenchMethod, target, prompt_ids, progress: bool) -> MethodRun:
    from tqdm import tqdm

    with tqdm(total=len(prompt_ids), desc=f"bench {method.label}", unit="prompt", disable=not progress,
              file=sys.stderr) as bar:
        run = run_method(setup, method, target, prompt_ids, bar)
        bar.set_postfix_str(f"{tokens_per_second(run):.1f} tok/s")
    return run


def session_config(setup: BenchSetup, dataset: str, num_prompts: int, skipped: int,
                   prompt_ids: list[list[int]]) -> dict:
    device = resolve_device(setup.engine.target.device)
    options = setup.options()
    options["dtype"] = str(resolve_dtype(setup.engine.target.dtype, device)).removeprefix("torch.")
    return {**options, **environment(device), "dataset": dataset, "num_prompts": num_prompts,
            "skipped_prompts": skipped, "mean_prompt_tokens": round(sum(map(len, prompt_ids)) / len(prompt_ids), 1)}
