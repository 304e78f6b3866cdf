"""The staged device transfer (the GPU path; its logic also runs on a CPU buffer): byte-exact pages both
ways, equal to the host transfer's, across several staging batches, with misses never scattered."""


import numpy as np
import pytest
import torch

from kvoffload import open_store
from kvoffload.connectors import batch_plan
from kvoffload.connectors.device_transfer import STAGING_SLOTS, DeviceTransfer, on_stream
from kvoffload.connectors.plan import Page
from kvoffload.connectors.span_copy import PageCopier, word_size
from kvoffload.connectors.transfer import HostTransfer, Transfer, make_transfer
from kvoffload.spec import CacheGroup, GroupKind, Region

GPU = torch.cuda.is_available()
try:
    import triton  # noqa: F401
    TRITON = GPU
except ImportError:
    TRITON = False
# (device, use the Triton span copy): the batched-copy path everywhere, the Triton kernel on a GPU
PATHS = [("cpu", False)] + ([("cuda", False)] if GPU else []) + ([("cuda", True)] if TRITON else [])
STRIDE = 16384
KiB = 1024


def _groups():
    # used bytes smaller than the page (padding must not travel), a second region elsewhere in the block,
    # and a group whose spans are only 4-byte aligned
    paged = CacheGroup(0, "g", GroupKind.PAGED, 16, (Region(0, 0, 4096, STRIDE, ("a", "b"), 3000, 4096, "uint8"),
                                                     Region(0, 8192, 1024, STRIDE, ("c",), 1000, 1024, "uint8")))
    state = CacheGroup(1, "s", GroupKind.STATE, 16, (Region(0, 12292, 1000, STRIDE, ("d", "e"), 996, 1000, "uint8"),))
    return paged, state


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _transfer(buffer, use_triton, **options):
    return DeviceTransfer(buffer, use_triton=use_triton, **options)


@pytest.mark.parametrize("pinned", ["false", "auto"])  # auto: pinned arena slots on a GPU machine
@pytest.mark.parametrize("device,use_triton", PATHS)
def test_pages_round_trip_byte_exact_across_staging_batches(device, use_triton, pinned):
    paged, state = _groups()
    source = torch.randint(0, 256, (32 * STRIDE,), dtype=torch.uint8)
    host = HostTransfer(source.clone())
    items = [Page(f"k{g.name}{b}".encode(), g, b, b) for b in range(3, 20) for g in (paged, state)]
    # a staging slot of ~3 pages: many batches, both slots reused, one page larger than nothing else fits
    transfer = _transfer(source.to(device), use_triton, staging_bytes=3 * paged.used_bytes_per_block)
    assert len(batch_plan.batches(items, transfer.staging_bytes)) > 4
    store = open_store(f"memory://?capacity=4MiB&pinned={pinned}")
    assert transfer.save(store, items) == [True] * len(items)
    for p in items:
        assert bytes(store.get(p.key)) == host.gather(p.group, p.block).tobytes()

    target = torch.zeros(32 * STRIDE, dtype=torch.uint8, device=device)
    loader = _transfer(target, use_triton, staging_bytes=3 * paged.used_bytes_per_block)
    moved = [p._replace(block=p.block + 8) for p in items]  # into other blocks
    assert loader.load(store, moved) == [True] * len(items)
    for p, into in zip(items, moved):
        assert np.array_equal(loader.gather(p.group, into.block), host.gather(p.group, p.block))
    copied = target.cpu().numpy()
    assert not copied[11 * STRIDE + 3000:11 * STRIDE + 4096].any()  # padding never travels
    assert not copied[:11 * STRIDE].any()  # blocks below the targets untouched


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_a_load_of_several_batches_advises_the_store_of_its_pages_first(device, use_triton):
    """A disk tier reads the later batches while the first ones move: the whole load's keys are advised
    once, in the order they are read, before the first read; a load of one batch is not advised."""
    paged, state = _groups()
    source = torch.randint(0, 256, (32 * STRIDE,), dtype=torch.uint8)
    items = [Page(f"k{g.name}{b}".encode(), g, b, b) for b in range(3, 12) for g in (paged, state)]
    store = open_store("memory://?capacity=4MiB&pinned=auto")
    assert all(_transfer(source.to(device), use_triton).save(store, items))
    calls: list[tuple[str, list[bytes]]] = []
    store.advise = lambda keys: calls.append(("advise", list(keys)))  # type: ignore[method-assign]
    for name in ("acquire_batch", "read_many"):

        def spy(keys, *args, real=getattr(store, name), name=name, **kwargs):
            calls.append((name, list(keys)))
            return real(keys, *args, **kwargs)

        setattr(store, name, spy)
    target = torch.zeros(32 * STRIDE, dtype=torch.uint8, device=device)
    loader = _transfer(target, use_triton, staging_bytes=3 * paged.used_bytes_per_block)
    assert all(loader.load(store, items))
    assert calls[0][0] == "advise" and [c for c, _ in calls].count("advise") == 1
    read = [key for name, keys in calls[1:] for key in keys]
    assert calls[0][1] == read and sorted(read) == sorted(p.key for p in items)  # the read order, every page
    host = HostTransfer(source)
    assert all(np.array_equal(loader.gather(p.group, p.block), host.gather(p.group, p.block)) for p in items)
    calls.clear()
    assert all(_transfer(target, use_triton).load(store, items[:2]))  # one batch
    assert "advise" not in [c for c, _ in calls]


