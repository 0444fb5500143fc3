"""The mutation check's list (tests/mutation_check.py) stays applicable: each mutant's text occurs exactly
once in its file, changes it, and names tests that exist."""

from mutation_check import MUTANTS, ROOT, TESTS


def test_every_mutant_applies_to_the_source_once():
    assert len({m.id for m in MUTANTS}) == len(MUTANTS) == 192
    for m in MUTANTS:
        source = (ROOT / m.path).read_text()
        assert source.count(m.old) == 1, (m.id, m.path)
        assert m.old != m.new and m.expected in ("killed", "equivalent"), m.id
        assert all((ROOT / t.split("::")[0]).is_file() for t in TESTS[m.tests].split()), m.id
    assert [m.id for m in MUTANTS if m.expected == "equivalent"] == ["Q4"]
