"""The command line's settings: flags reach the engine and server configs, and bad settings get
clear errors. (Running the commands: tests/integration/test_cli.py.)"""

import pytest

from flashtree.config import EngineConfig, KernelConfig
from flashtree.errors import ConfigError, RequestError
from flashtree.models.build import resolve_device


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_invalid_engine_settings():
    with pytest.raises(ConfigError, match="max_running"):
        EngineConfig.of(max_running=0)


def test_bad_sampling_params():
    from flashtree import SamplingParams

    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_adaptive_spec_flags():
    """On by default for generate and serve, off by default for bench (it measures each method
    as named); --adaptive-spec / --no-adaptive-spec override both."""
    from flashtree.bench.methods import parse_method
    from flashtree.cli import build_parser
    from flashtree.cli.args import engine_config_from_args
    from flashtree.cli.bench import setup_from_args
    from flashtree.cli.serve import config_from_args

    parser = build_parser()
    generate = ["generate", "--prompt", "hi"]
    assert engine_config_from_args(parser.parse_args(generate)).speculation.adaptive is True
    assert engine_config_from_args(parser.parse_args(generate + ["--no-adaptive-spec"])).speculation.adaptive is False
    assert config_from_args(parser.parse_args(["serve", "--spec", "none"])).engine.speculation.adaptive is True
    assert config_from_args(parser.parse_args(["serve", "--no-adaptive-spec"])).engine.speculation.adaptive is False
    bench = ["bench", "--methods", "ar"]
    assert setup_from_args(parser.parse_args(bench), needs_draft=False).engine.speculation.adaptive is False
    setup = setup_from_args(parser.parse_args(bench + ["--adaptive-spec"]), needs_draft=False)
    assert setup.engine.speculation.adaptive is True
    assert setup.engine_config(parse_method("ar")).speculation.adaptive is True
    assert EngineConfig.of().speculation.adaptive is True
    with pytest.raises(ConfigError):
        EngineConfig.of(adaptive_spec="yes")


def test_triton_switches_reach_the_engine_config():
    """--triton-tree is on by default and --no-triton-tree turns it off; --triton-attention is None (plain
    steps only) except in regenerate (on for every forward), and --[no-]triton-attention sets it, for every
    subcommand."""
    from flashtree.cli import build_parser
    from flashtree.cli.bench import setup_from_args
    from flashtree.cli.serve import config_from_args

    assert (KernelConfig().triton_tree, KernelConfig().triton_attention) == (True, None)
    parser = build_parser()
    for flags, tree, attention in (([], True, None), (["--no-triton-tree", "--triton-attention"], False, True),
                                   (["--no-triton-attention"], True, False)):
        kernels = config_from_args(parser.parse_args(["serve", *flags])).engine.kernels
        assert (kernels.triton_tree, kernels.triton_attention) == (tree, attention)
        bench = setup_from_args(parser.parse_args(["bench", "--methods", "ar", "--dataset", "humaneval", *flags]),
                                needs_draft=False).engine.kernels
        assert (bench.triton_tree, bench.triton_attention) == (tree, attention)
        generate = parser.parse_args(["generate", "--prompt", "x", *flags])
        assert (generate.triton_tree, generate.triton_attention) == (tree, attention)
    assert parser.parse_args(["regenerate"]).triton_attention is True
    assert parser.parse_args(["regenerate", "--no-triton-attention"]).triton_attention is False


def test_serve_http_and_loop_choices_reach_uvicorn_and_bad_ones_are_refused():
    """--http / --loop pick uvicorn's protocol and event loop (auto by default); a ServerConfig
    with anything else names the flag and the choices."""
    from flashtree.cli import build_parser
    from flashtree.cli.serve import config_from_args
    from flashtree.server.config import ServerConfig

    parser = build_parser()
    default = config_from_args(parser.parse_args(["serve"]))
    assert (default.http, default.loop) == ("auto", "auto")
    chosen = config_from_args(parser.parse_args(["serve", "--http", "h11", "--loop", "asyncio"]))
    assert (chosen.http, chosen.loop) == ("h11", "asyncio")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--http", "h2"])
    for bad, flag in ((dict(http="h2"), "--http"), (dict(loop="trio"), "--loop")):
        with pytest.raises(ConfigError, match=f"{flag} must be one of auto, "):
            ServerConfig(engine=EngineConfig.of(), model_name="m", **bad)


def test_serve_switch_interval_is_validated_and_set_only_while_serving():
    """--switch-interval-ms reaches the config (None by default: Python's own), a value outside
    (0, 1000] names the flag, and the interval holds only inside ``switch_interval``."""
    import sys

    from flashtree.cli import build_parser
    from flashtree.cli.serve import config_from_args, switch_interval
    from flashtree.server.config import ServerConfig

    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).switch_interval_ms is None
    assert config_from_args(parser.parse_args(["serve", "--switch-interval-ms", "0.5"])).switch_interval_ms == 0.5
    for bad in (0, -1.0, 2000.0, "fast"):
        with pytest.raises(ConfigError, match=r"--switch-interval-ms must be in \(0, 1000\]"):
            ServerConfig(engine=EngineConfig.of(), model_name="m", switch_interval_ms=bad)
    before = sys.getswitchinterval()
    with switch_interval(0.5):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == before
    with switch_interval(None):
        assert sys.getswitchinterval() == before


def test_serve_runs_a_cuda_engine_in_a_process_and_a_cpu_engine_on_a_thread_unless_told(monkeypatch):
    """Unset, --engine-process follows the engine's device (a process on CUDA, a thread on CPU);
    --engine-process / --no-engine-process override it, and a non-boolean value names the setting."""
    import torch

    from flashtree.cli import build_parser
    from flashtree.cli.serve import config_from_args
    from flashtree.server.config import ServerConfig

    parser = build_parser()

    def runs_process(*argv: str) -> bool:
        return config_from_args(parser.parse_args(["serve", *argv])).runs_engine_process

    assert config_from_args(parser.parse_args(["serve"])).engine_process is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not runs_process("--device", "cpu") and not runs_process()  # (--device auto: the CPU here)
    assert runs_process("--device", "cpu", "--engine-process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (nothing touches the device)
    assert runs_process("--device", "cuda") and runs_process()
    assert not runs_process("--device", "cuda", "--no-engine-process")
    assert not runs_process("--device", "cpu")
    with pytest.raises(ConfigError, match="engine_process must be true, false or unset"):
        ServerConfig(engine=EngineConfig.of(), model_name="m", engine_process="yes")


def test_every_option_of_every_subcommand_shows_its_default():
    import re

    from flashtree.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        text = sub.format_help()
        options = re.split(r"\n  (?=-)", text)[1:]
        missing = [o.split()[0] for o in options if "default" not in o and not o.startswith("-h")]
        assert options and not missing, (name, missing)


def test_vllm_names_of_the_engine_limits_are_accepted():
    from flashtree.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-model-len", "4096", "--max-num-seqs", "32",
                                      "--max-num-batched-tokens", "8192"])
    assert (args.max_context, args.max_running, args.max_prefill_tokens) == (4096, 32, 8192)
