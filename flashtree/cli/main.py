"""The ``flashtree`` command line: generate, chat, serve, bench, train-drafter, regenerate."""

from __future__ import annotations

import argparse
import json
import sys

from flashtree.cli import bench, serve, train
from flashtree.cli.args import HELP_FORMAT, add_model_args, add_sampling_args, llm_from_args, sampling_from_args
from flashtree.errors import FlashtreeError
from flashtree.version import __version__


def cmd_generate(args) -> None:
    llm = llm_from_args(args)
    params = sampling_from_args(args)
    if args.prompt_ids:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise FlashtreeError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        out = llm.generate([ids], params)[0]
    elif args.raw:
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text,
                          "acceptance_lengths": out.acceptance_lengths, "finish_reason": out.finish_reason}))
    else:
        print(out.text)


def cmd_chat(args) -> None:
    from flashtree.cli.chat import run_chat

    run_chat(llm_from_args(args), sampling_from_args(args), system=args.system)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtree", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashtree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=HELP_FORMAT)
    add_model_args(gen)
    add_sampling_args(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="user message (sent through the chat template)")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids (no template)")
    gen.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON line with token_ids and text")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat that streams tokens", formatter_class=HELP_FORMAT)
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=cmd_chat, max_waiting=4)

    for command in (serve, bench, train):
        command.register(sub)
    for subcommand in sub.choices.values():
        show_every_default(subcommand)
    return parser


def show_every_default(parser: argparse.ArgumentParser) -> None:
    """Options without help text get one that shows their default (as the formatter adds to the others)."""
    for action in parser._actions:
        if action.option_strings and action.help is None:
            action.help = "(default: %(default)s)"



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except FlashtreeError as err:
        print(f"flashtree: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