def test_batches_fit_the_staging_bytes_and_take_at_most_batch_pages(monkeypatch):
    """Greedy batches: as many pages as fit a slot (a larger page alone), and at most BATCH_PAGES so
    that small pages' host work overlaps the neighbouring batch's DMA; every page in exactly one."""
    monkeypatch.setattr(batch_plan, "BATCH_PAGES", 5)
    rng = np.random.default_rng(7)
    for _ in range(300):
        sizes = rng.integers(1, 1500, rng.integers(0, 40))
        cuts = batch_plan.cuts(sizes, 1000)
        assert cuts[0] == 0 and cuts[-1] == len(sizes) and all(a < b for a, b in zip(cuts, cuts[1:]))
        for a, b in zip(cuts, cuts[1:]):
            assert b - a <= 5 and (b - a == 1 or sizes[a:b].sum() <= 1000)
            if b < len(sizes) and b - a < 5:  # cut early only where the next page would not fit
                assert sizes[a : b + 1].sum() > 1000


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_misses_and_wrong_sized_pages_are_not_scattered(device, use_triton):
    paged, state = _groups()
    source = torch.randint(1, 256, (8 * STRIDE,), dtype=torch.uint8)
    store = open_store("memory://?capacity=1MiB&pinned=false")
    _transfer(source.to(device), use_triton).save(store, [Page(b"good", paged, 0, 1)])
    store.put(b"short", b"\x07" * (state.used_bytes_per_block - 4))  # a page of another size
    target = torch.zeros(8 * STRIDE, dtype=torch.uint8, device=device)
    loader = _transfer(target, use_triton)
    pages = [Page(b"good", paged, 0, 2), Page(b"missing", paged, 0, 3), Page(b"short", state, 0, 4)]
    assert loader.load(store, pages) == [True, False, False]
    copied = target.cpu().numpy()
    assert np.array_equal(loader.gather(paged, 2), HostTransfer(source).gather(paged, 1))
    assert not copied[3 * STRIDE:5 * STRIDE].any()


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_single_page_gather_scatter_and_size_check(device, use_triton):
    paged, state = _groups()
    buffer = torch.zeros(4 * STRIDE, dtype=torch.uint8, device=device)
    transfer = _transfer(buffer, use_triton)
    page = np.arange(state.used_bytes_per_block, dtype=np.int64).astype(np.uint8)
    transfer.scatter(state, 2, page)
    assert np.array_equal(transfer.gather(state, 2), page)
    with pytest.raises(ValueError, match="page is"):
        transfer.scatter(state, 1, page[:-1])


def test_word_size_is_the_widest_dividing_type():
    assert word_size(np.array([0, 16384]), np.array([3000, 1000])) == 8
    assert word_size(np.array([12292]), np.array([996])) == 4
    assert word_size(np.array([3]), np.array([8])) == 1


def test_make_transfer_picks_by_device():
    assert isinstance(make_transfer(torch.zeros(64, dtype=torch.uint8)), HostTransfer)
    with pytest.raises(ValueError, match="needs triton and a GPU"):
        PageCopier(torch.zeros(64, dtype=torch.uint8), use_triton=True)
    if GPU:
        assert isinstance(make_transfer(torch.zeros(64, dtype=torch.uint8, device="cuda")), DeviceTransfer)


