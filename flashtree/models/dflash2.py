"""DFlash2Drafter: the second-generation DFlash drafter (``DFlash2DraftModel``), and its loading.

Learned from the public implementations (vLLM's ``qwen3_dflash2.py`` and DFlash2 speculator,
llama.cpp's ``dflash.cpp``, the z-lab DFlash2 config and tensor-header fixtures; SGLang's code was
not at hand, only its PR's description); written here in our own terms. Everything a first-generation drafter does (``dflash.py``) stays: the context
features -> ``fc`` -> ``hidden_norm`` -> per-layer context K/V, the block ``[bonus, MASK x (b-1)]``
at positions ``start .. start+b-1`` with non-causal attention over context + block, the final
``norm``, the target's embedding and lm_head. DFlash2 adds:

1. **Embedding scale.** The block's embeddings are multiplied by ``input_embedding_scale``.
2. **Grouped local convolutions.** Every layer wraps its attention and its MLP each in one
   ``GroupedDynamicConv``. With ``u`` the sub-layer's normed input ``[b, H]``, one projection
   ``kernel_projection(u)`` gives per block slot i the coefficients ``d[i, side, t, g]`` (side 0:
   before the sub-layer, 1: after it; tap t < K; channel group g < H / group_size). A side
   convolves a tensor x along the block: ``y[i, c] = sum_t (base[side, t, c] + d[i, side, t, c //
   group_size]) * x[i - t, c]``, where ``x[i - t] = 0`` for i < t (slot 0, the bonus token, sees
   nothing before the block; blocks never mix). A layer computes
   ``h = norm_in(x); a = conv_1(attention(conv_0(h))); x = x + a; h = norm_post(x);
   x = x + conv'_1(mlp(conv'_0(h)))``, both sides of a wrapper taking their coefficients from the
   projection of that wrapper's normed input. The attention's block K/V come from the convolved
   input; the context K/V do not pass through any convolution.
3. **Unary scores with multiplier and soft cap.** At draft slot l = 1..b-1, with ``h_l`` the
   final-normed hidden and ``z_l`` the target's lm_head logits, the unary score of token v is
   ``u_l(v) = c * tanh(m * z_l(v) / c)`` (``m`` = ``output_multiplier``, ``c`` =
   ``final_logit_softcapping``; without a cap ``m * z_l(v)``). Both maps are increasing, so the
   candidates, the ``selector_top_k`` = k tokens of largest ``z_l``, are those of largest ``u_l``.
4. **Candidate selector.** A low-rank transition score between adjacent slots: with codebooks
   ``A`` (``predecessor_codebook``) and ``B`` (``successor_codebook``), both ``[V, R]``, and the
   gate ``g_l = hidden_projection(h_l)`` ``[R]``, the score of candidate c at slot l after token p
   is ``s_l(p, c) = u_l(c) + sum_r A[p, r] * g_l[r] * B[c, r]``. The predecessor of slot 1 is the
   bonus token. The proposal is the greedy walk: ``y_1 = argmax_c s_1(bonus, c)``, then
   ``y_l = argmax_c s_l(y_{l-1}, c)`` (ties: the candidate of larger ``z``).

The distribution trees are built over (and the chain's argmax): at slot l the drafter's
distribution is ``q_l = softmax`` over the k candidates of ``s_l(y_{l-1}, .)``, the walk's own
scores, and 0 for every other token. :meth:`DFlash2Drafter.draft_logits` returns it as logits
``[B, depth, V]`` float32: ``s_l(y_{l-1}, c)`` at the candidates, -inf elsewhere, so
``log_softmax`` of a row is ``log q_l``. The DFlash chain (argmax per slot) is then the walk, and
DDTree's best prefixes weigh a path by ``sum_l log q_l``; its best path is the walk too. (vLLM's
speculator uses the same ``q_l``, scaled by the temperature, as its proposal distribution. A tree
node below a sibling of ``y_{l-1}`` is still weighted by ``q_l``: the factorized view DDTree needs;
the verification makes every tree lossless whatever its weights.)

Config keys: ``dflash2_config.py``. Weight names (beyond the first generation's ``fc``,
``hidden_norm``, ``norm`` and ``layers.i.{input_layernorm, post_attention_layernorm, self_attn.*,
mlp.*}``): ``layers.i.attention_conv.base_kernel`` / ``layers.i.mlp_conv.base_kernel`` ``[2, K,
H]``, ``layers.i.attention_conv.kernel_projection.weight`` / ``layers.i.mlp_conv.kernel_projection.
weight`` ``[2 * K * H / group_size, H]`` (rows ordered side, tap, group),
``candidate_selector.hidden_projection.weight`` ``[R, H]``,
``candidate_selector.predecessor_codebook`` and ``candidate_selector.successor_codebook`` ``[V, R]``.

Sliding windows: a ``sliding_attention`` layer's block sees the last ``sliding_window`` context
positions, as in ``dflash.py``. Public engines differ at the edge (vLLM windows each query
position, the MLX reference keeps ``window - 1``); only contexts longer than the window see the
difference, in the proposals, never in the committed tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.errors import ConfigError
from flashtree.kv.cache import KVCache
from flashtree.models.batch import ForwardBatch
from flashtree.models.dflash import (
    DFlashDrafter,
    DrafterLayer,
    build_drafter_from,
)
from flashtree.models.dflash2_config import DFlash2Config, parse_dflash2_config
from flashtree.models.transformer import CausalLM

SIDES = 2  # a convolution wrapper's two sides: before its sub-layer (0), after it (1)


class GroupedDynamicConv(nn.Module):
    """Taps along the block axis whose coefficients are a learned base per channel plus an
    input-dependent part shared by each group of ``group_size`` channels (module docstring, 2)."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(SIDES, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, SIDES * taps * self.groups, bias=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """Input-dependent coefficients of both sides: ``x [B, b, H]`` -> ``[B, b, 2, K, G]``."""
        return self.kernel_projection(x).unflatten(-1, (SIDES, self.taps, self.groups))

    def convolve(self, x: torch.Tensor, coefficients: torch.Tensor, side: int) -> torch.Tensor:
        """One side: ``x [B, b, H]`` with that side's ``coefficients [B, b, K, G]`` -> ``[B, b, H]``."""
        grouped = x.unflatten(-1, (self.groups, self.group_size))  # [B, b, G, g]
        base = self.base_kernel[side].unflatten(-1, (self.groups, self.group_size))  # [K, G, g]
        weights = base + coefficients[..., None]  # [B, b, K, G, g]
        out = weights[:, :, 0] * grouped
        for tap in range(1, min(self.taps, x.shape[1])):
            earlier = F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))  # [B, b, G, g]: slot i holds x[i - tap]
            out = out + weights[:, :, tap] * earlier
        return out.flatten(-2)  # [B, b, H]

    def around(self, sublayer, h: torch.Tensor) -> torch.Tensor:
        """``sublayer`` between this wrapper's two sides, on its normed input ``h [B, b, H]``."""
        coefficients = self.coefficients(h)  # [B, b, 2, K, G]
        inner = sublayer(self.convolve(h, coefficients[:, :, 0], 0))
        return self.convolve(inner, coefficients[:, :, 1], 1)


