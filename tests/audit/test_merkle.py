"""RFC 9162 tree: published vectors, a naive reference on random trees, and proofs at scale."""

from __future__ import annotations

import hashlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvguard.audit.errors import VerificationError
from kvguard.audit.merkle import (
    EMPTY_ROOT,
    CompactRange,
    leaf_hash,
    node_hash,
    verify_consistency,
    verify_inclusion,
)
from kvguard.audit.tree import HashTree

# RFC 6962 test vectors as published in github.com/transparency-dev/merkle (Apache-2.0):
# testonly/constants.go (LeafInputs, RootHashes) and proof/verify_test.go (inclusionProofs,
# consistencyProofs; leaf numbers there are 1-based). The same vectors first appeared in
# github.com/google/certificate-transparency (merkle_tree_test.cc).
LEAVES = [bytes.fromhex(h) for h in (
    "", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f",
)]
ROOTS = [bytes.fromhex(h) for h in (
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
)]
INCLUSION = [  # (1-based leaf, tree size, proof)
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (3, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (2, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]
CONSISTENCY = [  # (size1, size2, proof)
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (6, 7, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]


# -- a naive reference: RFC 9162 §2.1.1, §2.1.3.1, §2.1.4.1 read literally ------------------

def ref_mth(d: list[bytes]) -> bytes:
    if not d:
        return hashlib.sha256(b"").digest()
    if len(d) == 1:
        return hashlib.sha256(b"\x00" + d[0]).digest()
    k = 1
    while k * 2 < len(d):
        k *= 2
    return hashlib.sha256(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:])).digest()


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) == 1:
        return []
    k = 1
    while k * 2 < len(d):
        k *= 2
    if m < k:
        return ref_path(m, d[:k]) + [ref_mth(d[k:])]
    return ref_path(m - k, d[k:]) + [ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    if m == len(d):
        return [] if b else [ref_mth(d)]
    k = 1
    while k * 2 < len(d):
        k *= 2
    if m <= k:
        return ref_subproof(m, d[:k], b) + [ref_mth(d[k:])]
    return ref_subproof(m - k, d[k:], False) + [ref_mth(d[:k])]


def _flip(proof: list[bytes], i: int, bit: int) -> list[bytes]:
    """The proof with one bit of node i flipped (as transparency-dev's verifier tests do)."""
    return proof[:i] + [bytes([proof[i][0] ^ bit]) + proof[i][1:]] + proof[i + 1 :]


def tree_of(leaves: list[bytes], cache_level: int = 0) -> HashTree:
    hashes = [leaf_hash(x) for x in leaves]
    tree = HashTree(cache_level, (lambda a, b: hashes[a:b]) if cache_level else None)
    tree.extend(hashes)
    return tree


@pytest.mark.parametrize("cache_level", [0, 1, 2])
def test_published_roots(cache_level):
    for size in range(len(LEAVES) + 1):
        assert tree_of(LEAVES[:size], cache_level).root() == ROOTS[size]
    tree = tree_of(LEAVES, cache_level)
    assert [tree.root(n) for n in range(9)] == ROOTS


@pytest.mark.parametrize("leaf,size,proof", INCLUSION)
def test_published_inclusion_proofs(leaf, size, proof):
    proof = [bytes.fromhex(p) for p in proof]
    tree = tree_of(LEAVES)
    assert tree.inclusion_proof(leaf - 1, size) == proof
    verify_inclusion(leaf - 1, size, leaf_hash(LEAVES[leaf - 1]), proof, ROOTS[size])
    # the corruptions transparency-dev's verifierCheck tries must all be refused
    lh = leaf_hash(LEAVES[leaf - 1])
    bad = [
        (leaf, size, lh, proof, ROOTS[size]),
        (leaf - 1, size * 2, lh, proof, ROOTS[size]),
        (leaf - 1, size, leaf_hash(b"WrongLeaf"), proof, ROOTS[size]),
        (leaf - 1, size, lh, proof, EMPTY_ROOT),
        (leaf - 1, size, lh, proof + [ROOTS[size]], ROOTS[size]),
        (leaf - 1, size, lh, [ROOTS[size]] + proof, ROOTS[size]),
        (leaf - 1, size, lh, proof[:-1], ROOTS[size]),
    ] + [
        (leaf - 1, size, lh, _flip(proof, i, 8), ROOTS[size])
        for i in range(len(proof))
    ]
    for args in bad:
        with pytest.raises(VerificationError) as err:
            verify_inclusion(*args)
        assert err.value.check == "inclusion"


@pytest.mark.parametrize("size1,size2,proof", CONSISTENCY)
def test_published_consistency_proofs(size1, size2, proof):
    proof = [bytes.fromhex(p) for p in proof]
    tree = tree_of(LEAVES)
    assert tree.consistency_proof(size1, size2) == proof
    verify_consistency(size1, size2, ROOTS[size1], ROOTS[size2], proof)
    if not proof:
        return
    bad = [
        (size1 + 1, size2, ROOTS[size1], ROOTS[size2], proof),
        (size1, size2, ROOTS[size2], ROOTS[size1], proof),
        (size1, size2, ROOTS[size1], ROOTS[size2], []),
        (size1, size2, ROOTS[size1], ROOTS[size2], proof[:-1]),
        (size1, size2, ROOTS[size1], ROOTS[size2], proof + [ROOTS[size1]]),
        (size1, size2, ROOTS[size1], ROOTS[size2], [proof[0]] + proof),
    ] + [
        (size1, size2, ROOTS[size1], ROOTS[size2], _flip(proof, i, 16))
        for i in range(len(proof))
    ]
    for args in bad:
        with pytest.raises(VerificationError) as err:
            verify_consistency(*args)
        assert err.value.check == "consistency"


def test_consistency_trivial_cases():
    verify_consistency(0, 5, b"x" * 32, ROOTS[5], [])
    verify_consistency(3, 3, ROOTS[3], ROOTS[3], [])
    bad = [(3, 3, ROOTS[3], ROOTS[4], []), (4, 3, ROOTS[4], ROOTS[3], []),
           (0, 3, EMPTY_ROOT, ROOTS[3], [ROOTS[1]])]
    for args in bad:
        with pytest.raises(VerificationError):
            verify_consistency(*args)


@settings(max_examples=150, deadline=None)
@given(
    leaves=st.lists(st.binary(max_size=8), min_size=1, max_size=70),
    cache_level=st.integers(0, 3),
    data=st.data(),
)
def test_against_naive_reference(leaves, cache_level, data):
    tree = tree_of(leaves, cache_level)
    n = len(leaves)
    size = data.draw(st.integers(1, n))
    index = data.draw(st.integers(0, size - 1))
    size1 = data.draw(st.integers(0, size))
    assert tree.root(size) == ref_mth(leaves[:size])
    path = tree.inclusion_proof(index, size)
    assert path == ref_path(index, leaves[:size])
    verify_inclusion(index, size, leaf_hash(leaves[index]), path, ref_mth(leaves[:size]))
    proof = tree.consistency_proof(size1, size)
    if 0 < size1 < size:
        assert proof == ref_subproof(size1, leaves[:size], True)
    verify_consistency(size1, size, ref_mth(leaves[:size1]), ref_mth(leaves[:size]), proof)
    # a compact range rebuilt from the prefix plus the remaining leaves gives the same root
    prefix = CompactRange(size1, tree.compact(0, size1))
    for leaf in leaves[size1:size]:
        prefix.append_leaf(leaf_hash(leaf))
    assert prefix.root() == ref_mth(leaves[:size])


def test_compact_range_merges_suffix_nodes():
    leaves = [bytes([i]) for i in range(45)]
    tree = tree_of(leaves)
    for a, b in [(0, 45), (7, 20), (16, 17), (31, 45), (44, 45)]:
        cr = CompactRange(a, tree.compact(0, a))
        for leaf in leaves[a:b]:
            cr.append_leaf(leaf_hash(leaf))
        from kvguard.audit.merkle import decompose
        for (level, _), h in zip(decompose(b, 45), tree.compact(b, 45)):
            cr.append_node(level, h)
        assert cr.root() == ref_mth(leaves)


def test_million_leaf_proofs_are_fast():
    # A bucketed tree over 2**20 + 3 leaves whose low levels are read back on demand.
    n = (1 << 20) + 3
    hashes = [i.to_bytes(32, "big") for i in range(n)]
    reads = []

    def source(a, b):
        reads.append((a, b))
        return hashes[a:b]

    tree = HashTree(8, source)
    tree.extend(hashes)
    start = time.perf_counter()
    for i in range(0, n, n // 97):
        proof = tree.inclusion_proof(i)
        verify_inclusion(i, n, hashes[i], proof, tree.root())
        size1 = i + 1
        verify_consistency(size1, n, tree.root(size1), tree.root(), tree.consistency_proof(size1))
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"~100 inclusion+consistency proofs at 1M leaves took {elapsed:.2f}s"
    assert all(b - a == 256 for a, b in reads)


def test_node_hash_domain_separation():
    assert leaf_hash(b"") == ROOTS[1]
    assert node_hash(ROOTS[1], leaf_hash(b"\x00")) == ROOTS[2]
