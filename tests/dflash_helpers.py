"""Test fixtures for DFlash / DDTree: tiny random drafters in the z-lab format, tiny target +
drafter pairs, a copying test-double proposer, a scripted speculation policy, and the exact target distribution of the first
sampled tokens with a chi-square check.

Stable names (other test files import them): ``save_tiny_drafter``, ``tiny_pair``, ``TinyPair``,
``save_tiny_tokenizer``, ``drafter_with_ranking``, ``CopyingProposer``, ``use_copying_proposer``,
``ScriptedNodes``.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import pytest
import safetensors.torch
import torch

from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.policy import FixedNodes
from flashtree.sampling import filter_logits
from flashtree.speculative.plain import PlainProposer
from flashtree.speculative.tree import build_tree
from flashtree.speculative.tree.draft_tree import chain_tree
from tests.helpers import tiny_hf_model

AUTO: Any = "auto"  # sentinel: pick a sensible value (None means: leave the key out)
DRAFTER_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
DRAFTER_INTERMEDIATE = 64
SPARE_TOKENIZER_ROWS = 2  # target embedding rows the tokenizer leaves unused (like Qwen3's)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one CPU thread, and far faster when other processes compete
    for the cores (thread pools spin); restored after the module. Use with ``autouse``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- drafter checkpoints

def _target_numbers(target: Any) -> tuple[int, int, int]:
    """(hidden_size, num_hidden_layers, vocab_size) of a target directory, config object or dict."""
    if isinstance(target, (str, Path)):
        target = json.loads((Path(target) / "config.json").read_text())
    if not isinstance(target, dict):
        target = target.to_dict() if hasattr(target, "to_dict") else vars(target)
    return int(target["hidden_size"]), int(target["num_hidden_layers"]), int(target["vocab_size"])


def tiny_drafter_config(target: Any, block_size: int = 4, layers: int = 1, layout: str = "rope_theta",
                        mask_token_id: Any = AUTO, target_layer_ids: Any = AUTO,
                        mask_token: str | None = None) -> dict:
    """A z-lab style drafter config.json dict for ``target`` (see :func:`save_tiny_drafter`)."""
    hidden, target_layers, vocab = _target_numbers(target)
    if target_layer_ids is AUTO:  # never the last layer: HF's hidden_states[L] is after the final norm
        target_layer_ids = [0, target_layers - 2] if target_layers > 2 else [0]
    if mask_token_id is AUTO:
        mask_token_id = vocab - 1
    draft = {"mask_token": mask_token or "<|MASK|>"}
    if mask_token_id is not None:
        draft["mask_token_id"] = mask_token_id
    if target_layer_ids is not None:
        draft["target_layer_ids"] = list(target_layer_ids)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "hidden_size": hidden, "intermediate_size": DRAFTER_INTERMEDIATE, **DRAFTER_HEADS,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "num_hidden_layers": layers, "block_size": block_size,
        "num_target_layers": target_layers, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers, "sliding_window": None, "use_sliding_window": False,
        "dflash_config": draft, "dtype": "float32",
    }
    if layout == "rope_theta":
        config.update(rope_theta=10000.0, rope_scaling=None)
    elif layout == "rope_parameters":
        config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    else:
        raise ValueError(f"layout must be 'rope_theta' or 'rope_parameters', got {layout!r}")
    return config


def drafter_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The z-lab tensor names and shapes a drafter config implies (written out independently
    of flashtree's module tree, so the loader is checked against the format itself)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    ids = config["dflash_config"].get("target_layer_ids") or [0] * config["num_hidden_layers"]
    shapes = {"fc.weight": (hidden, len(ids) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
            p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
        if config.get("attention_bias"):
            for proj, width in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd), ("o", hidden)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (width,)
    return shapes


def random_drafter_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, large enough that the drafter's argmax depends on its inputs."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in drafter_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.2 * torch.randn(shape, generator=gen)
    return weights


def write_drafter(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def save_tiny_drafter(target_dir_or_config: Any, out_dir: str | Path, block_size: int = 4, layers: int = 1,
                      layout: str = "rope_theta", mask_token_id: Any = AUTO, target_layer_ids: Any = AUTO,
                      seed: int = 0, mask_token: str | None = None) -> Path:
    """Write a random DFlash drafter for a target (a directory, a config object or a dict).

    ``mask_token_id`` / ``target_layer_ids``: AUTO picks ``vocab - 1`` / ``[0, target layers - 2]``,
    None leaves the key out (older checkpoints). ``layout``: where rope_theta sits.
    """
    config = tiny_drafter_config(target_dir_or_config, block_size, layers, layout, mask_token_id,
                                 target_layer_ids, mask_token)
    return write_drafter(out_dir, config, random_drafter_weights(config, seed))


# ---------------------------------------------------------------------------- target + drafter

def save_tiny_tokenizer(path: str | Path, vocab_size: int):
    """A whitespace word-level tokenizer with a chat template; its ids stop
    ``SPARE_TOKENIZER_ROWS`` below ``vocab_size`` (room to add the mask token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    words = ["user", "assistant", "system", "hello", "world", "flash", "tree", "the", "a", "is"]
    size = vocab_size - SPARE_TOKENIZER_ROWS
    names = (specials + words + [f"w{i}" for i in range(size)])[:size]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=specials[3:5], chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(path))
    return tokenizer


