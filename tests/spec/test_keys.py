"""Chained block keys: deterministic across processes and hash seeds, salted chains apart."""

import subprocess
import sys

import pytest

from conftest import subprocess_env
from kvoffload.spec import KeyChain, page_key

FP = bytes(range(16))
TOKENS = list(range(1000, 1000 + 64))

CHILD = """
from kvoffload.spec import KeyChain, page_key
chain = KeyChain(bytes(range(16)), 16, namespace="ns")
keys = chain.keys(list(range(1000, 1064)))
salted = chain.with_salt("tenant-7").keys(list(range(1000, 1064)))
print(" ".join(k.hex() for k in keys + salted + [page_key(keys[0], "g3-mla")]))
"""


def _child_keys(seed: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD], env=subprocess_env(PYTHONHASHSEED=seed),
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_keys_equal_across_processes_and_hash_seeds():
    a, b = _child_keys("0"), _child_keys("12345")
    assert a == b
    chain = KeyChain(FP, 16, namespace="ns")
    here = [k.hex() for k in chain.keys(TOKENS) + chain.with_salt("tenant-7").keys(TOKENS)]
    assert a[:-1] == here
    assert len(bytes.fromhex(a[0])) * 8 >= 128


def test_salt_changes_the_chain_from_the_first_block():
    chain = KeyChain(FP, 16)
    plain, salted = chain.keys(TOKENS), chain.with_salt("tenant").keys(TOKENS)
    assert len(plain) == len(salted) == 4
    assert all(p != s for p, s in zip(plain, salted))
    assert chain.with_salt("tenant").keys(TOKENS) == salted
    assert chain.with_salt("other").keys(TOKENS)[0] != salted[0]


def test_key_names_the_whole_prefix():
    chain = KeyChain(FP, 16)
    base = chain.keys(TOKENS)
    changed = list(TOKENS)
    changed[3] += 1  # first block differs: every later key differs too
    assert all(a != b for a, b in zip(base, chain.keys(changed)))
    late = list(TOKENS)
    late[40] += 1  # third block differs: the first two keys are shared
    assert chain.keys(late)[:2] == base[:2] and chain.keys(late)[2] != base[2]


def test_partial_block_has_no_key_and_parent_continues_chain():
    chain = KeyChain(FP, 16)
    assert len(chain.keys(TOKENS[:47])) == 2
    full = chain.keys(TOKENS)
    assert chain.keys(TOKENS[32:], parent=full[1]) == full[2:]


@pytest.mark.parametrize("change", ["fingerprint", "namespace", "block_tokens"])
def test_context_is_part_of_every_key(change):
    base = KeyChain(FP, 16, namespace="a").keys(TOKENS)
    other = {
        "fingerprint": lambda: KeyChain(bytes(16), 16, namespace="a").keys(TOKENS),
        "namespace": lambda: KeyChain(FP, 16, namespace="b").keys(TOKENS),
        "block_tokens": lambda: KeyChain(FP, 16, namespace="a").keys([t + 1 for t in TOKENS]),
    }[change]()
    assert not set(base) & set(other)


def test_page_keys_differ_per_group():
    key = KeyChain(FP, 16).keys(TOKENS)[0]
    assert page_key(key, "g0-state") != page_key(key, "g1-state") != page_key(key, "g3-mla")
    assert page_key(key, "g3-mla") == page_key(key, "g3-mla")


def test_framing_prevents_ambiguous_concatenation():
    assert KeyChain(FP, 16, namespace="ab", salt="c").context != KeyChain(FP, 16, namespace="a", salt="bc").context


def test_request_salt_frames_every_part_a_client_cannot_forge_another():
    from kvoffload.spec import request_salt

    assert request_salt() is None and request_salt("") is None
    assert request_salt("t") == request_salt(b"t")  # deterministic, str or bytes
    # what the old "|".join allowed: a crafted cache salt equal to another request's adapter or inputs
    assert request_salt("|lora:x") != request_salt(None, lora="x")
    assert request_salt("a|mm:h") != request_salt("a", mm_ids=["h"])
    assert request_salt("a", mm_ids=["b", "c"]) != request_salt("a", mm_ids=["bc"])
    assert request_salt(None, lora="") != request_salt(None)  # an adapter named "" is still an adapter
    salts = {request_salt(s, lora=l, mm_ids=m) for s in (None, "x", "lora") for l in (None, "x", "lora")
             for m in ((), ("x",), ("x", "y"))}
    assert len(salts) == 3 * 3 * 3  # all distinct (one of them None: no salt at all)


def test_keys_are_pinned_byte_for_byte():
    """Stored entries outlive the code: these digests (from the first released key scheme) must never
    change, whatever form the token ids come in or however the hashing is computed."""
    import numpy as np

    from kvoffload.spec import shard_key

    chain = KeyChain(b"fp", 4, "ns")
    keys = chain.keys(list(range(10)))  # two full blocks; the partial third has no key
    assert [k.hex() for k in keys] == ["93f8d594c364c913e40243fb288e04ea", "5d99e70016b7a45c139c4218e505bc96"]
    assert chain.with_salt("s").keys(np.arange(8))[1].hex() == "747724f971165c1258fc6fe49a96b2ce"
    assert chain.block_key(None, [0, 1, 2, 3]) == keys[0] and chain.block_key(keys[0], (4, 5, 6, 7)) == keys[1]
    assert chain.keys([8, 9, 10, 11], parent=keys[1]) == chain.keys(list(range(12)))[2:]
    assert page_key(keys[1], "g0").hex() == "0df2871eee9c933aee454f189d50f79d"
    assert shard_key(keys[0], 1, 2).hex() == "5ee30dbe658194ef6d3b05dd9b495f63"
