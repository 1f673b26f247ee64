"""Per-slot token state on the device for logit adjustments (``flashtree/penalties.py``).

Made when the first request that needs it (min_tokens, a penalty) arrives; from then on every
request that starts in a slot resets the slot's row (neutral settings unless it asks), and rounds
that hold an adjusting row add their emitted tokens to the counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtree.device_copy import to_device
from flashtree.engine.request import Request
from flashtree.penalties import SlotAdjustments


class SlotTokenState:
    def __init__(self, max_slots: int, vocab: int, device: torch.device):
        self.device, self.vocab = device, vocab
        self.counts = torch.zeros(max_slots, vocab, dtype=torch.int32, device=device)  # [S, V]
        self.prompt = torch.zeros(max_slots, vocab, dtype=torch.bool, device=device)  # [S, V] prompt tokens
        self.stop_mask = torch.zeros(max_slots, vocab, dtype=torch.bool, device=device)  # [S, V]
        self.min_tokens = torch.zeros(max_slots, dtype=torch.long, device=device)  # [S]
        self.settings = torch.zeros(3, max_slots, dtype=torch.float32, device=device)  # [3, S] presence, frequency, repetition
        self.settings[2] = 1.0

    def start(self, requests: Sequence[Request]) -> None:
        """Reset the slots of requests starting their prefill: counts empty, the prompt seen, their
        stop tokens and settings (neutral for a request that adjusts nothing)."""
        for req in requests:
            p = req.params
            slot = req.slot
            self.counts[slot] = 0
            self.prompt[slot] = False
            self.stop_mask[slot] = False
            if p.adjusts:
                self.prompt[slot, self._ids(req.prompt_ids)] = True
                self.stop_mask[slot, self._ids(sorted(t for t in req.stop_token_ids if t < self.vocab))] = True
        slots = [r.slot for r in requests]
        values = [[r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty] for r in requests]
        self.min_tokens[self._ids(slots)] = self._ids([r.params.min_tokens for r in requests])
        self.settings[:, self._ids(slots)] = to_device(torch.tensor(values, dtype=torch.float32).T, self.device)

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        return to_device(torch.tensor(list(values), dtype=torch.long), self.device)

    def gather(self, slots: torch.Tensor) -> SlotAdjustments:
        """The rows' state ``[B, ...]`` (capturable)."""
        settings = self.settings[:, slots]  # [3, B]
        counts = self.counts[slots]  # [B, V]
        return SlotAdjustments(counts, self.prompt[slots] | (counts > 0), self.stop_mask[slots], self.min_tokens[slots],
                               settings[0], settings[1], settings[2])

    def count(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Add each row's first ``lengths[b]`` of ``tokens [B, P]`` (emitted output) to its slot's
        counts (capturable)."""
        emitted = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]  # [B, P]
        rows = slots[:, None].expand_as(tokens)
        ids = tokens.clamp(min=0)
        self.counts.index_put_((rows, ids), emitted.int(), accumulate=True)
