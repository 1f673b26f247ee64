"""llama.cpp beside flashtree's methods in ``flashtree bench`` (``--methods ar,ddtree,llama.cpp``).

It decodes the same prompt ids from the same GGUF file, greedy, on as many threads as torch uses,
through ``llama-cpp-python`` (the ``bench`` extra: ``pip install 'flashtree[bench]'``; never a default
dependency). It stops at flashtree's stop tokens unless the run ignores them. llama.cpp rounds the
activations of its quantized products to 8 bits, so its tokens may part from plain decoding's: the
report says where (it is listed as not exact) rather than hiding it. One round per token.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Sequence

import torch

from flashtree.errors import ConfigError
from flashtree.models.build import resolve_device

LLAMA_CPP = "llama.cpp"


def gguf_file(model: str) -> Path:
    """The GGUF file a benchmark's target was loaded from: ``smollm2`` (the embedded default) or a
    ``.gguf`` path; a ConfigError for anything else."""
    if model == "smollm2":
        from flashtree.models.embedded import EMBEDDED_MODELS, embedded_gguf_path

        return embedded_gguf_path(EMBEDDED_MODELS["smollm2"])
    path = Path(model)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ConfigError(f"--methods {LLAMA_CPP} needs a GGUF target (--model smollm2 or a .gguf file), "
                          f"got --model {model!r}")
    return path


def check_usable(model: str, device: str | None, temperature: float) -> None:
    """A ConfigError naming what is missing when llama.cpp cannot run beside this benchmark."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError(f"--methods {LLAMA_CPP} needs llama-cpp-python: pip install 'flashtree[bench]'")
    if resolve_device(device).type != "cpu":
        raise ConfigError(f"--methods {LLAMA_CPP} compares on the CPU: add --device cpu")
    if temperature != 0:
        raise ConfigError(f"--methods {LLAMA_CPP} decodes greedily: use --temperature 0")
    gguf_file(model)


def generate(model: str, prompt_ids: Sequence[list[int]], max_new_tokens: int,
             stop_ids: frozenset[int], max_context: int) -> tuple[list[list[int]], float]:
    """Each prompt's greedy tokens from llama.cpp (at most ``max_new_tokens``, ending at a stop id
    when ``stop_ids`` is not empty) and the seconds they took (model load and one warm-up excluded)."""
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(gguf_file(model)), n_ctx=max_context, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)
    llm.eval(list(prompt_ids[0][:8]))  # warm-up, not timed
    outputs = []
    start = time.perf_counter()
    for ids in prompt_ids:
        llm.reset()
        llm.eval(list(ids))
        tokens: list[int] = []
        while len(tokens) < max_new_tokens:
            token = int(llm.sample(top_k=1, temp=0.0, repeat_penalty=1.0))
            tokens.append(token)
            if token in stop_ids or len(tokens) == max_new_tokens:
                break
            llm.eval([token])
        outputs.append(tokens)
    return outputs, time.perf_counter() - start
