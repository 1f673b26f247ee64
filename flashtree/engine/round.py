"""One decode round on the device, for every running row at once: propose -> verify -> accept -> commit.

The round is pure device work with no host sync, so it can be captured and replayed as one CUDA
graph (``engine/graphs.py``); the host reads its packed result once (``engine/runner.py``).

Glossary
- B: rows of the round (running requests, then pad rows on the pad slot when graphed).
- nodes: drafted nodes per row this round (the policy's choice); N = nodes + 1 entries per tree.
- D: the deepest node of this round's trees, ``min(max_depth, nodes)``; P = D + 1 path slots.
- bonus token: the newest output token, chosen by the target and not yet run through it: the root.
- lag: tokens whose drafter features a row has deferred so far (``speculative/drafter.py``).

1. propose: the proposer's trees ``[B, N]`` rooted at each row's bonus token (plain: the root alone);
   with a row allotment each row keeps the best of its own tree's nodes (``policy/row_budgets.py``).
2. verify: one target forward over every tree, each node at position start + depth, attending to
   the committed context and its ancestors; the target's own choice at every node (argmax, or a
   keyed sample: ``flashtree/sampling.py``).
3. accept: from the root, follow the child carrying the target's choice while there is one
   (``speculative/verify.py``); every committed token is the target's choice given the true prefix,
   so decoding is lossless.
4. commit: the accepted path's KV entries move to contiguous positions; the drafter gets the
   accepted tokens' context features (or defers them, in a plain round).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.config import KernelConfig
from flashtree.engine.constraint import GrammarRound
from flashtree.engine.stage_timer import StageTimer
from flashtree.engine.token_state import SlotTokenState
from flashtree.kv.cache import KVCache
from flashtree.models.batch import ForwardBatch
from flashtree.models.packing import TokenPacking, pack_rows
from flashtree.models.transformer import CausalLM
from flashtree.penalties import adjust_logits, path_tokens
from flashtree.sampling import (
    SamplingTensors,
    TokenLogprobs,
    choose_tokens,
    token_logprobs,
)
from flashtree.policy.row_budgets import allot_budgets
from flashtree.speculative.proposer import Proposer
from flashtree.speculative.tree.build import Allot
from flashtree.speculative.tree.draft_tree import DraftTree, narrowed, root_only_tree
from flashtree.speculative.verify import AcceptResult, accept_walk

INT_FIELDS = 8  # RoundInputs' integer fields (all but temperature and top_p), in their order


class RoundInputs(NamedTuple):
    """A round's per-row inputs, all ``[B]`` device tensors (also what proposers see)."""

    slots: torch.Tensor  # KV slot
    bonus: torch.Tensor  # bonus token (root of the tree)
    starts: torch.Tensor  # position of the bonus token = committed length
    budgets: torch.Tensor  # tree budget
    generated: torch.Tensor  # output tokens so far (the bonus is output index generated-1)
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    lags: torch.Tensor  # tokens the row's drafter has deferred before this round

    @classmethod
    def of(cls, ints: torch.Tensor, floats: torch.Tensor) -> "RoundInputs":
        """From ``ints [8, B]`` (slots, bonus, starts, budgets, generated, top_k, seed, lags) and
        ``floats [2, B]`` (temperature, top_p)."""
        slots, bonus, starts, budgets, generated, top_k, seed, lags = ints.unbind(0)
        return cls(slots, bonus, starts, budgets, generated, floats[0], floats[1], top_k, seed, lags)


class RoundShape(NamedTuple):
    """The static (host) facts a round's device work depends on; part of its CUDA graph's key."""

    kv_len: int  # keys attended per row (a bucket when graphed)
    any_sampled: bool
    any_filtered: bool
    nodes: int  # drafted nodes per row (the tree has nodes + 1 entries); 0: a plain round
    logprobs: int | None = None  # top alternatives per emitted token's log-probability (None: no row asked)
    adjust: bool = False  # some row's logits are adjusted (min_tokens, penalties: flashtree/penalties.py)
    # a drafted tree round that verifies its rows packed into this many flat tokens (live rows' roots included):
    # its rows' best nodes across their trees of ``nodes`` each, up to that total (models/packing.py); None:
    # every row verifies its own budget, padded to [B, nodes + 1]
    tokens: int | None = None


