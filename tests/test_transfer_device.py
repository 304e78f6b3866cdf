"""Page moves on a buffer in device memory (the vLLM worker path on GPUs): byte-exact both ways."""

import numpy as np
import pytest
import torch

from kvoffload import open_store
from kvoffload.connectors.transfer import HostTransfer, TorchTransfer
from kvoffload.spec import CacheGroup, GroupKind, Region

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _group():
    # two layers, used bytes smaller than the page (padding must not travel), a second region elsewhere
    regions = (Region(0, 0, 4096, 16384, ("a", "b"), 3000, 4096, "uint8"),
               Region(0, 8192, 1024, 16384, ("c",), 1000, 1024, "uint8"))
    return CacheGroup(0, "g", GroupKind.PAGED, 16, regions)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_transfer_round_trip_matches_host_transfer(device):
    group = _group()
    source = torch.randint(0, 256, (8 * 16384,), dtype=torch.uint8)
    host_page = HostTransfer(source.clone()).gather(group, 3)
    device_buffer = source.to(device)
    page = TorchTransfer(device_buffer).gather(group, 3)
    assert page.nbytes == group.used_bytes_per_block == 7000
    assert np.array_equal(page, host_page)
    target = torch.zeros_like(device_buffer)
    TorchTransfer(target).scatter(group, 5, page)
    moved = target.cpu().numpy()
    for offset, n in [(5 * 16384, 3000), (5 * 16384 + 4096, 3000), (5 * 16384 + 8192, 1000)]:
        assert moved[offset:offset + n].any()
    assert np.array_equal(HostTransfer(target.cpu()).gather(group, 5), host_page)
    assert not moved[5 * 16384 + 3000:5 * 16384 + 4096].any()  # padding untouched
    store = open_store("memory://?capacity=1MiB&pinned=false")
    assert TorchTransfer(device_buffer).save(store, [(b"k", group, 3)]) == [True]
    fresh = torch.zeros_like(device_buffer)
    assert TorchTransfer(fresh).load(store, [(b"k", group, 1), (b"missing", group, 2)]) == [True, False]
    assert np.array_equal(TorchTransfer(fresh).gather(group, 1), host_page)