class DFlash2Layer(DrafterLayer):
    """A DFlash decoder layer whose attention and MLP each sit inside a :class:`GroupedDynamicConv`."""

    def __init__(self, cfg: DFlash2Config, layer_index: int):
        super().__init__(cfg, layer_index)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, kernels
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ``x + residual`` (``x`` alone for the first layer); returns (MLP branch, residual),
        whose sum is the layer's output (the pre-norm contract of ``prenorm_layer``)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, kernels)
        attended = self.attention_conv.around(lambda u: self.self_attn(u, batch, cache, rope, mask), h)
        h, residual = self.post_attention_layernorm.add_forward(attended, residual, kernels)
        return self.mlp_conv.around(self.mlp, h), residual


class CandidateSelector(nn.Module):
    """The low-rank transition scores between adjacent draft slots, and the greedy walk through
    each slot's candidates (module docstring, 4)."""

    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))

    def edge_scores(self, previous: torch.Tensor, gates: torch.Tensor, candidates: torch.Tensor,
                    unary: torch.Tensor) -> torch.Tensor:
        """``s(p, c)`` ``[M, k]`` float32 for previous tokens ``[M]``, gates ``[M, R]`` (the
        hidden projection of the slot's normed hidden), candidates (token ids) and their unary
        scores ``[M, k]``."""
        context = self.predecessor_codebook[previous].float() * gates.float()  # [M, R]
        successors = self.successor_codebook[candidates].float()  # [M, k, R]
        return unary + torch.einsum("mr,mkr->mk", context, successors)  # [M, k]

    def walk_scores(self, hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor,
                    anchor: torch.Tensor) -> torch.Tensor:
        """The walk's scores ``s_l(y_{l-1}, c)`` ``[B, L, k]`` float32 for normed hidden ``[B, L, H]``,
        candidates (token ids) and their unary scores ``[B, L, k]``, and the bonus tokens ``[B]``.
        No host sync: the walk's choices stay on the device."""
        gates = self.hidden_projection(hidden)  # [B, L, R]
        previous = anchor  # [B] token ids
        scores = []
        for slot in range(candidates.shape[1]):
            step = self.edge_scores(previous, gates[:, slot], candidates[:, slot], unary[:, slot])  # [B, k]
            best = step.argmax(dim=-1, keepdim=True)  # [B, 1]: the first of equals, the larger z
            previous = candidates[:, slot].gather(-1, best)[:, 0]  # [B]
            scores.append(step)
        return torch.stack(scores, dim=1)  # [B, L, k]


