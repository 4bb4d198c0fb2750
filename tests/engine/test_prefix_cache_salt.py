"""The cache salt seeds the prefix-cache hash chain: requests share KV blocks only when their salts are
equal (vLLM's `cache_salt`); no salt keeps the offline engine's sharing between every unsalted request."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache import KVCacheManager, extend_block_hashes, hash_block_tokens, root_block_hash
from engine.kv_cache.block_hash import ROOT_BLOCK_HASH
from engine.request import Request
from engine.request_meta import RequestMeta

BLOCK_SIZE = 4
TOKENS = list(range(10, 31))  # 5 full blocks and a partial one


def make_request(request_id, salt, adapter_id=None, tokens=TOKENS):
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=4),
        adapter_id=adapter_id,
        meta=RequestMeta(cache_salt=salt),
    )


def test_no_salt_is_the_unsalted_root_and_every_salt_has_a_root_of_its_own():
    assert root_block_hash(None) == ROOT_BLOCK_HASH
    salts = ["", "a", "b", "a\x00", "tenant:alpha", "tenant:alph", "é", "e", "x" * 1000]
    roots = [root_block_hash(s) for s in salts]
    assert len(set(roots)) == len(salts) and ROOT_BLOCK_HASH not in roots
    assert root_block_hash("a") == root_block_hash("a")  # a pure function of the salt


@pytest.mark.parametrize("salt", ["tenant:alpha", "group:support"])
def test_the_salt_changes_every_block_of_the_chain_not_just_the_first(salt):
    plain = extend_block_hashes([], TOKENS, BLOCK_SIZE, None)
    salted = extend_block_hashes([], TOKENS, BLOCK_SIZE, None, salt)
    assert len(plain) == len(salted) == 5
    assert not set(plain) & set(salted)
    # The chain: block i hangs off block i - 1, and block 0 off the salt's root.
    assert salted[0] == hash_block_tokens(root_block_hash(salt), TOKENS[:4], None)
    for i in range(1, 5):
        assert salted[i] == hash_block_tokens(salted[i - 1], TOKENS[4 * i : 4 * i + 4], None)
    # Grown token by token, the chain is the same as hashed at once.
    incremental: list[bytes] = []
    for end in range(1, len(TOKENS) + 1):
        extend_block_hashes(incremental, TOKENS[:end], BLOCK_SIZE, None, salt)
    assert incremental == salted


@pytest.mark.parametrize(
    ("owner_salt", "owner_adapter", "reader_salt", "reader_adapter", "hit_blocks"),
    [
        (None, None, None, None, 5),  # the offline engine: unsalted requests share
        ("tenant:a", None, "tenant:a", None, 5),  # one tenant: shares with itself
        ("tenant:a", None, "tenant:b", None, 0),  # another tenant: nothing
        ("tenant:a", None, None, None, 0),  # salted vs unsalted: nothing, either way
        (None, None, "tenant:a", None, 0),
        ("tenant:a", "x", "tenant:a", "x", 5),
        ("tenant:a", "x", "tenant:b", "x", 0),  # the salt separates even equal adapter ids
        ("tenant:a", "x", "tenant:a", "y", 0),  # and the adapter still separates within a salt
    ],
)
def test_prefix_hits_only_between_equal_salts(
    owner_salt, owner_adapter, reader_salt, reader_adapter, hit_blocks
):
    manager = KVCacheManager(32, BLOCK_SIZE, enable_caching=True)
    owner = make_request("owner", owner_salt, owner_adapter)
    assert manager.allocate_slots(owner, owner.num_tokens) is not None
    owner.num_computed_tokens = owner.num_tokens
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("reader", reader_salt, reader_adapter))
    assert num_hit_tokens == hit_blocks * BLOCK_SIZE
    assert [b.block_id for b in hits] == manager.get_block_ids("owner")[:hit_blocks]


def test_a_freed_salted_prefix_is_hit_again_by_its_salt_only():
    manager = KVCacheManager(32, BLOCK_SIZE, enable_caching=True)
    owner = make_request("owner", "tenant:a")
    manager.allocate_slots(owner, owner.num_tokens)
    owner.num_computed_tokens = owner.num_tokens
    manager.free(owner)  # the blocks stay cached while free
    assert manager.get_computed_blocks(make_request("b", "tenant:b"))[1] == 0
    assert manager.get_computed_blocks(make_request("a", "tenant:a"))[1] == 5 * BLOCK_SIZE


@pytest.fixture(scope="module")
def salted_llm(text_model_dir):
    llm = LLM(model=str(text_model_dir), max_model_len=96, block_size=4, max_num_seqs=4)
    yield llm
    llm.engine.shutdown()


def test_the_engine_shares_cached_prompts_only_within_a_salt(salted_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = "Salted caches keep tenants apart."

    def run(salt):
        item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        return salted_llm.generate([item], greedy)[0]

    first = run("tenant:alpha")
    same = run("tenant:alpha")
    other = run("tenant:beta")
    unsalted = run(None)
    unsalted_again = run(None)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert unsalted_again.num_cached_tokens > 0  # no salt: today's sharing, unchanged
    # Sharing or not, the output is the same: the salt only decides what may be reused.
    assert len({tuple(o.outputs[0].token_ids) for o in (first, same, other, unsalted)}) == 1


def test_an_empty_or_non_string_salt_is_refused(salted_llm):
    for salt in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            salted_llm.generate([{"prompt": "hello", "cache_salt": salt}], SamplingParams(max_tokens=1))
