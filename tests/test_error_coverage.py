"""The error-coverage tool (tests/error_coverage.py) finds every ConfigError raise and counts a raise as provoked
when a recorded line falls inside it, its continuation lines included."""

import fivefold.config as config
from fivefold.config_checks import validate
from error_coverage import HITS, _record, raise_sites, unraised


def test_it_finds_the_raises_and_counts_a_hit_anywhere_inside_one():
    sites = raise_sites()
    assert len(sites) > 150
    path, first, last, text = next(s for s in sites if s[2] > s[1])  # a raise over several lines
    assert text.startswith("raise ConfigError(")
    assert (path, first, last, text) in unraised(set())
    assert (path, first, last, text) not in unraised({(path, last)})
    assert (path, first, last, text) in unraised({(path, last + 1)})


def test_the_hook_records_where_a_config_error_is_made(monkeypatch):
    monkeypatch.setattr(config.ConfigError, "__init__", config.ConfigError.__init__)  # undone after the test
    _record()
    HITS.clear()
    try:
        validate(config.Config(model=config.ModelConfig(num_heads=4, num_kv_heads=3)))
    except config.ConfigError:
        pass
    assert any(path.endswith("fivefold/config_checks.py") for path, _ in HITS)
    HITS.clear()
