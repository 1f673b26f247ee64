"""``--distributed-executor``: the flag and its config, and Ray stays optional (nothing imports it
unless the Ray executor is chosen)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from flashtree.cli.args import add_model_args, engine_config_from_args
from flashtree.config import ParallelConfig
from flashtree.errors import ConfigError


def test_the_flag_sets_the_executor_and_others_are_refused():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--model", "m", "--spec", "none", "-tp", "2", "--distributed-executor", "ray"])
    assert engine_config_from_args(args).parallel == ParallelConfig(2, distributed_executor="ray")
    assert ParallelConfig().distributed_executor == "mp"
    with pytest.raises(ConfigError, match="distributed_executor must be one of mp, ray"):
        ParallelConfig(distributed_executor="slurm")


def test_nothing_imports_ray_unless_its_executor_is_chosen():
    code = ("import sys, flashtree.cli.main, flashtree.server.app, flashtree.engine.tp_executor; "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