class TinyPair(NamedTuple):
    target: Path  # Hugging Face directory (config.json, model.safetensors, tokenizer files)
    drafter: Path  # z-lab DFlash directory (config.json, model.safetensors)
    hf: Any  # the transformers model saved in ``target``


def tiny_pair(tmp_path: str | Path, family: str = "qwen3_qknorm", vocab: int = 32, target_layers: int = 3,
              block_size: int = 4, drafter_layers: int = 1, seed: int = 0, tokenizer: bool = True,
              save_drafter=None, drafter_name: str = "drafter", **drafter_kwargs) -> TinyPair:
    """A tiny random target (``tests.helpers`` family) and a random drafter for it, written by ``save_drafter``
    (:func:`save_tiny_drafter` by default) into ``{drafter_name}-...``."""
    root = Path(tmp_path)
    hf = tiny_hf_model(family, seed=seed, vocab_size=vocab, layers=target_layers)
    target_dir = root / f"target-{family}-v{vocab}"
    hf.save_pretrained(target_dir)
    if tokenizer:
        save_tiny_tokenizer(target_dir, vocab)
    drafter_dir = (save_drafter or save_tiny_drafter)(
        target_dir, root / f"{drafter_name}-{family}-v{vocab}-b{block_size}", block_size, drafter_layers,
        seed=seed + 1, **drafter_kwargs)
    return TinyPair(target_dir, drafter_dir, hf)


def drafter_with_ranking(pair: TinyPair, tmp_path: Path, ranking: list[int]) -> str:
    """A copy of the pair's drafter that ships a draft-vocabulary ranking (spec/draft_vocab.py)."""
    from flashtree.train.draft_vocab import write_ranking

    directory = Path(tmp_path) / "drafter"
    shutil.copytree(pair.drafter, directory)
    write_ranking(ranking, directory)
    return str(directory)


# ---------------------------------------------------------------------------- copying drafter

def greedy_continuations(model, sequences: Sequence[Sequence[int]], depth: int) -> torch.Tensor:
    """The target's own greedy continuation of each sequence, ``[B, depth]`` (full recompute
    with flashtree's decoder, so it agrees with the engine's verification)."""
    rows = [list(s) for s in sequences]
    cfg = model.config
    device = model.lm_head.weight.device
    for _ in range(depth):
        width = max(len(r) for r in rows)
        counts = torch.tensor([len(r) for r in rows], device=device)
        spec = KVCacheSpec(cfg.num_hidden_layers, len(rows), width, 1, cfg.num_key_value_heads, cfg.head_dim)
        cache = KVCache(spec, model.lm_head.weight.dtype, device)
        batch = ForwardBatch(
            input_ids=torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device),
            positions=torch.arange(width, device=device).expand(len(rows), -1),
            slots=torch.arange(len(rows), device=device), cache_lengths=torch.zeros_like(counts),
            new_mask=causal_mask(counts, width), kv_len=width)
        logits = model(batch, cache, logits_index=(counts - 1)[:, None]).logits[:, 0]  # [B, V]
        for row, token in zip(rows, logits.argmax(-1).tolist()):
            row.append(token)
    return torch.tensor([r[len(s):] for r, s in zip(rows, sequences)], device=device)  # [B, depth]


