"""Memory and compute accounting: pure functions of the config (formulas), per-rank plans, measurement."""
