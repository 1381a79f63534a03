"""tools/invariance_check.py (issue 20's equality checks over HTTP): the comparison reports
a difference in tokens, text or any logprob, and the requests it compares have every token
(``ignore_eos``) and logprobs. The servers it starts are the real path; this covers the
parts that decide its verdict."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "invariance_check.py"
spec = importlib.util.spec_from_file_location("invariance_check", TOOL)
ic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ic)


def _answers(lp: float = -0.5, tok: str = " b") -> dict:
    return {"x/greedy": ("a b", [" a", tok], [-0.25, lp])}


def test_compare_same_and_each_kind_of_difference(capsys):
    assert ic.compare("same", _answers(), _answers())
    assert not ic.compare("logprob", _answers(), _answers(lp=-0.5000001))
    assert not ic.compare("token", _answers(), _answers(tok=" c"))
    out = capsys.readouterr().out
    assert out.count("DIFFERENT") == 2 and "first token difference at 1" in out


def test_target_requests_full_length_with_logprobs_and_seeded_twin():
    reqs = dict(ic.target_requests(32))
    assert set(reqs) == {"long/greedy", "long/seeded", "short/greedy", "short/seeded"}
    for body in reqs.values():
        assert body["max_tokens"] == 32 and body["ignore_eos"] and body["logprobs"] == 1
    assert reqs["long/greedy"]["temperature"] == 0 and reqs["long/seeded"]["seed"] == 1234


def test_neighbours_vary_and_are_reproducible():
    a = [ic.neighbour(random.Random(7)) for _ in range(1)]
    b = [ic.neighbour(random.Random(7)) for _ in range(1)]
    assert a == b
    rng = random.Random(0)
    crowd = [ic.neighbour(rng) for _ in range(40)]
    assert len({c["max_tokens"] for c in crowd}) > 10
    assert any("seed" in c for c in crowd) and any("seed" not in c for c in crowd)
