"""Requests through a decoder's slots, as a server runs them: each joins with its prompt, every running
one takes its greedy token each step, and each leaves once it has the tokens it wanted."""

from __future__ import annotations

from typing import Any

import torch


class Requests:
    def __init__(self, dec: Any, prompts: dict[str, torch.Tensor], wanted: dict[str, int]) -> None:
        self.dec, self.prompts, self.wanted = dec, prompts, wanted
        self.got: dict[str, list[int]] = {}  # each request's tokens so far
        self.slot_of: dict[str, int] = {}  # the running ones' slots

    def join(self, name: str) -> None:
        (slot,), logits = self.dec.join(self.prompts[name])
        self.slot_of[name], self.got[name] = slot, [int(logits[0].argmax())]

    def step(self) -> None:
        running = {slot: n for n, slot in self.slot_of.items()}
        order = [running[r] for r in self.dec.slots]
        logits = self.dec.decode(torch.tensor([self.got[n][-1] for n in order]))
        for n, row in zip(order, logits):
            self.got[n].append(int(row.argmax()))
        for n in order:
            if len(self.got[n]) == self.wanted[n]:
                self.dec.leave(self.slot_of.pop(n))
