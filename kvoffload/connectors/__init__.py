"""WHO moves bytes and WHEN: `plan` (which pages of a request to save or load), `transfer` (moving
them between a cache buffer and a store), `offloader` (the engine-facing API over both), and thin
adapters for engines: `runner` (the bundled GLM runner) and `vllm` (vLLM's KV connector API: the
`KVOffloadConnector` facade in `vllm`, over its scheduler half `vllm_scheduler` and worker half
`vllm_worker`)."""

from .offloader import LoadResult, Offloader
from .plan import Page, hit_blocks, pages_for_load, pages_for_save
from .transfer import Transfer

__all__ = ["LoadResult", "Offloader", "Page", "Transfer", "hit_blocks", "pages_for_load", "pages_for_save"]