class RowAllotment(NamedTuple):
    """How a round splits its nodes among its rows: each row keeps the best of its tree's nodes for
    the most expected tokens per cost (``policy/row_budgets.allot_budgets``), at most its budget."""

    cost: torch.Tensor  # [T + 1] float on the device: the round's cost by verified tokens (the policy's curve)
    padded: bool  # the verify forward is [B, widest row] rather than the rows' tokens packed (models/packing.py)
    # the packed layout's flat batch size (a graph's key; the cost curve must not allow more); None: the rows'
    # own total, read on the host (CPU tensors only). At least the round's live rows: every root is verified
    tokens: int | None = None


def verifies_packed(allotment: RowAllotment | None, shape: RoundShape, grammar: GrammarRound | None,
                    chain: bool) -> bool:
    """A tree round of ``shape`` verifies its rows' tokens packed (models/packing.py): it has a fixed packed size
    (``shape.tokens``, its allotment then built in the round) or its allotment asks for the ragged layout, and no
    [B, N] step needs the logits (penalties and min_tokens adjust them, a grammar masks them: those rounds, and
    chains, stay padded)."""
    ragged = shape.tokens is not None if allotment is None else not allotment.padded
    return ragged and not shape.adjust and grammar is None and not chain and shape.nodes > 0


class RoundOutput(NamedTuple):
    packed: torch.Tensor  # [B, 2 + D + 1] per row: acceptance length, tree size, emitted tokens (see pack)
    trace: tuple[torch.Tensor, ...] | None  # with a tree trace: tokens, parents, valid [B, N], path [B, P]
    logprobs: TokenLogprobs | None = None  # [B, P(, k)] at the path's nodes: emitted token j is chosen at node j


