"""Per-slot token state on the device for logit adjustments (``flashtree/penalties.py``).

Made when the first request that needs it (min_tokens, a penalty) arrives; from then on every
request that starts in a slot resets the slot's row (neutral settings unless it asks), and rounds
that hold an adjusting row record what they emit. The output tokens are kept by output index
(``history``) and counted when a round reads them, up to the round's own output index: writing a
token is setting its place, and reading never sees a later one, so a round that runs twice (a
CUDA-graph capture's warm-up, then its replay) computes what it computes once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtree.device_copy import to_device
from flashtree.engine.request import Request
from flashtree.penalties import SlotAdjustments


class SlotTokenState:
    def __init__(self, max_slots: int, vocab: int, max_outputs: int, device: torch.device):
        self.device, self.vocab, self.width = device, vocab, max_outputs
        # [S, W + 1]: output token k of a slot at column k; the last column takes the writes of padding
        self.history = torch.zeros(max_slots, max_outputs + 1, dtype=torch.long, device=device)
        self.prompt = torch.zeros(max_slots, vocab, dtype=torch.bool, device=device)  # [S, V] prompt tokens
        self.stop_mask = torch.zeros(max_slots, vocab, dtype=torch.bool, device=device)  # [S, V]
        self.min_tokens = torch.zeros(max_slots, dtype=torch.long, device=device)  # [S]
        self.settings = torch.zeros(3, max_slots, dtype=torch.float32, device=device)  # [3, S] presence, frequency, repetition
        self.settings[2] = 1.0

    def start(self, requests: Sequence[Request]) -> None:
        """Reset the slots of requests starting their prefill: the prompt seen, their stop tokens and
        settings (neutral for a request that adjusts nothing)."""
        for req in requests:
            slot = req.slot
            self.prompt[slot] = False
            self.stop_mask[slot] = False
            if req.params.adjusts:
                self.prompt[slot, self._ids(req.prompt_ids)] = True
                self.stop_mask[slot, self._ids(sorted(t for t in req.stop_token_ids if t < self.vocab))] = True
        slots = [r.slot for r in requests]
        values = [[r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty] for r in requests]
        self.min_tokens[self._ids(slots)] = self._ids([r.params.min_tokens for r in requests])
        self.settings[:, self._ids(slots)] = to_device(torch.tensor(values, dtype=torch.float32).T, self.device)

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        return to_device(torch.tensor(list(values), dtype=torch.long), self.device)

    def gather(self, slots: torch.Tensor, generated: torch.Tensor) -> SlotAdjustments:
        """The rows' state ``[B, ...]`` before output index ``generated[b]`` (capturable)."""
        tokens = self.history[slots, :self.width]  # [B, W]
        before = torch.arange(self.width, device=slots.device)[None, :] < generated[:, None]  # [B, W]
        counts = torch.zeros(slots.shape[0], self.vocab, dtype=torch.float32, device=slots.device)
        counts.scatter_add_(1, tokens, before.float())  # [B, V]
        settings = self.settings[:, slots]  # [3, B]
        return SlotAdjustments(counts, self.prompt[slots] | (counts > 0), self.stop_mask[slots], self.min_tokens[slots],
                               settings[0], settings[1], settings[2])

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor) -> None:
        """Each row's first ``lengths[b]`` of ``tokens [B, P]`` are its output tokens ``first[b] + j``
        (capturable; setting them twice is harmless)."""
        j = torch.arange(tokens.shape[1], device=tokens.device)[None, :]  # [1, P]
        at = torch.where(j < lengths[:, None], first[:, None] + j, self.width).clamp(max=self.width)  # [B, P]
        self.history[slots[:, None].expand_as(tokens), at] = tokens.clamp(min=0)
