"""Test support: transformers' `Glm5NextTextModel` plus the LM head as the numerical oracle.

One semantic difference is bridged here, on purpose: on exactly equal scores `torch.topk` returns an
implementation-defined member of the tie, while the runner (like any engine that must give equal cold
and warm runs) breaks ties by the lower index. Ties are frequent in the DSA indexer with few heads,
because ReLU zeroes whole pool scores. The oracle therefore runs with a stable top-k; every other
operation is transformers' own."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

_sort = torch.sort


def _stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):  # noqa: A002 - torch's signature
    values, indices = _sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def stable_topk():
    with mock.patch.object(torch.Tensor, "topk", _stable_topk), mock.patch.object(torch, "topk", _stable_topk):
        yield


class Oracle:
    def __init__(self, checkpoint_dir: str, lm_head: torch.Tensor):
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        self.model = Glm5NextTextModel.from_pretrained(checkpoint_dir).eval()
        self.lm_head = lm_head

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with stable_topk():
            hidden = self.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
        return hidden @ self.lm_head.T

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]