class DeviceRound:
    """The round's device work over ``model``, its ``cache`` and the ``proposer``."""

    def __init__(self, model: CausalLM, cache: KVCache, proposer: Proposer, kernels: KernelConfig,
                 tracing: bool = False):
        self.model, self.cache, self.proposer = model, cache, proposer
        self.kernels, self.tracing = kernels, tracing
        self.token_state: SlotTokenState | None = None  # the engine's, once a request adjusts its logits

    def __call__(self, shape: RoundShape, *tensors: torch.Tensor, timer: StageTimer | None = None,
                 grammar: GrammarRound | None = None, allotment: RowAllotment | None = None) -> RoundOutput:
        """``grammar``: the round's rows with structured output (eager rounds only: it reads the trees
        on the host); their trees hold only what the grammar allows, and each node's choice is masked.
        ``allotment``: each row's budget comes from its tree (trees only; None: every row keeps its
        budget). On a CPU the verify forward then narrows to the widest row (reading it costs no sync)."""
        rows = RoundInputs(*tensors)
        nodes = shape.nodes
        if allotment is None and shape.tokens is not None and nodes > 0:
            allotment = up_to_total(shape.tokens, rows.bonus.device)
        if nodes == 0 and self.kernels.plain_fast_path:
            return self._plain(shape, rows, timer, grammar)
        t0 = timer.mark() if timer else 0.0

        # 1. propose: N = nodes + 1 entries per tree, the root first
        if nodes == 0:
            tree = root_only_tree(rows.bonus)
        elif grammar is not None:  # grammar rows' trees rebuilt from the drafter's candidates
            tree = self.proposer.propose(rows, nodes, refine=grammar.refine)
        elif allotment is not None and not self.proposer.chain:
            tree = self.proposer.propose(rows, nodes, allot=row_allot(allotment, rows))
            if tree.valid.device.type == "cpu":  # host memory: the widest row is known without a sync
                tree = narrowed(tree, int(tree.valid.sum(dim=1).max()))  # [B, widest row]
        else:
            tree = self.proposer.propose(rows, nodes)
        packing = None
        if verifies_packed(allotment, shape, grammar, self.proposer.chain):
            packing = packed_rows(tree, rows, allotment.tokens)
            tree = tree._replace(valid=tree.valid & (packing.packed | (tree.depths == 0)))  # (nothing unpacked is
            # walked: a pad row's root stays, its result is dropped)
        tokens = torch.cat([rows.bonus[:, None], tree.tokens[:, 1:].clamp(min=0)], dim=1)  # [B, N]
        t1 = timer.add("draft", t0) if timer else 0.0

        # 2. verify: every node at start + depth, seeing the committed context and its ancestors
        batch = ForwardBatch(
            input_ids=tokens, positions=rows.starts[:, None] + tree.depths, slots=rows.slots,
            cache_lengths=rows.starts, new_mask=tree.ancestor_mask, kv_len=shape.kv_len,
            chain=self.proposer.chain and grammar is None, packing=packing)  # (a grammar's refined chain may branch)
        out = self.model(batch, self.cache, capture_layers=self.proposer.capture_layers)
        out_index = rows.generated[:, None] + tree.depths  # [B, N]
        if packing is not None:
            choice = packed_choice(out.logits[0], packing, sampling_of(shape, rows), out_index)  # [B, N]
        else:
            logits = out.logits
            if shape.adjust:  # each node's distribution given the output so far and its own path
                paths = path_tokens(tokens, tree.parents, min(self.proposer.max_depth, nodes))  # [B, N, D]
                logits = adjust_logits(logits, out_index, self.token_state.gather(rows.slots, rows.generated), paths)
            if grammar is not None:  # each node's choice among what the grammar allows after its path
                logits = logits.masked_fill(~grammar.allowed, float("-inf"))
            choice = choose_tokens(logits, sampling_of(shape, rows), out_index)  # [B, N]
        t2 = timer.add("verify", t1) if timer else 0.0

        # 3. accept: the deepest path of nodes carrying the target's choices
        depth = min(self.proposer.max_depth, nodes)  # deepest node of this round's trees
        walk = accept_walk(tree._replace(tokens=tokens), choice, depth, kernel=self.proposer.tree_kernel)
        path = walk.path.clamp(min=0)  # [B, P]

        # 4. commit: the path's KV entries to start .. start + length - 1, its features to the drafter
        if self.proposer.chain or nodes == 0:  # a chain's accepted path is a prefix: nothing moves
            self.cache.commit_prefix(rows.slots, rows.starts, walk.accept_lengths)
        else:
            self.cache.commit(rows.slots, rows.starts, path, walk.accept_lengths)
        if out.hidden is not None and nodes == 0:
            self.proposer.defer(rows.slots, out.hidden[:, :1], rows.lags)  # projected at the next drafted round
        elif out.hidden is not None:  # the drafter sees every committed token
            features = at_nodes(out.hidden, path, packing)  # [B, P, F]
            self.proposer.observe(rows.slots, features, walk.accept_lengths, rows.starts)
        packed = pack(walk, tree.valid)
        if shape.adjust:
            self.token_state.record(rows.slots, packed[:, 2:], walk.accept_lengths, rows.generated)
        if timer:
            timer.add("commit", t2)
        trace = (tokens, tree.parents, tree.valid, walk.path) if self.tracing else None
        logprobs = None
        if shape.logprobs is not None:  # emitted token j is the target's choice at path node j
            chosen = choice.gather(1, path)  # [B, P]
            logprobs = (token_logprobs(out.logits, chosen, shape.logprobs, positions=path) if packing is None
                        else token_logprobs(packing.at(out.logits[0], path), chosen, shape.logprobs))  # [B, P(, k)]
        return RoundOutput(packed, trace, logprobs)

    def _plain(self, shape: RoundShape, rows: RoundInputs, timer: StageTimer | None,
               grammar: GrammarRound | None = None) -> RoundOutput:
        """A plain round without the tree machinery: the root-only tree's walk always accepts the
        root and nothing else, so the round is forward -> choose -> commit the one token. Same values
        as the general path, without the tree's tensors and the accept walk's ops."""
        t0 = timer.mark() if timer else 0.0
        num_rows = rows.bonus.shape[0]
        root_mask = torch.ones(num_rows, 1, 1, dtype=torch.bool, device=rows.bonus.device)  # [B, 1, 1]
        batch = ForwardBatch(
            input_ids=rows.bonus[:, None], positions=rows.starts[:, None], slots=rows.slots,
            cache_lengths=rows.starts, new_mask=root_mask, kv_len=shape.kv_len)
        # a drafter's features go straight to its lag buffer (projected at the next drafted round)
        sink = self.proposer.feature_sink(rows.slots, rows.lags) if self.kernels.feature_sink else None
        out = self.model(batch, self.cache, capture_layers=self.proposer.capture_layers, feature_sink=sink)
        logits = out.logits
        if shape.adjust:
            logits = adjust_logits(logits, rows.generated[:, None], self.token_state.gather(rows.slots, rows.generated))
        if grammar is not None:
            logits = logits.masked_fill(~grammar.allowed, float("-inf"))
        next_bonus = choose_tokens(logits, sampling_of(shape, rows), rows.generated[:, None])[:, 0].long()  # [B]
        t1 = timer.add("verify", t0) if timer else 0.0
        ones = torch.ones_like(rows.slots)  # [B] accept length 1: the root
        if shape.adjust:
            self.token_state.record(rows.slots, next_bonus[:, None], ones, rows.generated)
        self.cache.commit_prefix(rows.slots, rows.starts, ones)
        if out.hidden is not None:  # (no sink)
            self.proposer.defer(rows.slots, out.hidden, rows.lags)  # [B, 1, F]
        packed = torch.stack([ones, torch.zeros_like(ones), next_bonus], dim=1)  # [B, 3], as pack's
        if timer:
            timer.add("commit", t1)
        trace = None
        if self.tracing:  # the root-only tree and its one-node path
            zeros = torch.zeros_like(rows.slots)[:, None]  # [B, 1]
            trace = (rows.bonus[:, None], zeros - 1, zeros == 0, zeros)
        logprobs = None if shape.logprobs is None else token_logprobs(out.logits, next_bonus[:, None], shape.logprobs)
        return RoundOutput(packed, trace, logprobs)


