"""DFlash and DDTree proposers: one drafter pass per round, then a chain or a best-first tree.

Both share a :class:`DrafterRunner` (the drafter and its own context KV cache):
- ``DFlashProposer`` ("dflash"): the argmax at each of the b-1 draft positions, as a chain;
- ``DDTreeProposer`` ("ddtree"): the ``budget`` most likely prefixes of the drafter's factorized
  distribution (DESIGN.md section 4), as a tree.

Glossary
- b: the drafter's block size; b-1 = max_depth, the draft horizon.
- budget: drafted nodes per DDTree (the root excluded); ``max_nodes`` is the static maximum,
  each round verifies ``nodes <= max_nodes`` (the speculation policy's choice) and each row
  may ask for fewer (``rows.budgets``).
- context length: committed tokens of a slot whose context K/V the drafter holds; it equals the
  target's committed length after every drafted round, because the engine observes every
  committed token in order.
- lag: after plain rounds (0 nodes) the drafter does not project the committed tokens' features
  at once; it keeps them (``defer``, or in a plain round ``feature_sink``: the target's fused norm
  writes them in place; up to ``LAG_CAPACITY`` per slot) and projects them all in
  one pass (``catch_up``) before the slot's next drafted round, or when the lag is full. A
  server that settles on plain rounds (a drafter that rarely matches) then pays one batched
  projection per ``LAG_CAPACITY`` tokens instead of a drafter pass per token. A prompt short
  enough to fit the lag is deferred the same way at prefill, so the first token does not wait
  for the drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from flashtree.config import EngineConfig
from flashtree.device_copy import to_device
from flashtree.kv.cache import KVCache
from flashtree.kernels.cpu import fused as cpu_kernels
from flashtree.models.batch import slot_range_of
from flashtree.models.dflash import DFlashDrafter, load_drafter
from flashtree.kernels.feature_sink import FeatureSink
from flashtree.speculative.proposer import Proposer, ProposerRows
from flashtree.speculative.draft_vocab import default_size, load_draft_vocab, vocab_head
from flashtree.speculative.tree.build import ROOT, DraftTree, build_tree, chain_tree


def default_budget(device: torch.device) -> int:
    """DDTree budget when none is given: the best tokens/s measured per device with the shipped
    SmolLM2 pair (greedy, batch 1, 128 new tokens; benchmarks/README.md, "Default budget"):

    | device | budgets measured | best | its speedup over plain |
    | --- | --- | --- | --- |
    | 2-core CPU, fp32, run 1 | 2, 4, 7, 16, 32 | 4 | 1.12x (2: 1.09x; 16: 0.52x) |
    | 2-core CPU, fp32, run 2 | 2, 3, 4, 5, 7 | 2 | 1.09x (4: 1.03x) |
    | H200, bf16 | 8, 16, 32, 64 | 64 | 1.42x |
    | drafter v3, 2-core EPYC (AVX2), fp32, two runs | 2, 4, 7 | 4 | 1.14x / 1.24x |
    | drafter v3, H200, bf16 | 8, 16, 32, 64 | 64 | 1.91x |
    | drafter v3, 2-core Xeon (AVX-512), fp32, 32-row kernel | 2, 4, 8, 16 | 2 and 4 | 1.07x / 1.06x (8: 0.77x) |

    CPU: 2 and 4 were within the runs' noise with the v2 drafter and on the Xeon with v3; 4 is kept
    (a tree of 4 reaches deeper), and it is the best on the EPYC with the v3 drafter. Larger trees
    stay in the kernel's products (up to 31 nodes) but their verify costs more than they gain.

    Under load the adaptive policy halves it as the batch grows (down to plain rounds).
    """
    return 64 if torch.device(device).type == "cuda" else 4


LAG_CAPACITY = 64  # committed tokens a slot's drafter context may lag behind (see "lag")


class DrafterRunner:
    """The drafter, its context cache, and the things a round does with them."""

    def __init__(self, drafter: DFlashDrafter, cache: KVCache):
        self.drafter, self.cache = drafter, cache
        slots, width = cache.spec.max_slots, drafter.fc.in_features
        weight = drafter.fc.weight
        # [S, W + 1, F]: W = LAG_CAPACITY deferred tokens per slot, then a column that takes the
        # writes of padding (positions past a row's count, pad rows). How many tokens each slot has
        # deferred is the host's count (Request.drafter_lag), passed in: the device keeps none.
        self.lag_capacity = LAG_CAPACITY
        self.lagging = torch.zeros(slots, LAG_CAPACITY + 1, width, dtype=weight.dtype, device=weight.device)
        self.vocab_ids: torch.Tensor | None = None  # [N] token ids of the draft indices (draft_vocab.py), or None

    def restrict_vocab(self, head, token_ids: torch.Tensor) -> None:
        """Draft from ``token_ids`` only (a draft vocabulary, ``draft_vocab.py``): ``head`` gives
        the drafter's logits over their draft indices."""
        self.drafter.target = self.drafter.target._replace(head=head)
        self.vocab_ids = token_ids.to(self.lagging.device)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of draft indices (``>= 0``; the identity without a draft vocabulary)."""
        return indices if self.vocab_ids is None else self.vocab_ids[indices]

    def tree_token_ids(self, tree: DraftTree) -> DraftTree:
        """``tree`` with its drafted nodes' draft indices turned into token ids (the root's filler
        and the invalid nodes' padding stay)."""
        if self.vocab_ids is None:
            return tree
        drafted = tree.valid & (torch.arange(tree.tokens.shape[1], device=tree.tokens.device) != ROOT)  # [B, N]
        return tree._replace(tokens=torch.where(drafted, self.vocab_ids[tree.tokens.clamp(min=0)], tree.tokens))

    def defer(self, slots: torch.Tensor, features: torch.Tensor, lags: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        """Keep the context features ``[B, P, F]`` of each row's ``counts[b]`` newly committed
        tokens (default: all P; a plain round has P = 1) for a later :meth:`catch_up`, after the
        ``lags[b]`` tokens the row has deferred already (``[B]``; LAG_CAPACITY for a pad row: its
        writes go to the padding column). Capturable; the host keeps every real row's lag within
        LAG_CAPACITY."""
        width, capacity = features.shape[1], self.lag_capacity
        if counts is None and width == 1:  # a plain round (inside its CUDA graph): one small op
            self.lagging[slots, lags] = features[:, 0].to(self.lagging.dtype)
            return
        j = torch.arange(width, device=slots.device)  # [P]
        counts = torch.full_like(slots, width) if counts is None else counts  # [B]
        at = lags[:, None] + j  # [B, P]
        at = torch.where((j < counts[:, None]) & (at < capacity), at, capacity)  # [B, P]
        self.lagging[slots[:, None], at] = features.to(self.lagging.dtype)

    def feature_sink(self, slots: torch.Tensor, lags: torch.Tensor) -> FeatureSink:
        """Where a plain round's target forward writes its one new token's features per row: the
        place :meth:`defer` would put them (``slots``, ``lags`` ``[B]`` as there). Capturable."""
        columns = self.lag_capacity + 1
        return FeatureSink(self.lagging.view(-1, self.lagging.shape[-1]), slots * columns + lags)  # rows [B]

    def catch_up(self, slots: Sequence[int], starts: Sequence[int], lags: Sequence[int]) -> None:
        """Project the ``lags[i]`` deferred features of each of ``slots`` into the drafter's
        context, which holds ``starts[i]`` tokens of it so far (the committed length minus the
        lag), in one pass."""
        width = max(lags, default=0)
        if width:
            rows = torch.tensor([list(slots), list(starts), list(lags)], dtype=torch.long, device=self.lagging.device)
            self.catch_up_rows(*rows.unbind(0), width)  # [B] each

    def catch_up_rows(self, index: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> None:
        """:meth:`catch_up` on the device (capturable): ``index [B]`` the slots, ``starts [B]`` their
        context lengths, ``counts [B]`` their deferred tokens (0 for a graphed catch-up's pad rows:
        they project nothing), ``width`` at least the largest count. All from the host, so running
        it twice (a CUDA-graph capture's warm-up, then the replay) leaves what running it once does."""
        self.drafter.observe(self.cache, index, self.lagging[index, :width], counts, starts)

    def observe(self, slots: torch.Tensor, features: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> None:
        """Context features ``[B, P, F]`` of tokens committed at ``starts[b] + j``, j < counts[b]."""
        self.drafter.observe(self.cache, slots, features, counts, starts)

    def draft_logits(self, rows: ProposerRows, depth: int | None = None) -> torch.Tensor:
        """``[B, depth, V]`` draft logits (default depth b-1) for every row's block; rows may have
        different lengths."""
        kv_len, slot_range = self._attention_extent(rows)
        return self.drafter.draft_logits(self.cache, rows.slots, rows.bonus, rows.starts,
                                         kv_len=kv_len, slot_range=slot_range, depth=depth)

    def _attention_extent(self, rows: ProposerRows) -> tuple[int, tuple[int, int] | None]:
        """(keys attended per row, slot range) of the block pass.

        Eager: one small host sync for the longest context (it waits only for the round's own
        inputs) gives a tight key range and, for consecutive slots, a copy-free cache view.
        Under CUDA-graph capture nothing may sync and the graph must fit every replay: attend
        over the whole cache capacity and gather the slots.
        """
        if (self.drafter.uses_kernel_attention(self.drafter.config.block_size)
                or (rows.slots.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self.cache.spec.capacity, None  # (the kernel attention reads lengths itself)
        host = torch.cat([rows.slots, rows.starts.max()[None]]).tolist()
        slots, longest = host[:-1], host[-1]
        return longest + self.drafter.config.block_size, slot_range_of(slots)

    def release(self, slots: Sequence[int]) -> None:
        if len(slots):
            self.cache.free(to_device(torch.tensor(list(slots), dtype=torch.long), self.cache.lengths.device))


class _DrafterProposer:
    """What DFlash and DDTree share: the capture layers, the depth, observe and release."""

    name = ""

    def __init__(self, runner: DrafterRunner, max_nodes: int):
        config = runner.drafter.config
        self.runner = runner
        self.capture_layers: tuple[int, ...] = tuple(config.target_layer_ids)
        self.max_depth = config.block_size - 1
        self.max_nodes = max_nodes

    @property
    def lag_capacity(self) -> int:
        return self.runner.lag_capacity

    def observe(self, slots, features, counts, starts) -> None:
        self.runner.observe(slots, features, counts, starts)

    def defer(self, slots: torch.Tensor, features: torch.Tensor, lags: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        self.runner.defer(slots, features, lags, counts)

    def feature_sink(self, slots: torch.Tensor, lags: torch.Tensor) -> FeatureSink:
        return self.runner.feature_sink(slots, lags)

    def catch_up(self, slots: Sequence[int], starts: Sequence[int], lags: Sequence[int]) -> None:
        self.runner.catch_up(slots, starts, lags)

    def catch_up_rows(self, index: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> None:
        self.runner.catch_up_rows(index, starts, counts, width)

    def release(self, slots: Sequence[int]) -> None:
        self.runner.release(slots)


class DFlashProposer(_DrafterProposer):
    """The DFlash chain: the drafter's argmax at each of the b-1 positions (the first ``nodes``)."""

    name = "dflash"
    chain = True

    def __init__(self, runner: DrafterRunner):
        super().__init__(runner, max_nodes=runner.drafter.config.block_size - 1)

    def propose(self, rows: ProposerRows, nodes: int) -> DraftTree:
        draft = self.runner.draft_logits(rows, depth=nodes).argmax(dim=-1)  # [B, nodes] draft indices
        return chain_tree(self.runner.token_ids(draft))  # [B, nodes + 1] nodes


class DDTreeProposer(_DrafterProposer):
    """The best ``budget`` prefixes of the drafter's marginals, as a tree (per-row budgets)."""

    name = "ddtree"
    chain = False

    def __init__(self, runner: DrafterRunner, budget: int, tree_kernel: bool = False):
        super().__init__(runner, max_nodes=budget)
        self.tree_kernel = tree_kernel  # build_tree's Triton kept-list kernel (same trees)

    def propose(self, rows: ProposerRows, nodes: int) -> DraftTree:
        depth = min(nodes, self.max_depth)  # a tree of n nodes is at most n deep
        logits = self.runner.draft_logits(rows, depth=depth)  # [B, depth, V] (V: the draft vocabulary's N)
        tree = build_tree(logits, rows.budgets.clamp(max=nodes), nodes, kernel=self.tree_kernel)  # [B, nodes + 1]
        return self.runner.tree_token_ids(tree)


def make_dflash_proposer(config: EngineConfig, target, tokenizer) -> Proposer:
    """The proposer for ``--spec dflash|ddtree`` with the drafter ``config.spec.draft``."""
    spec = config.spec
    drafter = load_drafter(spec.draft, target, tokenizer, block_size_override=spec.block_size,
                           random_weights=config.random_weights, seed=config.seed + 1)
    drafter.use_fused_kernels(config.gpu_kernels, config.cpu_kernels, attention=config.triton_attention)
    if drafter.kernels is cpu_kernels and config.quant_kernels:
        drafter.quantize_blocks()  # CPU: Q8_0 copies for block passes
    cache = drafter.new_cache(config.max_running + 1, config.max_context,  # + the pad slot
                              scratch=max(config.prefill_chunk, LAG_CAPACITY))  # a catch-up pads to the largest lag
    runner = DrafterRunner(drafter, cache)
    drafter_dir = Path(drafter.config.source).parent  # (load_drafter resolved it: its config.json)
    vocab_size = default_size(spec.draft_vocab, target.lm_head.weight.device, drafter_dir)
    if vocab_size is not None:
        token_ids = load_draft_vocab(drafter_dir, vocab_size, target.config.vocab_size, at_most=spec.draft_vocab is None)
        runner.restrict_vocab(vocab_head(target.lm_head.weight, target.lm_head_quant, token_ids), token_ids)
    if spec.method == "dflash":
        return DFlashProposer(runner)
    budget = default_budget(target.lm_head.weight.device) if spec.budget is None else spec.budget
    return DDTreeProposer(runner, budget, tree_kernel=config.gpu_kernels and config.triton_tree)