def test_both_transfers_are_a_transfer():
    """The offloader and its jobs see only the `Transfer` protocol: both transfers implement all of it,
    and say whether their copies run on device streams."""
    host = HostTransfer(torch.zeros(64, dtype=torch.uint8))
    device = DeviceTransfer(torch.zeros(64, dtype=torch.uint8))  # the device engine on a CPU buffer
    assert isinstance(host, Transfer) and isinstance(device, Transfer)
    assert host.gpu is False and device.gpu is False
    assert host.fence() is None and device.fence() is None
    assert not isinstance(object(), Transfer)


@pytest.mark.skipif(not GPU, reason="streams exist on a GPU only")
def test_on_stream_queues_on_the_stream_and_gives_the_previous_one_back_after_an_error():
    torch.cuda.synchronize()
    before = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with on_stream(side):
        assert torch.cuda.current_stream() == side
        torch.cuda._sleep(50_000_000)  # queued on `side`: the compute stream stays free
        marker = torch.cuda.Event()
        marker.record()
    assert torch.cuda.current_stream() == before
    assert not side.query() and before.query()  # the sleep ran on `side`, not on the compute stream
    marker.synchronize()
    with pytest.raises(RuntimeError, match="inside"):
        with on_stream(side):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream() == before


@pytest.mark.skipif(not GPU, reason="stream ordering needs a GPU")
def test_streams_order_saves_after_compute_and_compute_after_loads():
    paged, _ = _groups()
    n = paged.used_bytes_per_block
    buffer = torch.zeros(8 * STRIDE, dtype=torch.uint8, device="cuda")
    transfer = DeviceTransfer(buffer)
    store = open_store("memory://?capacity=1MiB&pinned=false")
    torch.cuda._sleep(100_000_000)  # keep the compute stream busy: a save that does not wait reads zeros
    buffer.fill_(7)
    assert transfer.save(store, [Page(b"written", paged, 0, 1)]) == [True]
    assert bytes(store.get(b"written")) == b"\x07" * n
    store.put(b"nines", b"\x09" * n)
    torch.cuda._sleep(100_000_000)
    assert transfer.load(store, [Page(b"nines", paged, 0, 2)]) == [True]
    seen = buffer[2 * STRIDE:2 * STRIDE + 3000].clone()  # compute after the load must see it
    assert bool((seen == 9).all())


def test_adjacent_arena_slots_move_in_one_copy():
    from kvoffload.connectors.host_runs import runs as _runs

    base = np.zeros(64, dtype=np.uint8).ctypes.data
    addresses = [base, base + 8, 0, base + 32, base + 40]  # 0: a page with no slot
    sizes, offsets = np.array([8, 8, 8, 8, 4]), np.array([0, 8, 16, 24, 40])
    # adjacent in the arena and in staging: one run; a gap in either breaks it
    assert _runs(addresses, sizes, offsets) == [(base, 0, 16), (base + 32, 24, 8), (base + 40, 40, 4)]
    assert _runs([0, 0], sizes[:2], offsets[:2]) == []
    # pages smaller than their slots (room): joined where the step is the same in host memory and in
    # staging and lies within the first page's slot; never across a step beyond it or inside a page
    addresses = [base, base + 16, base + 32, base + 48]
    sizes, offsets = np.array([10, 10, 10, 10]), np.array([0, 16, 32, 40])
    room = np.array([16, 16, 16, 16])
    assert _runs(addresses, sizes, offsets) == [(base, 0, 10), (base + 16, 16, 10), (base + 32, 32, 10), (base + 48, 40, 10)]
    assert _runs(addresses, sizes, offsets, room) == [(base, 0, 42), (base + 48, 40, 10)]
    assert _runs(addresses, sizes, offsets, np.array([12, 16, 16, 16])) == [(base, 0, 10), (base + 16, 16, 26), (base + 48, 40, 10)]
    # every page joined (one run, the last page's own size ends it), and a lone page
    assert _runs(addresses[:3], sizes[:3], offsets[:3], room[:3]) == [(base, 0, 42)]
    assert _runs(addresses[:1], sizes[:1], offsets[:1]) == [(base, 0, 10)]
    assert _runs(np.array([base, base + 8]), np.array([8, 0]), np.array([0, 8])) == [(base, 0, 8)]  # size 0: skipped


