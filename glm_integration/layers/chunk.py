"""What a layer needs to know about the tokens it is computing: their positions and where the
request's pages are."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    start: int  # first position computed now
    end: int  # one past the last
    blocks: tuple[int, ...]  # the request's block table: block i holds positions [i*B, (i+1)*B)
    tail_block: int  # the request's kpool tail ring block
    block_size: int
    decode: bool = False  # one token continuing a sequence: recurrent KDA, absorbed MLA
    device: torch.device = torch.device("cpu")  # where the cache lives: index tensors are made there

    @property
    def length(self) -> int:
        return self.end - self.start

    def block_of(self, position: int) -> int:
        return self.blocks[position // self.block_size]

    def row_blocks(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical block, row in block) for positions [start, end)."""
        pos = torch.arange(start, end, device=self.device)
        return self.table()[pos // self.block_size], pos % self.block_size

    def table(self) -> torch.Tensor:
        return torch.tensor(self.blocks, dtype=torch.long, device=self.device)
