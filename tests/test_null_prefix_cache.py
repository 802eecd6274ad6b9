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


def _attributes_used_on(module, owner: str) -> set[str]:
    """Attributes read on ``self.prefix_cache`` in ``module``'s source."""
    tree = ast.parse(inspect.getsource(module))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == 'prefix_cache' and isinstance(node.value.value, ast.Name)
            and node.value.value.id == owner}


def test_no_caller_branches_on_whether_prefix_caching_is_on():
    """Engine, server, pipeline and tests read ``prefix_cache`` as an object, never as 'maybe None'."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(r'prefix_cache\s+is\s+(not\s+)?None|prefix_cache\s+else\b|if\s+[\w.]*prefix_cache\s*:')
    offenders = []
    for folder in ('lmdeploy', 'tests', 'benchmark'):
        for path in (root / folder).rglob('*.py'):
            if path.name == 'test_null_prefix_cache.py':
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                # the scheduler's constructor maps its omitted argument to a NullPrefixCache
                if pattern.search(line) and 'else NullPrefixCache()' not in line:
                    offenders.append(f'{path.relative_to(root)}:{i}: {line.strip()}')
    assert not offenders, offenders


def test_the_null_cache_answers_everything_the_engine_asks():
    from lmdeploy.pytorch.engine import engine as engine_mod
    used = _attributes_used_on(engine_mod, 'self')
    assert {'probe', 'saves_done', 'num_cached_blocks', 'stats', 'decode_save_last'} <= used, used
    for name in used:
        assert hasattr(NullPrefixCache, name), f'NullPrefixCache lacks {name}'
        assert hasattr(PrefixCache, name) or f'self.{name} =' in inspect.getsource(PrefixCache.__init__), \
            f'PrefixCache lacks {name}'


def test_the_null_cache_reports_the_same_counters_as_an_empty_cache():
    from lmdeploy.pytorch.prefix_cache.coordinator import zero_counters
    null = NullPrefixCache()
    assert null.stats() == {**zero_counters(), 'checkpoints_skipped': {}}
    assert null.num_cached_blocks == 0 and null.cached_nodes() == []