def test_a_run_of_slots_never_crosses_from_one_chunk_into_the_next():
    """Chunks are separate host allocations: one copy over two of them fails on CUDA even where they lie
    next to each other. Pages in slots adjacent within a chunk join; across a chunk's end they do not."""
    from kvoffload.connectors.host_runs import runs as _runs
    from kvoffload.store import MemoryStore

    memory = np.zeros(256 * KiB, dtype=np.uint8)
    store = MemoryStore(memory.nbytes, pinned=False, chunk_bytes=16 * KiB, reserve=False)  # 2 slots a chunk
    carved = [0]

    def allocate(n: int) -> np.ndarray:  # chunks back to back in one stretch of host memory
        carved.append(carved[-1] + n)
        return memory[carved[-2] : carved[-1]]

    store._arena.allocate = allocate
    reservation = store.reserve([(b"k%d" % i, 7000) for i in range(8)])
    addresses = reservation.addresses
    assert addresses.tolist() == [memory.ctypes.data + 8192 * i for i in range(8)]  # one adjacent stretch
    assert reservation.room.tolist() == [8192, 0] * 4  # each chunk's second slot ends it
    staged = np.arange(8) * 8192
    assert _runs(addresses, np.full(8, 7000), staged, reservation.room) == [
        (memory.ctypes.data + 2 * 8192 * c, 2 * 8192 * c, 8192 + 7000) for c in range(4)
    ]
    assert store.publish(reservation, [True] * 8) == [True] * 8
    held = store.acquire_batch([b"k%d" % i for i in range(8)])
    assert held.room.tolist() == [8192, 0] * 4
    store.release_batch(held)


def test_the_arena_says_its_slots_addresses():
    """The in-place paths take host addresses from the arena (no numpy lookup per page): they must be
    the very addresses of the views it hands out, for reservations and leases alike."""
    store = open_store("memory://?capacity=1MiB")
    keys = [b"a", b"b", b"c"]
    reservation = store.reserve([(k, 5000) for k in keys])
    assert reservation.addresses is not None
    addresses = reservation.addresses.tolist()
    assert addresses == [view.ctypes.data for view in reservation.destinations]
    assert reservation.filled_all() == [True] * 3
    assert store.publish(reservation, [True] * 3) == [True] * 3
    leases = store.acquire(keys + [b"missing"])
    assert [lease.address for lease in leases[:3]] == addresses and leases[3] is None
    assert all(lease.address == lease.view.ctypes.data for lease in leases[:3])
    store.release(leases)
    # a batch held by address: the same addresses, a miss at 0, held until released (once)
    held = store.acquire_batch([b"b", b"missing", b"a", b"b"])
    assert held.addresses.tolist() == [addresses[1], 0, addresses[0], addresses[1]]
    assert held.sizes.tolist() == [5000, 0, 5000, 5000]
    assert store.stats()["held"] == 2
    store.release_batch(held)
    assert store.stats()["held"] == 0
    with pytest.raises(ValueError, match="released twice"):
        store.release_batch(held)


@pytest.mark.skipif(not GPU, reason="a background save's fence needs a GPU")
def test_background_save_after_a_fence_reads_what_compute_wrote():
    import threading

    paged, _ = _groups()
    buffer = torch.zeros(8 * STRIDE, dtype=torch.uint8, device="cuda")
    transfer = DeviceTransfer(buffer)
    store = open_store("memory://?capacity=1MiB")
    torch.cuda._sleep(100_000_000)
    buffer.fill_(5)
    fence = transfer.fence()  # taken on the engine's thread, after the compute that writes the block
    result = []
    page = Page(b"k", paged, 0, 1)
    worker = threading.Thread(target=lambda: result.append(transfer.save(store, [page], after=fence)))
    worker.start()
    worker.join(timeout=60)
    assert result == [[True]]
    assert bytes(store.get(b"k")) == b"\x05" * paged.used_bytes_per_block


