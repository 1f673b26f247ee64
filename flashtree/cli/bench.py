"""``flashtree bench``: compare decoding methods on one prompt set; writes JSON, markdown and plots."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from flashtree.cli.args import HELP_FORMAT, add_model_args, engine_config_from_args
from flashtree.config import SpeculationConfig
from flashtree.errors import ConfigError, FlashtreeError

DEFAULT_METHODS = "ar,dflash,ddtree:16,ddtree:64"
DEFAULT_JSON = Path("benchmarks") / "out" / "bench.json"


class InexactMethodsError(FlashtreeError):
    """A speculative method produced tokens that plain decoding did not."""


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="compare decoding methods side by side (tau, tokens/s, exactness)",
                                  description=__doc__, formatter_class=HELP_FORMAT)
    add_model_args(bench)
    bench.add_argument("--methods", default=DEFAULT_METHODS,
                       help="comma-separated: ar, dflash, ddtree, ddtree:N, llama.cpp (CPU, a GGUF target; the bench "
                       "extra); ar always runs")
    bench.add_argument("--dataset", default="humaneval",
                       help="humaneval, sharegpt-heldout, or a JSONL file of {\"prompt\"} or {\"messages\"} lines")
    bench.add_argument("--num-prompts", type=int, default=8)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--batch-size", type=int, default=1, help="requests decoded together (overrides --max-running)")
    bench.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    bench.add_argument("--warmup-tokens", type=int, default=16,
                       help="tokens of the untimed warm-up requests per method, one per row of the first batch (0: none)")
    bench.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"report file (default {DEFAULT_JSON})")
    bench.add_argument("--out-dir", type=Path, default=None, help="markdown and plots (default: beside --json)")
    bench.add_argument("--allow-inexact", action="store_true",
                       help="exit 0 even when a method's tokens differ from plain decoding")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    # each method as named (the adaptive policy would change its tau), texts decoded once at the end
    bench.set_defaults(func=cmd_bench, adaptive_spec=False, incremental_text=False)


def cmd_bench(args: argparse.Namespace) -> None:
    from flashtree.bench.methods import parse_methods
    from flashtree.bench.suite import run_suite

    methods = parse_methods(args.methods)
    setup = setup_from_args(args, needs_draft=any(not (m.is_plain or m.is_llamacpp) for m in methods))
    report = run_suite(setup, methods, args.dataset, args.num_prompts, progress=not args.no_progress)
    paths = write_outputs(report, args.json, args.out_dir)
    print(paths.markdown.read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    if report["inexact_methods"] and not args.allow_inexact:
        raise InexactMethodsError(
            f"{', '.join(report['inexact_methods'])} produced tokens different from plain decoding "
            f"(reports written; pass --allow-inexact to exit 0 anyway)")


def setup_from_args(args: argparse.Namespace, needs_draft: bool):
    from flashtree.bench.runner import BenchSetup
    from flashtree.speculative.defaults import default_spec

    if args.spec is not None or args.budget is not None:
        raise ConfigError("flashtree bench takes its decoding methods from --methods (e.g. ar,dflash,ddtree:64), "
                          "not --spec / --budget")
    for name in ("num_prompts", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    draft = default_spec(args.model, "ddtree", args.draft)[1] if needs_draft else None
    if needs_draft and draft is None:
        raise ConfigError(f"--methods {args.methods} has speculative methods, which need a drafter: "
                          "pass --draft PATH (or use --methods ar)")
    base = SpeculationConfig(method="ddtree" if draft else "none", draft=draft, block_size=args.block_size,
                             draft_vocab=args.draft_vocab if draft else None)
    engine = engine_config_from_args(args, spec=base, max_running=args.batch_size)
    return BenchSetup(engine=engine, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, ignore_eos=args.ignore_eos,
                      warmup_tokens=max(args.warmup_tokens, 0))


class OutputPaths(NamedTuple):
    """The files a bench run writes."""

    json: Path
    markdown: Path
    speedup_plot: Path
    acceptance_plot: Path


def write_outputs(report: dict, json_path: Path, out_dir: Path | None) -> OutputPaths:
    from flashtree.bench.plots import plot_acceptance_histograms, plot_speedup_and_tau
    from flashtree.bench.report import write_json, write_markdown

    out_dir = out_dir if out_dir is not None else json_path.parent
    stem = json_path.stem
    paths = OutputPaths(json_path, out_dir / f"{stem}.md", out_dir / f"{stem}_speedup_tau.png",
                        out_dir / f"{stem}_acceptance.png")
    write_json(report, paths.json)
    write_markdown(report, paths.markdown)
    plot_speedup_and_tau(report, paths.speedup_plot)
    plot_acceptance_histograms(report, paths.acceptance_plot)
    return paths