def up_to_total(tokens: int, device: torch.device) -> RowAllotment:
    """The allotment of a round of a fixed packed size: every row's best nodes, ranked across rows by path
    probability, until ``tokens`` are verified (a cost curve flat up to it, closed after it)."""
    return RowAllotment(torch.ones(tokens + 1, device=device), padded=False, tokens=tokens)


def row_allot(allotment: RowAllotment, rows: RoundInputs) -> Allot:
    """The tree build's per-row rule for ``allotment``: the live rows (a pad row has no output yet)
    share the round by their trees' path probabilities."""
    live = rows.generated > 0  # [B]
    return lambda ranked, caps: allot_budgets(ranked, caps, allotment.cost, live, allotment.padded)


def packed_rows(tree: DraftTree, rows: RoundInputs, tokens: int | None) -> TokenPacking:
    """The packing of each live row's valid nodes (a prefix of its node axis) into ``tokens`` flat tokens
    (None: exactly their total, read on the host: CPU tensors only); a pad row packs nothing."""
    counts = torch.where(rows.generated > 0, tree.valid.sum(dim=1), 0)  # [B]
    if tokens is None:
        if counts.device.type != "cpu":
            raise ValueError("a packed round on a device other than the CPU needs its flat size (RowAllotment.tokens)")
        tokens = max(int(counts.sum()), 1)
    return pack_rows(counts, tree.valid.shape[1], tokens)


def packed_choice(logits: torch.Tensor, packing: TokenPacking, sampling: SamplingTensors,
                  out_index: torch.Tensor) -> torch.Tensor:
    """The target's choice at every node ``[B, N]`` from a packed forward's ``logits [T, V]``: each flat
    token chosen with its row's settings and its own output index (the same keyed sample as padded), then
    put at its node (an unpacked node gets a flat pad token's choice: nothing walks it)."""
    row_of = packing.row_of  # [T]
    per_token = sampling._replace(temperature=sampling.temperature[row_of], top_p=sampling.top_p[row_of],
                                  top_k=sampling.top_k[row_of], seed=sampling.seed[row_of])
    flat = choose_tokens(logits[:, None], per_token, packing.gather(out_index)[:, None])[:, 0]  # [T]
    nodes = torch.arange(out_index.shape[1], device=out_index.device).expand_as(out_index)  # [B, N]
    return packing.at(flat, nodes)  # [B, N]


def at_nodes(values: torch.Tensor, nodes: torch.Tensor, packing: TokenPacking | None) -> torch.Tensor:
    """A forward's per-token ``values`` (``[B, N, F]``, or ``[1, T, F]`` packed) at each row's ``nodes [B, M]``
    -> ``[B, M, F]``."""
    if packing is not None:
        return packing.at(values[0], nodes)
    return values.gather(1, nodes[:, :, None].expand(-1, -1, values.shape[-1]))


def sampling_of(shape: RoundShape, rows: RoundInputs) -> SamplingTensors:
    return SamplingTensors(rows.temperature, rows.top_p, rows.top_k, rows.seed, shape.any_sampled, shape.any_filtered)


def pack(walk: AcceptResult, valid: torch.Tensor) -> torch.Tensor:
    """Per row: its acceptance length, its drafted nodes, then the emitted tokens (the accepted
    drafts, i.e. the committed path minus the old bonus, then the next bonus). ``[B, 2 + D + 1]``."""
    counts = walk.accept_lengths  # [B]
    pad = torch.full_like(walk.next_bonus[:, None], -1)
    emitted = torch.cat([walk.committed_tokens[:, 1:], pad], dim=1)  # [B, D+1]
    emitted = emitted.scatter(1, (counts - 1)[:, None], walk.next_bonus[:, None])
    sizes = valid.sum(1, keepdim=True) - 1  # [B, 1] drafted nodes
    return torch.cat([counts[:, None], sizes, emitted], dim=1)