class DFlash2Drafter(DFlashDrafter):
    """Parameters carry the public names: the first generation's, ``layers.i.attention_conv.*``,
    ``layers.i.mlp_conv.*`` and ``candidate_selector.*``."""

    KIND = "DFlash2"
    OWN_TENSORS = ("fc, hidden_norm, norm, layers.i.* (attention_conv and mlp_conv included) and "
                   "candidate_selector.*")

    config: DFlash2Config

    def __init__(self, config: DFlash2Config, target: CausalLM):
        super().__init__(config, target)
        self.layers = nn.ModuleList(DFlash2Layer(config, i) for i in range(config.num_hidden_layers))
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank)

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_block(block_ids)  # [B, b, hidden]
        scale = self.config.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def unary_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """``c * tanh(m * z / c)`` (``m * z`` without a cap) of lm_head logits, float32, any shape."""
        cfg = self.config
        scores = logits.float() * cfg.output_multiplier
        cap = cfg.final_logit_softcapping
        return scores if cap is None else cap * torch.tanh(scores / cap)

    def unary(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates of lm_head logits ``[B, L, V]``: unary scores (float32) and token ids,
        ``[B, L, k]`` each, best first."""
        top = logits.topk(self.config.selector_top_k, dim=-1)  # [B, L, k] x2
        return self.unary_scores(top.values), top.indices

    @torch.inference_mode()
    def draft_logits(self, cache: KVCache, slots: torch.Tensor, bonus: torch.Tensor, starts: torch.Tensor,
                     kv_len: int, depth: int | None = None) -> torch.Tensor:
        """The selector's per-slot distributions as logits ``[B, depth, V]`` float32: the walk's
        scores at each slot's candidates, -inf at every other token (module docstring). Arguments
        as in :meth:`DFlashDrafter.draft_logits`; the walk over the first ``depth`` slots is the
        full walk's beginning (it goes left to right)."""
        depth = self.draft_depth(depth)
        x = self.block_hidden(cache, slots, bonus, starts, kv_len)  # [B, b, hidden]
        hidden = self.norm(x[:, 1:1 + depth])  # [B, depth, hidden]
        logits = self.target.head(hidden)  # [B, depth, V]
        unary, candidates = self.unary(logits)  # [B, depth, k] x2
        scores = self.candidate_selector.walk_scores(hidden, candidates, unary, bonus)  # [B, depth, k]
        dense = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)  # [B, depth, V]
        return dense.scatter_(-1, candidates, scores)


def refuse_draft_vocab(requested: int | None) -> None:
    """A DFlash2 drafter drafts over the whole vocabulary (its selector's codebooks are indexed by
    token id, as in the public engines): no draft vocabulary (``speculative/draft_vocab.py``), by
    default or on request."""
    if requested:
        raise ConfigError(f"--draft-vocab {requested} is not valid with a DFlash2 drafter: its candidate selector "
                          f"scores token ids of the whole vocabulary; allowed: --draft-vocab 0 or unset")


# ---------------------------------------------------------------------------- loading

def load_dflash2_drafter(directory: Path, raw: dict, target: CausalLM, tokenizer=None,
                         block_size_override: int | None = None, device: torch.device | str | None = None,
                         dtype: torch.dtype | None = None, *, random_weights: bool = False,
                         seed: int = 0) -> DFlash2Drafter:
    """A DFlash2 drafter for ``target`` from ``directory`` (its parsed config.json dict ``raw``),
    refusing a mismatched pair before anything runs. Device and dtype default to the target's;
    ``random_weights`` reads config.json alone."""
    config_path = directory / "config.json"
    config = parse_dflash2_config(raw, str(config_path), target.config, tokenizer, block_size_override)
    return build_drafter_from(directory, config, target, device, dtype, random_weights, seed, DFlash2Drafter)
