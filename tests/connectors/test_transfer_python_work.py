"""The Python a save and a load run on the transfer thread is a constant per batch, not a step per page:
while it runs, the engine's own thread waits for the GIL. Counted in bytecodes (`sys.settrace`'s opcode
events, every frame the call enters: the transfer's, the store's, numpy's Python layer) over a whole
`DeviceTransfer.save` and `load` of 512 pages and of 64, each one staging batch, on the GPU's code path (a
CPU buffer runs it, `device_transfer`). The 448 pages more may cost no more than a few bytecodes in all."""

import sys
from collections import Counter

import pytest
import torch

from kvoffload import open_store
from kvoffload.connectors.device_transfer import DeviceTransfer
from kvoffload.connectors.plan import Page
from kvoffload.spec import CacheGroup, GroupKind, Region

STRIDE = 4096
# two layers of 1,500 used bytes in a 4 KiB block: a page is two spans, 3,000 bytes
GROUP = CacheGroup(0, "g", GroupKind.PAGED, 16, (Region(0, 0, 2048, STRIDE, ("a", "b"), 1500, 2048, "uint8"),))
FEW, MANY = 64, 512
PER_PAGE = 0.1  # bytecodes per extra page at most (the arena's 16 MiB chunks hold every page: one run each)


def _bytecodes(call) -> tuple[Counter, object]:
    """Bytecodes run by `call()` on this thread, per function (file, name, first line)."""
    counts: Counter = Counter()

    def local(frame, event, arg):
        if event == "opcode":
            code = frame.f_code
            counts[(code.co_filename.rsplit("/", 1)[-1], code.co_name, code.co_firstlineno)] += 1
        return local

    def enter(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    sys.settrace(enter)
    try:
        result = call()
    finally:
        sys.settrace(None)
    return counts, result


def _per_page_excess(few: Counter, many: Counter) -> str:
    grown = {k: many[k] - few.get(k, 0) for k in many if many[k] - few.get(k, 0) > 8}
    return ", ".join(f"{name}@{file}:{line} +{n}" for (file, name, line), n in sorted(grown.items(), key=lambda x: -x[1]))


@pytest.mark.parametrize(
    "url, directions",
    [
        ("memory://?capacity=256MiB&pinned=false&reserve=true", ("save", "load")),
        # a tiered save also queues each value for its write-behind (a lease and a queue entry per page)
        ("tiered://?memory=256MiB&pinned=false&reserve=true&lmdb={tmp}/lmdb&lmdb_capacity=1GiB", ("load",)),
    ],
)
def test_python_work_of_a_save_and_a_load_is_a_constant_per_batch(tmp_path, url, directions):
    cache = torch.randint(0, 256, ((MANY + 1) * STRIDE,), dtype=torch.uint8)
    transfer = DeviceTransfer(cache)
    store = open_store(url.format(tmp=tmp_path))
    try:
        warm = [Page(f"warm{b}".encode(), GROUP, b, b) for b in range(MANY)]  # staging slots at full size
        assert all(transfer.save(store, warm)) and all(transfer.load(store, warm))
        counted = {}
        for n in (FEW, MANY):
            pages = [Page(f"p{n}-{b}".encode(), GROUP, b, b) for b in range(n)]
            saved, ok = _bytecodes(lambda pages=pages: transfer.save(store, pages))
            assert ok == [True] * n
            loaded, ok = _bytecodes(lambda pages=pages: transfer.load(store, pages))
            assert ok == [True] * n
            counted[n] = {"save": saved, "load": loaded}
        for direction in directions:
            few, many = counted[FEW][direction], counted[MANY][direction]
            extra = sum(many.values()) - sum(few.values())
            assert extra <= PER_PAGE * (MANY - FEW), (
                f"{direction}: {extra} bytecodes more for {MANY - FEW} pages more: {_per_page_excess(few, many)}"
            )
        restored = torch.zeros_like(cache)
        assert all(DeviceTransfer(restored).load(store, warm))
        for layer_at in (0, 2048):  # each block's two spans restored, byte for byte
            spans = slice(layer_at, layer_at + 1500)
            assert torch.equal(restored.view(-1, STRIDE)[:MANY, spans], cache.view(-1, STRIDE)[:MANY, spans])
    finally:
        store.close()
