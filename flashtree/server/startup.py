"""Server startup: refuse configs that cannot fit, load the engine, log its memory, warm it up.

The memory check runs before any weight is read: it sizes the KV cache from the model's
config.json exactly as the engine will (slots x (max_context + scratch) entries) and compares
it with the device's memory (CPU: physical RAM; CUDA: free memory now).
"""

from __future__ import annotations

import gc
import logging
import os

import torch

from flashtree.config import EngineConfig
from flashtree.engine.engine import LLMEngine
from flashtree.errors import ConfigError
from flashtree.kernels.cpu.quant_linear import QuantizedLinear
from flashtree.kv.cache import KVCacheSpec
from flashtree.kv.pages import pages_for
from flashtree.models.build import resolve_device, resolve_dtype
from flashtree.models.config import ModelConfig
from flashtree.models.loader import resolve_model_dir
from flashtree.models.tokenizer import encode_chat
from flashtree.sampling import SamplingParams

log = logging.getLogger("flashtree.server")

GIB = 1 << 30
DEFAULT_DRAFT_SCRATCH = 16  # block size of z-lab drafters: the scratch a chain round needs
WARMUP_TOKENS = 4


def load_engine(config: EngineConfig) -> LLMEngine:
    """Check memory, load, log the layout, and warm up with one short generation."""
    check_kv_cache_fits(config)
    log.info("loading %s", config)
    engine = LLMEngine(config)
    log.info("%s", describe(engine))
    warm_up(engine)
    log.info("warm-up done; ready to serve")
    return engine


def load_for_serving(config: EngineConfig, freeze_gc: bool = False) -> LLMEngine:
    """:func:`load_engine`, then, when ``freeze_gc``, :func:`freeze_startup_objects` (the server's own
    process, or its engine process)."""
    engine = load_engine(config)
    if freeze_gc:
        log.info("%d startup objects exempt from garbage collection", freeze_startup_objects())
    return engine


def freeze_startup_objects() -> int:
    """Move every object alive now (modules, the weights' Python wrappers, tokenizer tables:
    about 400,000 in a SmolLM2 server) out of the garbage collector's reach; returns how many.

    The collector runs a full collection whenever enough objects have outlived its young
    generations, and a full collection walks every tracked object: 170-180 ms for a loaded
    SmolLM2 server on a 2-core CPU, against 1.5 ms once they are frozen. On the engine thread that is
    a stalled step. Startup objects
    live as long as the process, so nothing is lost by never scanning them; later garbage is
    still collected. It acts on the whole process, so only the ``flashtree serve`` process calls it
    (``ServerConfig.freeze_gc``), not a library user's."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def check_kv_cache_fits(config: EngineConfig, measure_cuda: bool = True) -> None:
    """Raise ConfigError when the KV cache alone exceeds the device's memory (a pool sized by
    ``gpu_memory_utilization`` fits by construction). ``measure_cuda=False`` reads the model's
    config but leaves a CUDA device unmeasured: measuring makes a CUDA context (about 0.5 GB of the
    device) in the calling process, which the server's process must not hold when its engine runs
    in a process of its own."""
    if config.cache.gpu_memory_utilization is not None and config.cache.kv_pages is None:
        return
    device = resolve_device(config.target.device)
    dtype = resolve_dtype(config.target.dtype, device)
    spec = estimated_kv_spec(config)
    if device.type == "cuda" and not measure_cuda:
        return
    pages = None if config.cache.kv_pages is None else config.cache.kv_pages + 1 + pages_for(spec.scratch, spec.page_size)
    need = spec.bytes(dtype, pages)
    have, what = device_memory(device)
    if need > have:
        raise ConfigError(
            f"the KV cache needs {need / GIB:.2f} GiB (--max-running {config.scheduler.max_running} x --max-context "
            f"{config.cache.max_context} tokens in {str(dtype).removeprefix('torch.')}) but the {device} device has "
            f"{have / GIB:.2f} GiB {what}; lower --max-running, --max-context or --kv-pages")


def estimated_kv_spec(config: EngineConfig) -> KVCacheSpec:
    """The engine's KV layout, from config.json only (scratch estimated for drafters)."""
    model = ModelConfig.from_file(resolve_model_dir(config.target.model, need_weights=False) / "config.json")
    spec, scheduling = config.speculation, config.scheduler
    draft_scratch = 0 if spec.method == "none" else max((spec.budget or 0) + 1,
                                                         spec.block_size or DEFAULT_DRAFT_SCRATCH)
    return KVCacheSpec(model.num_hidden_layers, scheduling.max_running + 1, config.cache.max_context,  # + the pad slot
                       max(draft_scratch, scheduling.prefill_chunk), model.num_key_value_heads, model.head_dim,
                       config.cache.page_size)


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, description) of the memory a cache could take on ``device``."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, "free"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of physical memory"


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every distinct tensor in the target and in the proposer's modules, GGUF blocks included."""
    modules = [engine.model] + [v for v in vars(engine.proposer).values() if isinstance(v, torch.nn.Module)]
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        for sub in module.modules():  # GGUF blocks, by storage (a drafter's k/v blocks are a view of its qkv ones)
            for value in vars(sub).values():
                if isinstance(value, QuantizedLinear):
                    storage = value.blocks.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def describe(engine: LLMEngine) -> str:
    config, spec, scheduling = engine.config, engine.config.speculation, engine.config.scheduler
    kv = engine.cache.spec.bytes(engine.dtype, engine.pages.pool.num_pages)
    return (f"loaded {config.target.model} in {engine.load_seconds:.1f}s | method={engine.proposer.name} "
            f"draft={spec.draft} budget={spec.budget} adaptive={spec.adaptive} | device={engine.device} dtype={engine.dtype} | "
            f"max_running={scheduling.max_running} max_context={config.cache.max_context} "
            f"kv_pages={engine.pages.pool.capacity}x{config.cache.page_size} "
            f"prefill_chunk={scheduling.prefill_chunk} max_prefill_tokens={engine.scheduler.config.max_prefill_tokens} "
            f"max_round_tokens={scheduling.max_round_tokens} max_waiting={scheduling.max_waiting} | "
            f"weights {weight_bytes(engine) / GIB:.3f} GiB, KV cache {kv / GIB:.3f} GiB")


def warm_up(engine: LLMEngine) -> None:
    """One short greedy generation so the first client does not pay for lazy initialization."""
    if engine.tokenizer is not None:
        prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": "Hello"}])
    else:
        prompt = [0]
    prompt = prompt[: engine.config.cache.max_context - 1]
    req = engine.add_request(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, seed=0))
    engine.run_until_done([req])
    while engine.has_work:
        engine.step()