class CopyingProposer(PlainProposer):
    """A test double that drafts the target's own greedy continuation: as a chain, or as the
    best-``budget`` tree of a near one-hot distribution (other tokens get small random weights).

    It reads committed tokens from the engine's requests (``attach(engine)`` after construction)."""

    name = "copy"

    def __init__(self, target, depth: int, budget: int | None = None, seed: int = 0):
        super().__init__()
        self.target, self.max_depth, self.budget = target, depth, budget
        self.chain = budget is None
        self.max_nodes = depth if budget is None else budget
        self.generator = torch.Generator().manual_seed(seed)
        self.engine = None

    def attach(self, engine) -> "CopyingProposer":
        self.engine = engine
        return self

    def propose(self, rows, nodes: int | None = None, refine=None, allot=None):
        nodes = self.max_nodes if nodes is None else nodes
        by_slot = {r.slot: r for r in self.engine.scheduler.active}
        requests = [by_slot[s] for s in rows.slots.tolist()]
        sequences = [r.prompt_ids + r.output_ids for r in requests]  # ends with the bonus token
        copy = greedy_continuations(self.target, sequences, self.max_depth)  # [B, depth]
        if self.budget is None:
            return chain_tree(copy[:, :nodes])
        vocab = self.target.config.vocab_size
        noise = torch.rand(copy.shape[0], self.max_depth, vocab, generator=self.generator).to(copy.device)
        logits = noise + 8.0 * torch.nn.functional.one_hot(copy, vocab)  # [B, depth, V]
        return build_tree(logits, rows.budgets.clamp(max=nodes), nodes, allot=allot)


def use_copying_proposer(monkeypatch, depth: int, budget: int | None = None) -> list[CopyingProposer]:
    """Make every engine built afterwards use a CopyingProposer; returns the list they land in
    (call ``attach(llm.engine)`` on the last one)."""
    import flashtree.engine.engine as engine_module

    made: list[CopyingProposer] = []

    def factory(config, target, tokenizer):
        made.append(CopyingProposer(target, depth, budget))
        return made[-1]

    monkeypatch.setattr(engine_module, "make_proposer", factory)
    return made


# ---------------------------------------------------------------------------- exact distributions

def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The engine's sampling distribution for logits ``[N, V]`` (same temperature / top-k / top-p rules)."""
    scaled = logits.double()[:, None, :] / temperature  # [N, 1, V]
    n = scaled.shape[0]
    filtered = filter_logits(scaled, torch.full((n,), top_k), torch.full((n,), top_p, dtype=torch.float64))
    return filtered[:, 0].softmax(-1)  # [N, V]