def test_each_group_moves_in_the_widest_word_its_spans_allow():
    """A group's page template moves in the widest word dividing its spans (the 4-byte aligned state
    group in 4-byte words, the other in 8): the warm start makes the kernel of each group's word."""
    paged, state = _groups()
    transfer = DeviceTransfer(torch.zeros(32 * STRIDE, dtype=torch.uint8))
    assert transfer.copier.template(paged).word == 8
    assert transfer.copier.template(state).word == 4
    assert transfer.copier.template(paged).last_block == 31  # the buffer's 32 blocks
    assert transfer.warm_up([paged, state]) >= 0 and transfer.warm_up_s is not None
    assert transfer._slots == {}  # the CPU path has no staging to make


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_a_page_outside_either_buffer_is_refused_before_anything_moves(device, use_triton):
    paged, _ = _groups()
    source = torch.zeros(4 * STRIDE, dtype=torch.uint8, device=device)
    copier = PageCopier(source, use_triton)
    staging = torch.zeros(4 * 8192, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="outside the cache buffer"):
        copier.move(paged, np.array([0, 4]), np.array([0, 8192]), staging, gather=True)
    with pytest.raises(ValueError, match="outside the staging buffer"):
        copier.move(paged, np.array([0, 1]), np.array([0, 3 * 8192 + 4096]), staging, gather=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        copier.move(paged, np.array([0]), np.array([4]), staging, gather=True)
    assert not staging.any()


@pytest.mark.skipif(not GPU, reason="staging and kernels exist on a GPU only")
@pytest.mark.parametrize("use_triton", [False] + ([True] if TRITON else []))
def test_after_warm_up_the_first_save_and_load_make_nothing(use_triton):
    """The first restore of a process runs on what the warm start made: the same staging slots and tile
    tables (no page-locking on the first request), and the pages arrive byte for byte."""
    paged, state = _groups()
    source = torch.randint(0, 256, (32 * STRIDE,), dtype=torch.uint8, device="cuda")
    transfer = _transfer(source, use_triton, staging_bytes=3 * paged.used_bytes_per_block)
    transfer.warm_up([paged, state])
    made = {where: (slot, slot.host.data_ptr(), slot.table.host.data_ptr()) for where, slot in transfer._slots.items()}
    assert set(made) == {(d, i) for d in ("save", "load") for i in range(STAGING_SLOTS)}
    items = [Page(f"k{g.name}{b}".encode(), g, b, b) for b in range(3, 20) for g in (paged, state)]
    store = open_store("memory://?capacity=4MiB&pinned=auto")
    before = HostTransfer(source.cpu())
    assert transfer.save(store, items) == [True] * len(items)
    moved = [p._replace(block=p.block + 8) for p in items]
    assert transfer.load(store, moved) == [True] * len(items)
    torch.cuda.synchronize()
    after = HostTransfer(source.cpu())
    for p, into in zip(items, moved):
        assert bytes(store.get(p.key)) == before.gather(p.group, p.block).tobytes()
        assert np.array_equal(after.gather(into.group, into.block), before.gather(p.group, p.block))
    assert {where: (slot, slot.host.data_ptr(), slot.table.host.data_ptr())
            for where, slot in transfer._slots.items()} == made


@pytest.mark.skipif(not TRITON, reason="the page table is the Triton kernel's")
@pytest.mark.parametrize("table_kind", ["mapped", "uploaded", "unreadable"])
def test_page_tables_read_in_host_memory_uploaded_or_falling_back_move_the_same_bytes(table_kind):
    """The kernel reads a slot's page table in page-locked host memory; a table the device cannot read
    (here: pageable memory, which Triton refuses at launch) falls back to an upload, and so does a
    table made for one move. Every way moves the pages byte for byte, long spans cut in many tiles, and
    rows from an offset in the table."""
    from kvoffload.connectors.span_copy import TILE_WORDS, PageTable

    long = CacheGroup(
        2,
        "long",
        GroupKind.PAGED,
        16,
        (
            Region(0, 8, 1_200_000, 2_400_000, ("a", "b"), 1_000_000, 1_200_000, "uint8"),  # 4 tiles each
            Region(0, 2_300_000, 8, 2_400_000, ("c",), 8, 8, "uint8"),
        ),
    )
    assert 3 * TILE_WORDS * 8 < 1_000_000 < 4 * TILE_WORDS * 8
    source = torch.randint(0, 256, (6 * 2_400_000,), dtype=torch.uint8, device="cuda")
    host = HostTransfer(source.cpu())
    staging = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    copier = PageCopier(source, use_triton=True)
    assert copier.template(long).word == 8 and len(copier.template(long).tiles) == 9
    blocks, at = np.array([5, 1, 2]), np.array([0, 2 << 20, 4 << 20])
    table = PageTable(source.device, mapped=table_kind != "uploaded")
    if table_kind == "unreadable":
        table.reserve(64)
        table.host = torch.empty((table.rows, 2), dtype=torch.int64)  # pageable: not mapped into the device
    copier.move(long, blocks, at, staging, table, 5, gather=True)
    torch.cuda.synchronize()
    assert table.mapped == (table_kind == "mapped")
    n = long.used_bytes_per_block
    for b, a in zip(blocks, at):
        assert np.array_equal(staging[a : a + n].cpu().numpy(), host.gather(long, b))
    back = torch.zeros_like(source)
    PageCopier(back, use_triton=True).move(long, blocks, at, staging, None, gather=False)  # a table of its own
    torch.cuda.synchronize()
    after = HostTransfer(back.cpu())
    for b in blocks:
        assert np.array_equal(after.gather(long, b), host.gather(long, b))
    assert int(back.count_nonzero()) <= 3 * n  # nothing outside the pages was written


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_interleaved_groups_move_in_runs_and_answer_in_the_callers_order(device, use_triton, monkeypatch):
    """Every group's page of a block, block after block: each group's pages are moved together, so the
    arena's adjacent slots go in one copy per run (not one per page), and the outcomes (misses among
    them) still come back in the caller's order, the bytes in their own blocks."""
    from kvoffload.connectors import device_transfer as dt

    paged, state = _groups()
    source = torch.randint(0, 256, (48 * STRIDE,), dtype=torch.uint8, device=device)
    transfer = _transfer(source, use_triton)
    from kvoffload.store import MemoryStore

    store = MemoryStore(8 << 20, chunk_bytes=2 << 20)  # a chunk per size class, slots taken in order
    items = [Page(f"k{g.name}{b}".encode(), g, b, b) for b in range(20) for g in (paged, state)]
    copies = []
    real_runs = dt.runs
    monkeypatch.setattr(dt, "runs", lambda *a: copies.append(real_runs(*a)) or copies[-1])
    assert transfer.save(store, items) == [True] * len(items)
    batches = len(batch_plan.batches(items, transfer.staging_bytes))
    assert sum(map(len, copies)) <= 2 * batches  # a run per group and batch at most
    before = HostTransfer(source.cpu())
    for p in items:
        assert bytes(store.get(p.key)) == before.gather(p.group, p.block).tobytes()
    store.delete(items[7].key)
    store.delete(items[30].key)
    copies.clear()
    source[24 * STRIDE :] = 0  # where the load puts them
    moved = [p._replace(block=p.block + 24) for p in items]
    ok = transfer.load(store, moved)
    assert ok == [i not in (7, 30) for i in range(len(items))]
    assert sum(map(len, copies)) <= 2 * batches + 4  # a miss breaks a run in two
    _sync(device)
    after = HostTransfer(source.cpu())
    for i, (p, into) in enumerate(zip(items, moved)):
        if ok[i]:
            assert np.array_equal(after.gather(into.group, into.block), before.gather(p.group, p.block))
        else:
            assert not after.gather(into.group, into.block).any()


def test_a_calls_largest_pages_move_first_and_outcomes_keep_the_callers_order():
    """Pages of several sizes, a block's small page before its large one (a restore's MLA pages before its
    KDA checkpoint): grouped with the largest pages first, so the call's first copy is a long one; the
    outcomes come back in the caller's order. Pages already in that order are not permuted."""
    small = CacheGroup(0, "g", GroupKind.PAGED, 16, (Region(0, 0, 1024, STRIDE, ("a",), 1000, 1024, "uint8"),))
    large = CacheGroup(1, "big", GroupKind.STATE, 16, (Region(0, 4096, 4096, STRIDE, ("b", "c"), 4096, 4096, "uint8"),))
    assert large.used_bytes_per_block > small.used_bytes_per_block
    source = torch.randint(0, 256, (8 * STRIDE,), dtype=torch.uint8)
    transfer = _transfer(source, False)
    items = [Page(f"k{g.name}{b}".encode(), g, b, b) for b in range(4) for g in (small, large)]
    columns, order = batch_plan.grouped(items)
    grouped = batch_plan.permuted(items, order)
    assert [p.group.name for p in grouped] == ["big"] * 4 + ["g"] * 4
    assert [p.block for p in grouped] == [0, 1, 2, 3] * 2  # each group's pages in the caller's order
    assert columns.groups == [large, small] and list(columns.keys) == [p.key for p in grouped]
    assert columns.which.tolist() == [0] * 4 + [1] * 4
    assert columns.sizes.tolist() == [large.used_bytes_per_block] * 4 + [small.used_bytes_per_block] * 4
    done = [p.group is small for p in grouped]  # per grouped page: back in the caller's order
    assert batch_plan.ungrouped(done, order) == [p.group is small for p in items]
    first_batch, _ = next(iter(transfer._pack(items)))
    assert first_batch[0].group is large
    # a long call's segments, each grouped on its own: every segment's outcomes back in the caller's order
    segments = [(len(items), order), (2, np.array([1, 0])), (1, None)]
    assert batch_plan.in_call_order([*done, True, False, True], segments) == [
        *(p.group is small for p in items), False, True, True]
    columns, order = batch_plan.grouped(grouped)
    assert order is None and batch_plan.permuted(grouped, order) is grouped and columns.groups == [large, small]
    store = open_store("memory://?capacity=1048576")
    assert transfer.save(store, items) == [True] * len(items)
    host = HostTransfer(source)
    assert all(bytes(store.get(p.key)) == host.gather(p.group, p.block).tobytes() for p in items)


def _says_exactly_the_pages_stored(transfer, store, items, ok, source) -> None:
    """A save of 12 pages in 6 batches into a 6-slot store: True for exactly the pages it still holds (some,
    at most 6), each byte for byte the block it was saved from."""
    assert len(batch_plan.batches(items, transfer.staging_bytes)) == 6
    assert ok == store.contains_many([p.key for p in items]) and 0 < ok.count(True) <= 6
    host = HostTransfer(source.cpu())
    kept = [p for p, there in zip(items, ok) if there]
    assert all(bytes(store.get(p.key)) == host.gather(p.group, p.block).tobytes() for p in kept)


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_a_save_whose_later_batches_evict_its_earlier_ones_says_which_pages_stayed(device, use_triton, monkeypatch):
    """An arena of 6 slots and a save of 12 pages in batches of 2: the later batches evict the earlier
    ones (published while the later ones are in flight); the save says True for exactly the pages the store
    still holds, byte for byte, and looks up again only the pages its own reservations evicted."""
    from kvoffload.store import MemoryStore
    paged, _ = _groups()
    source = torch.randint(0, 256, (32 * STRIDE,), dtype=torch.uint8, device=device)
    transfer = _transfer(source, use_triton, staging_bytes=3 * paged.used_bytes_per_block)
    store = MemoryStore(6 * 8192, chunk_bytes=8192)  # a 7000-byte page takes an 8192-byte slot: 6 slots
    items = [Page(f"k{b}".encode(), paged, b, b) for b in range(12)]
    evicted, asked = set(), []
    real_reserve, real_contains = store.reserve, store.contains_many

    def reserve(it):
        reservation = real_reserve(it)
        evicted.update(reservation.evicted)
        return reservation

    monkeypatch.setattr(store, "reserve", reserve)
    monkeypatch.setattr(store, "contains_many", lambda keys: asked.extend(keys) or real_contains(keys))
    ok = transfer.save(store, items)
    monkeypatch.undo()
    _says_exactly_the_pages_stored(transfer, store, items, ok, source)
    assert evicted & {p.key for p in items} and set(asked) <= evicted


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_a_save_through_host_staging_says_true_only_for_pages_still_stored(device, use_triton):
    """Through pinned host staging (a store that hands out no slots of its own: here an arena that says so)
    a save of several batches into a store smaller than it: the later batches evict the earlier ones'
    pages, and the save says True for exactly the pages the store still holds, byte for byte."""
    from kvoffload.store import MemoryStore

    class ThroughStaging(MemoryStore):
        in_place = False

    paged, _ = _groups()
    source = torch.randint(0, 256, (32 * STRIDE,), dtype=torch.uint8)
    transfer = _transfer(source.to(device), use_triton, staging_bytes=3 * paged.used_bytes_per_block)
    store = ThroughStaging(6 * 8192, pinned=False, chunk_bytes=8192)  # 6 slots of 8 KiB (a page: 7000 bytes)
    items = [Page(f"k{b}".encode(), paged, b, b) for b in range(12)]
    _says_exactly_the_pages_stored(transfer, store, items, transfer.save(store, items), source)


def test_pages_a_tier_cannot_vouch_for_are_looked_up_again(monkeypatch):
    """A reservation that does not say what it evicted (None: a tiered store's) leaves every written page
    to a lookup; one that says so, only those it names."""
    store = open_store("memory://?capacity=1MiB&pinned=false")
    keys = [f"k{b}".encode() for b in range(4)]
    assert all(store.put_many([(key, b"x") for key in keys[:3]]))
    written = [True, True, False, True]

    def kept(evicted):
        return DeviceTransfer._kept(store, keys, list(written), DeviceTransfer._evicted_own(keys, evicted))

    assert kept([[], None]) == [True, True, False, False]
    assert DeviceTransfer._evicted_own(keys, [[], [b"older"]]) == set()  # nothing of its own: no lookup
    monkeypatch.setattr(store, "contains_many", lambda keys: pytest.fail("looked up with nothing in doubt"))
    assert kept([[], [b"older"]]) == written
    monkeypatch.undo()
    assert kept([[keys[3]]]) == [True, True, False, False]
    assert kept([[keys[0]]]) == written  # evicted, written again


@pytest.mark.parametrize("device,use_triton", PATHS)
def test_a_long_call_is_grouped_and_placed_a_segment_at_a_time(device, use_triton, monkeypatch):
    """A call of more than two batches' worth of pages makes its first batch's worth of columns first:
    both segments are grouped on their own, every page is stored and restored byte for byte, and the
    outcomes come back in the caller's order (misses in either segment, where grouping moved them)."""
    from kvoffload.store import MemoryStore

    paged, state = _groups()
    monkeypatch.setattr(batch_plan, "BATCH_PAGES", 3)
    source = torch.randint(0, 256, (24 * STRIDE,), dtype=torch.uint8, device=device)
    transfer = _transfer(source, use_triton)
    grouped = []
    real_grouped = batch_plan.grouped
    monkeypatch.setattr(batch_plan, "grouped", lambda items: grouped.append(len(items)) or real_grouped(items))
    store = MemoryStore(8 << 20, chunk_bytes=2 << 20)
    items = [Page(f"k{g.name}{b}".encode(), g, b, b) for b in range(10) for g in (paged, state)]
    assert transfer.save(store, items) == [True] * len(items)
    assert grouped == [3, 17]
    before = HostTransfer(source.cpu())
    for p in items:
        assert bytes(store.get(p.key)) == before.gather(p.group, p.block).tobytes()
    missing = (1, 10, 19)  # the head's state page (grouped after a later paged one), two in the rest
    for i in missing:
        store.delete(items[i].key)
    source[12 * STRIDE :] = 0
    moved = [p._replace(block=p.block + 12) for p in items]
    ok = transfer.load(store, moved)
    assert ok == [i not in missing for i in range(len(items))]
    assert grouped == [3, 17, 3, 17] and store.stats()["held"] == 0
    _sync(device)
    after = HostTransfer(source.cpu())
    for i, (p, into) in enumerate(zip(items, moved)):
        expected = before.gather(p.group, p.block) if ok[i] else np.zeros_like(before.gather(p.group, p.block))
        assert np.array_equal(after.gather(into.group, into.block), expected)


@pytest.mark.parametrize("device,use_triton", PATHS)
@pytest.mark.parametrize("lead_pages", [1, 3])
def test_a_calls_first_batch_in_two_parts_moves_every_page_and_returns_both(
    device, use_triton, monkeypatch, lead_pages
):
    """The first batch's first LEAD_BYTES cross the link while the rest is reserved (a save) or held (a
    load) as a second part: every page is stored and restored byte for byte, misses in either lease are
    not scattered, and both leases go back."""
    from kvoffload.store import MemoryStore

    paged, state = _groups()
    monkeypatch.setattr(batch_plan, "LEAD_BYTES", lead_pages * paged.used_bytes_per_block)
    source = torch.randint(0, 256, (48 * STRIDE,), dtype=torch.uint8, device=device)
    transfer = _transfer(source, use_triton)
    store = MemoryStore(8 << 20, chunk_bytes=2 << 20)
    items = [Page(f"k{b}".encode(), paged, b, b) for b in range(20)]
    reservations = []
    real_reserve = store.reserve
    monkeypatch.setattr(store, "reserve", lambda it: reservations.append(len(it)) or real_reserve(it))
    assert transfer.save(store, items) == [True] * len(items)
    assert reservations == [lead_pages, len(items) - lead_pages]  # one batch (20 small pages), two parts
    before = HostTransfer(source.cpu())
    for p in items:
        assert bytes(store.get(p.key)) == before.gather(p.group, p.block).tobytes()
    store.delete(items[0].key)  # a miss in the first lease
    store.delete(items[12].key)  # and in the second
    leases = []
    real_acquire = store.acquire_batch
    monkeypatch.setattr(store, "acquire_batch", lambda keys, **kw: leases.append(len(keys)) or real_acquire(keys, **kw))
    source[24 * STRIDE :] = 0
    moved = [p._replace(block=p.block + 24) for p in items]
    ok = transfer.load(store, moved)
    assert ok == [i not in (0, 12) for i in range(len(items))]
    assert leases[:2] == [lead_pages, len(items) - lead_pages]  # one batch (20 small pages), two leases
    assert store.stats()["held"] == 0  # both given back
    _sync(device)
    after = HostTransfer(source.cpu())
    for i, (p, into) in enumerate(zip(items, moved)):
        expected = before.gather(p.group, p.block) if ok[i] else np.zeros_like(before.gather(p.group, p.block))
        assert np.array_equal(after.gather(into.group, into.block), expected)
