"""Directive passes on the DAG, schedule shapes, JSON round trip."""

from __future__ import annotations

import pytest
from piper_jax.directives.filters import matches
from piper_jax.directives.schedules import one_f_one_b_actions

import piper_jax as piper


def test_filter_semantics() -> None:
    tags = {"PP": 1, "MB": 0, "PASS": "F"}
    assert matches({"PP": 1}, tags)
    assert matches({"PP": "*"}, tags)
    assert not matches({"EP": "*"}, tags)
    assert matches({"EP": "-"}, tags)
    assert not matches({"PP": "-"}, tags)
    assert not matches({"PASS": "B"}, tags)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 2), (4, 4)])
def test_1f1b_shape(p: int, m: int) -> None:
    for s in range(p):
        actions = one_f_one_b_actions(p, m, s)
        assert sorted(a for a in actions if a[0] == "F") == [("F", s, i) for i in range(m)]
        assert sorted(a for a in actions if a[0] == "B") == [("B", s, i) for i in range(m)]
        warmup = min(p - s - 1, m)
        assert all(a[0] == "F" for a in actions[:warmup])
        in_flight = peak = 0
        for kind, _, _ in actions:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(p - s, m)  # 1F1B: at most p - s microbatches in flight


def test_gpipe_shape() -> None:
    (order0, _) = piper.schedules.gpipe(2, 3)
    passes = [g[0]["PASS"] for g in order0.filters]
    assert passes == ["F"] * 3 + ["B"] * 3


def test_json_round_trip(tmp_path) -> None:
    directives = [
        piper.split({"PP": "*"}, num_microbatches=4),
        piper.place({"PP": 0}, [0, 1], stream="pp"),
        piper.replicate({"PP": 0}, [0, 1]),
        piper.recompute({"PP": 1}, keep="dots"),
        *piper.schedules.one_f_one_b(2, 4),
    ]
    path = tmp_path / "s.json"
    piper.dump_directives(directives, path)
    assert piper.load_directives(path) == directives


def test_recompute_keeps_inputs_or_dots(tmp_path) -> None:
    assert piper.recompute({"PP": 0}).keep == "inputs"
    with pytest.raises(piper.DirectiveError, match="keep must be one of 'inputs', 'dots'"):
        piper.recompute({"PP": 0}, keep="everything")
    path = tmp_path / "s.json"
    path.write_text('[{"op": "recompute", "filter": {"PP": 0}, "keep": "all"}]')
    with pytest.raises(piper.DirectiveError, match=r"directive 0: recompute: keep must"):
        piper.load_directives(path)
    path.write_text('[{"op": "recompute", "filter": {"PP": 0}}]')  # the reference's form
    assert piper.load_directives(path) == [piper.recompute({"PP": 0})]


def test_json_unknown_field(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text('[{"op": "place", "filter": {"PP": 0}, "devices": [0], "colour": "red"}]')
    with pytest.raises(piper.DirectiveError, match=r"directive 0 \(place\): unknown field"):
        piper.load_directives(path)
