"""Subcommands ``train-drafter``, ``regenerate`` and ``export-prompts`` (registered by flashtree.cli)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from flashtree.cli.args import HELP_FORMAT
from flashtree.errors import ConfigError

if TYPE_CHECKING:
    from flashtree.train.config import TrainConfig


def register(subparsers) -> None:
    _register_train(subparsers)
    _register_regenerate(subparsers)
    _register_export(subparsers)


# ---------------------------------------------------------------------------- train-drafter
def _register_train(subparsers) -> None:
    from flashtree.train.config import ARCHES, ATTENTION_KINDS, TrainConfig

    d = TrainConfig()
    p = subparsers.add_parser("train-drafter", help="train a DFlash drafter for a target model",
                              description="Train a DFlash block-diffusion drafter (z-lab checkpoint format).",
                              formatter_class=HELP_FORMAT)
    p.add_argument("--model", default=d.model, help="target: HF directory, hub id, .gguf file, or 'smollm2'")
    p.add_argument("--data", default=d.data,
                   help="'sharegpt', a .jsonl of {messages} / {conversations}, or a directory of .jsonl shards "
                        "(regenerate --output DIR); records with a 'split' field are split by it")
    p.add_argument("--output", default=d.output, help="checkpoint directory to write")
    p.add_argument("--resume", default=None,
                   help="checkpoint directory whose trainer_state/ this run continues exactly (weights, optimizer, "
                        "data position, RNG, schedule); without one, its weights start a new run")
    p.add_argument("--init", default=None,
                   help="drafter checkpoint whose weights (and shape) start a NEW run: new optimizer, schedule "
                        "and data position (e.g. the shipped drafter trained further on new data)")
    levers = p.add_argument_group("drafter shape and loss (the recipe's levers)")
    levers.add_argument("--arch", default=d.arch, choices=ARCHES,
                        help="a new drafter's format: dflash (DFlashDraftModel) or dflash2 (DFlash2DraftModel: "
                             "grouped local convolutions and a candidate selector); --resume / --init keep theirs, but "
                             "dflash2 with --init (or --resume without trainer state) of a first-generation drafter starts a DFlash2 drafter that "
                             "drafts as it did (convolutions pass through, the selector adds nothing)")
    levers.add_argument("--layers", type=int, default=d.layers, help="drafter depth: decoder layers")
    levers.add_argument("--intermediate-size", type=int, default=None,
                        help="drafter width: MLP intermediate size (default: the target's); the hidden size is "
                             "always the target's (the format requires it)")
    levers.add_argument("--block-size", type=int, default=d.block_size,
                        help="block slots (bonus + block_size-1 drafted positions)")
    levers.add_argument("--target-layer-ids", default=None,
                        help="target layers whose hidden states the drafter reads, comma-separated, e.g. 1,14,27 "
                             "(default: spread over the target with the z-lab rule)")
    levers.add_argument("--anchors-per-seq", type=int, default=d.anchors_per_seq,
                        help="anchor blocks sampled per sequence per step (more: more supervision per target pass)")
    levers.add_argument("--loss-gamma", type=float, default=None,
                        help="position-decayed loss: drafted slot k weighs exp(-(k-1)/gamma) (default by block "
                             "size: 4, 5, 7 for blocks 8, 10, 16); 0: no decay, every slot weighs 1")
    levers.add_argument("--selector-loss-weight", type=float, default=d.selector_loss_weight,
                        help="dflash2: weight of the candidate selector's loss beside the block loss")
    levers.add_argument("--selector-rank", type=int, default=None,
                        help="dflash2: width of a new selector's two vocabulary x rank codebooks (default 256, the "
                             "published); they set the checkpoint's size: two 49,152 x 256 codebooks are 50 MB in "
                             "bfloat16, SmolLM2's DFlash2 drafter 71 MB against the first generation's 23")
    levers.add_argument("--mask-token-id", type=int, default=None,
                        help="mask token id (default: <|MASK|> if the tokenizer has it, else an unused special)")
    p.add_argument("--output-norm-init", type=float, default=d.output_norm_init,
                   help="initial weight of a new drafter's final norm (small: near-uniform first predictions)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (wins over --epochs)")
    p.add_argument("--epochs", type=float, default=d.epochs)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--batch-size", type=int, default=None, help=f"sequences per step (default {d.batch_size})")
    size.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per step")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    p.add_argument("--max-conversations", type=int, default=None, help="read at most this many conversations")
    p.add_argument("--heldout-percent", type=float, default=d.heldout_percent)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="total training wall time, resumes included: the cosine schedule follows it; stop and save "
                        "then (the schedule then follows the clock: a resume is no longer bit-exact)")
    p.add_argument("--stop-after-s", type=float, default=None,
                   help="stop and save after this wall time of this run (continue later with --resume)")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="stop and save after this many steps of this run (continue later with --resume)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop, save and exit before this many minutes since the command began: the next step, "
                        "the final eval and the save, as measured, must fit (a device call's limit)")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=None, help="target / autocast dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attention", default=d.attention, choices=ATTENTION_KINDS)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evals (0: off)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints (0: end only)")
    p.add_argument("--save-dtype", default=d.save_dtype, choices=["bfloat16", "float16", "float32"],
                   help="dtype of the saved weights")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="shard the weights above this size (model-0000i-of-0000n.safetensors + index)")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.set_defaults(func=cmd_train)


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--target-layer-ids must be comma-separated integers, got {text!r}") from None


def train_config_from_args(args) -> TrainConfig:
    from flashtree.train.config import TrainConfig

    batch_size = args.batch_size
    if args.batch_size is None and args.batch_tokens is None:
        batch_size = TrainConfig.batch_size
    return TrainConfig(
        model=args.model, data=args.data, output=args.output, resume=args.resume, init=args.init, arch=args.arch,
        selector_loss_weight=args.selector_loss_weight, selector_rank=args.selector_rank, layers=args.layers,
        intermediate_size=args.intermediate_size, loss_gamma=args.loss_gamma, block_size=args.block_size, target_layer_ids=parse_layer_ids(args.target_layer_ids),
        mask_token_id=args.mask_token_id, output_norm_init=args.output_norm_init, max_seq_len=args.max_seq_len,
        batch_size=batch_size, batch_tokens=args.batch_tokens, anchors_per_seq=args.anchors_per_seq,
        heldout_percent=args.heldout_percent, max_conversations=args.max_conversations, steps=args.steps,
        epochs=args.epochs, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, time_budget_s=args.time_budget_s, stop_after_s=args.stop_after_s,
        stop_after_steps=args.stop_after_steps, max_minutes=args.max_minutes,
        device=args.device, dtype=args.dtype,
        attention=args.attention, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_every=args.save_every, save_dtype=args.save_dtype, max_shard_mb=args.max_shard_mb,
        log_every=args.log_every, seed=args.seed, progress=not args.no_progress)


def cmd_train(args) -> None:
    import time

    started_at = time.perf_counter()  # --max-minutes counts the target and data loading too
    from flashtree.train.trainer import train

    result = train(train_config_from_args(args), started_at)
    print(json.dumps(result.summary()))


# ---------------------------------------------------------------------------- regenerate
def _register_regenerate(subparsers) -> None:
    from flashtree.cli.args import add_model_args
    from flashtree.train.regenerate import RegenerateConfig

    d = RegenerateConfig()
    p = subparsers.add_parser("regenerate", help="answer prompts with the target and write chats as JSONL",
                              description="Generate assistant turns with the target (training data for drafters).",
                              formatter_class=HELP_FORMAT)
    add_model_args(p)
    p.add_argument("--prompts", default=d.prompts,
                   help="'sharegpt' or a .jsonl of {messages} / {conversations} / {prompt}: records ending with "
                        "a user turn (export-prompts output) are answered as they are, chats by --turns; "
                        "records with a 'split' (export-prompts --sources) keep it")
    p.add_argument("--turns", default=d.turns, choices=["first", "all"],
                   help="for chats: answer the first user turn, or every user turn after its history")
    p.add_argument("--output", default=d.output,
                   help="a .jsonl file, or a directory of shards part-NNNNN.jsonl.gz: each run adds new shards and "
                        "skips the ids already answered there (resumable over many runs)")
    p.add_argument("--append", action="store_true",
                   help="a .jsonl --output: add to it, skipping the ids it already holds")
    p.add_argument("--shard-mb", type=float, default=d.shard_mb,
                   help="directory --output: a new shard past this size on disk")
    p.add_argument("--shard-compression", default=d.shard_compression, choices=["gzip", "none"],
                   help="directory --output: gzip shards (part-NNNNN.jsonl.gz, about a third of the bytes) or plain")
    p.add_argument("--split", default=d.split, choices=["train", "heldout", "all"])
    p.add_argument("--limit", type=int, default=None, help="answer at most this many prompts (this run)")
    p.add_argument("--samples", type=int, default=d.samples,
                   help="answers per prompt (needs --temperature > 0; ids <id>, <id>~s1, ...; seeds from the ids)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget-s", type=float, default=None, help="stop admitting prompts after this time")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="end before this many minutes since the command began: no prompt admitted once the answers "
                        "in flight might not finish; at the limit unfinished answers are dropped (the next run "
                        "answers them)")
    p.add_argument("--no-progress", action="store_true")
    # Triton attention: plain decoding of hundreds of rows on scattered slots, where SDPA would first gather
    # their K/V (2.4x the tokens/s on the H200 at 512 rows); texts decoded once, at the end
    p.set_defaults(func=cmd_regenerate, max_running=256, max_context=1024, spec="none", triton_attention=True,
                   incremental_text=False)


def cmd_regenerate(args) -> None:
    import time

    started_at = time.perf_counter()
    from flashtree.cli.args import llm_from_args
    from flashtree.train.regenerate import RegenerateConfig, regenerate, select_prompts

    cfg = RegenerateConfig(prompts=args.prompts, output=args.output, split=args.split, limit=args.limit,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, time_budget_s=args.time_budget_s, turns=args.turns,
                           append=args.append, samples=args.samples, shard_mb=args.shard_mb,
                           shard_compression=args.shard_compression,
                           max_minutes=args.max_minutes, progress=not args.no_progress)
    prompts = select_prompts(cfg)
    llm = llm_from_args(args, max_waiting=max(args.max_waiting, args.max_running))
    stats = regenerate(llm, prompts, cfg, started_at)
    print(json.dumps({"output": cfg.output, "answered": stats.answered, "skipped": stats.skipped,
                      "dropped": stats.dropped, "left": len(prompts) - stats.answered - stats.skipped,
                      "tokens": stats.tokens, "seconds": round(stats.seconds, 1),
                      "tokens_per_second": round(stats.tokens_per_second, 1)}))


# ---------------------------------------------------------------------------- export-prompts
def _register_export(subparsers) -> None:
    p = subparsers.add_parser("export-prompts", help="write prompts as a small JSONL (for regenerate)",
                              description="Extract prompts into a portable JSONL that `flashtree regenerate --prompts "
                                          "FILE` reads: from one chats source (--data, with --split), or from several "
                                          "sources at once (--sources): deduplicated (exact and whitespace-normalized), "
                                          "without any prompt `flashtree bench` sends, each with its split.",
                              formatter_class=HELP_FORMAT)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="'sharegpt' or a .jsonl / .json of chats (default: sharegpt)")
    source.add_argument("--sources", default=None,
                        help="comma-separated: sharegpt, python-functions (HumanEval-style prompts from the documented "
                             "functions of Python's standard library), python-functions:DIR (of the .py files under "
                             "DIR), or chats files; writes both splits with a 'split' field (held out: the hash band "
                             "after the bench's own; never a prompt of `flashtree bench`)")
    p.add_argument("--output", required=True)
    p.add_argument("--split", default="train", choices=["train", "heldout", "all"], help="with --data only")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts (per source with --sources)")
    p.add_argument("--heldout-percent", type=float, default=2.0)
    p.add_argument("--model", default=None,
                   help="tokenizer source for the --max-prompt-tokens filter (default: no token filter)")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--turns", default="first", choices=["first", "all"],
                   help="first: each chat's opening user turn; all: every user turn, with the chat's "
                        "earlier messages as history (several times the data; ids <chat id>#turn<k>)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> None:
    tokenizer = None
    if args.model is not None:
        from flashtree.models.loader import load_checkpoint

        tokenizer = load_checkpoint(args.model, random_weights=True).tokenizer
    if args.sources is not None:
        import dataclasses

        from flashtree.bench.datasets import HUMANEVAL_REQUEST, bench_prompt_texts
        from flashtree.train.prompt_sources import export_source_prompts

        stats = export_source_prompts(args.output, [s.strip() for s in args.sources.split(",") if s.strip()],
                                      bench_prompt_texts(), args.heldout_percent, args.turns, args.limit, tokenizer,
                                      args.max_prompt_tokens, code_request=HUMANEVAL_REQUEST)
        print(json.dumps({"output": args.output, **dataclasses.asdict(stats)}))
        return
    from flashtree.train.data import export_prompts

    count = export_prompts(args.output, source=args.data or "sharegpt", split=args.split, limit=args.limit,
                           heldout_percent=args.heldout_percent, tokenizer=tokenizer,
                           max_prompt_tokens=args.max_prompt_tokens, turns=args.turns)
    print(json.dumps({"output": args.output, "prompts": count}))
