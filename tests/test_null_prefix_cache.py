"""With prefix caching off the scheduler holds a NullPrefixCache: one code path, nothing cached."""
import ast
import inspect

from lmdeploy.pytorch.engine import scheduler as scheduler_mod
from lmdeploy.pytorch.prefix_cache import NullPrefixCache, PrefixCache


def _attributes_the_scheduler_uses() -> set[str]:
    tree = ast.parse(inspect.getsource(scheduler_mod))
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == 'prefix_cache' and isinstance(node.value.value, ast.Name)
                and node.value.value.id == 'self'):
            names.add(node.attr)
    return names


def test_the_null_cache_answers_everything_the_scheduler_asks():
    used = _attributes_the_scheduler_uses()
    assert {'match', 'pin', 'plan_saves', 'release', 'num_evictable_blocks'} <= used, used
    for name in used:
        assert hasattr(NullPrefixCache, name), f'NullPrefixCache lacks {name}'
        assert hasattr(PrefixCache, name) or f'self.{name} =' in inspect.getsource(PrefixCache.__init__), \
            f'PrefixCache lacks {name}'
    assert PrefixCache.caches_prefixes and not NullPrefixCache.caches_prefixes


def test_the_scheduler_never_checks_for_a_missing_prefix_cache():
    source = inspect.getsource(scheduler_mod)
    assert 'self.prefix_cache is not None' not in source and 'self.prefix_cache is None' not in source


def test_the_null_cache_matches_and_keeps_nothing():
    null = NullPrefixCache()
    match = null.match(object())
    assert (match.cached_tokens, match.num_shared_blocks, match.nodes) == (0, 0, [])
    assert null.evict(10) == 0 and null.num_evictable_blocks == 0 and not null.decode_save_last
