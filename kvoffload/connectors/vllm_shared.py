"""TEMPORARY re-export shim: the scheduler/worker messages moved to `vllm_messages` (issue 25, item 4).
Only `vllm_scheduler.py` and `vllm_worker.py` still import this name; delete this file once they import
`.vllm_messages`."""

from .vllm_messages import KVOffloadMetadata, LoadJob, PrefetchJob, SaveJob, StoredPages

__all__ = ["KVOffloadMetadata", "LoadJob", "PrefetchJob", "SaveJob", "StoredPages"]