@torch.no_grad()
def first_tokens_distribution(hf, prompt: Sequence[int], temperature: float = 1.0, top_k: int = 0,
                              top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact probabilities of the first two sampled tokens jointly ``[V, V]`` and of the third
    token ``[V]``, from the transformers target."""
    vocab = hf.config.vocab_size
    base = torch.tensor(prompt)
    p1 = processed_probs(hf(base[None]).logits[:, -1], temperature, top_k, top_p)[0]  # [V]
    firsts = torch.cat([base.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # [V, n+1]
    p2 = processed_probs(hf(firsts).logits[:, -1], temperature, top_k, top_p)  # [V, V]
    joint = p1[:, None] * p2  # [V, V]
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2]
    seconds = torch.cat([base.expand(vocab * vocab, -1), pairs], dim=1)  # [V*V, n+2]
    p3 = processed_probs(hf(seconds).logits[:, -1], temperature, top_k, top_p)  # [V*V, V]
    third = (joint.reshape(-1, 1) * p3).sum(0)  # [V]
    return joint, third


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below ``min_expected`` are
    pooled into one cell. A sample in a cell of probability 0 makes the statistic infinite."""
    observed = observed.double().flatten()
    expected = expected_probs.double().flatten() * observed.sum()
    if bool(((expected == 0) & (observed > 0)).any()):
        return math.inf, 1
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square with ``df`` degrees of freedom by the Wilson-Hilferty
    approximation (accurate to about 1% for df >= 3); z = 3.719 is the standard normal's upper
    1e-4 quantile, so a correct sampler fails one check in 10,000 (fixed seeds make it stable)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


# ---------------------------------------------------------------------------- sampling checks

def sample_first_tokens(llm, prompt: Sequence[int], seeds: Sequence[int], count: int = 3, **params) -> torch.Tensor:
    """The first ``count`` tokens of one seeded request per seed, run through the engine in
    batches: ``[len(seeds), count]``."""
    from flashtree.sampling import SamplingParams

    batch = [SamplingParams(max_tokens=count, ignore_eos=True, seed=int(s), **params) for s in seeds]
    outs = llm.generate([list(prompt)] * len(seeds), batch)
    return torch.tensor([o.token_ids for o in outs])


def assert_first_tokens_match_target(samples: torch.Tensor, hf, prompt: Sequence[int], temperature: float = 1.0,
                                     top_k: int = 0, top_p: float = 1.0) -> None:
    """Chi-square goodness of fit of the sampled (t1, t2) pairs and t3 against the target's
    exact distribution under the same sampling rules."""
    vocab = hf.config.vocab_size
    joint, third = first_tokens_distribution(hf, prompt, temperature, top_k, top_p)
    pair_counts = torch.bincount(samples[:, 0] * vocab + samples[:, 1], minlength=vocab * vocab)
    third_counts = torch.bincount(samples[:, 2], minlength=vocab)
    for observed, expected, what in ((pair_counts, joint, "(t1, t2)"), (third_counts, third, "t3")):
        stat, df = chi_square(observed, expected)
        assert df >= 3, f"{what}: too few cells to test ({df} degrees of freedom)"
        critical = chi_square_critical(df)
        assert stat < critical, f"{what}: chi-square {stat:.1f} >= {critical:.1f} (df {df}): not the target's"


# ---------------------------------------------------------------------------- scripted policy

class ScriptedNodes(FixedNodes):
    """A policy whose rounds cycle through ``pattern`` (node counts), whatever the rows."""

    def __init__(self, pattern):
        self.ladder = tuple(sorted(set(pattern), reverse=True))
        self.pattern, self.at = list(pattern), 0

    def choose(self, rows):
        self.at += 1
        return self.pattern[(self.at - 1) % len(self.pattern)]

    best = choose

    def settled_on_plain(self, rows):
        """(Queued plain rounds, engine/overlap.py: the pattern's next round is plain.)"""
        return self.pattern[self.at % len(self.pattern)] == 0


class PassThroughGraphs:
    """GraphCache's interface without CUDA: remembers the keys it was asked for. The first call of
    a key runs the function twice, as a capture does (its warm-up runs the device work, then the
    replay runs it again), so a round whose device work is not idempotent fails here too."""

    def __init__(self):
        self.keys: list = []
        self.captures = 0
        self.frozen = False
        self.eager_runs = 0

    def has(self, key):
        return key in self.keys

    def would_capture(self, key):
        return not self.frozen and key not in self.keys

    def freeze(self):
        self.frozen = True

    def run(self, key, fn, inputs):
        if key not in self.keys and self.frozen:
            self.eager_runs += 1
            return fn(*inputs)
        if key not in self.keys:
            fn(*inputs)  # the capture's warm-up
            self.captures += 1
        self.keys.append(key)
        return fn(*inputs)
