"""On a CUDA machine the memory tier holds pinned pages, so device copies need no staging hop."""

import numpy as np
import pytest
import torch

from kvoffload import open_store

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device")


@cuda
def test_pages_are_pinned_and_round_trip_through_the_device():
    store = open_store("memory://?capacity=256MiB")
    assert store.stats()["pinned"] == 1
    page = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
    assert store.put(b"page", page.cpu())
    lease = store.acquire([b"page"])[0]
    held = torch.from_numpy(lease.view)
    assert held.is_pinned()
    back = held.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    store.release([lease])
    assert torch.equal(back, page)
    out = torch.empty(4 << 20, dtype=torch.uint8).pin_memory()
    assert store.get_into(b"page", out) == 4 << 20
    assert torch.equal(out.cuda(), page)


def test_pinning_can_be_turned_off():
    store = open_store("memory://?capacity=1MiB&pinned=false")
    assert store.stats()["pinned"] == 0
    assert store.put(b"k", np.arange(10, dtype=np.uint8))
    assert store.get(b"k") == bytes(range(10))
