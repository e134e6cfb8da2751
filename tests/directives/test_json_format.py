"""The reference Piper JSON format: what the reference accepts is accepted with the same
meaning, or refused naming the field and what to write instead; nonsense values are refused."""

from __future__ import annotations

import json
import math

import pytest
from piper_jax.directives.json_format import directive_from_dict
from piper_jax.directives.types import Place, Replicate, Shard, Split

import piper_jax as piper


def _load(tmp_path, entries) -> list:
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps(entries))
    return piper.load_directives(path)


def test_empty_filter_means_every_region(tmp_path) -> None:
    """The reference harness appends this split to every schedule file."""
    entry = {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4}
    (split,) = _load(tmp_path, [entry])
    assert split == Split({}, 4, "MB")
    assert piper.place({}, [0]).filter == {}
    assert piper.replicate({}, [0, 1]).filter == {}


@pytest.mark.parametrize("op", ["place", "replicate", "shard"])
def test_device_is_read_as_devices(op) -> None:
    entry = {"op": op, "filter": {"PP": 0}, "device": [0, 1]}
    assert directive_from_dict(entry, 0).devices == (0, 1)


def test_device_and_devices_together_are_refused() -> None:
    entry = {"op": "place", "filter": {"PP": 0}, "devices": [0], "device": [1]}
    with pytest.raises(piper.DirectiveError, match=r"directive 3 \(place\).*keep 'devices'"):
        directive_from_dict(entry, 3)


def test_stream_fields_of_the_reference_are_read() -> None:
    place = directive_from_dict(
        {"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": "pp"}, 0
    )
    assert place == Place({"PP": 0}, (0,), "pp")
    shard = directive_from_dict(
        {"op": "shard", "filter": {"EP": 0}, "devices": [0], "stream": "a2a"}, 0
    )
    assert shard == Shard({"EP": 0}, (0,), "a2a")
    rep = directive_from_dict(
        {
            "op": "replicate",
            "filter": {"PP": 0},
            "devices": [0, 1],
            "reduce_stream": "dp_stream",
            "gather_stream": "ag_stream",
        },
        0,
    )
    assert (rep.reduce_stream, rep.gather_stream) == ("dp_stream", "ag_stream")


# (entry, the refusal's text): forms the reference refuses or older files used
REFUSED = [
    (
        {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "stream": "dp"},
        r"replicate takes no 'stream'; write 'reduce_stream' and/or 'gather_stream'",
    ),
    (
        {"op": "place", "filter": {"PP": 0}, "devices": [0], "gather_stream": "dp"},
        r"place takes no 'gather_stream'; write 'stream'",
    ),
    (
        {"op": "shard", "filter": {"PP": 0}, "devices": [0], "reduce_stream": "dp"},
        r"shard takes no 'reduce_stream'; write 'stream'",
    ),
    (
        {"op": "place", "filters": [{"PP": 0}], "devices": [0]},
        r"place takes no 'filters'; write 'filter'",
    ),
    (
        {"op": "order", "filter": {"PP": 0}},
        r"order takes no 'filter'; write 'filters'",
    ),
    (
        {"op": "place", "filter": [["PP", 0]], "devices": [0]},
        r"list of \[tag, index\] pairs.*write the object \{\"PP\": 0\}",
    ),
    (
        {"op": "place", "filter": {"PP": "0"}, "devices": [0]},
        r"filter value for 'PP'.*write the number 0, not the string '0'",
    ),
    (
        {"op": "place", "filter": {"PP": None}, "devices": [0]},
        r"filter value for 'PP'.*write '-' for regions without the tag",
    ),
    (
        {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": "4"},
        r"num_microbatches must be an int >= 1.*write the number 4",
    ),
    (
        {"op": "split", "filter": {}, "num_microbatches": 4.0},
        r"num_microbatches must be an int >= 1, got 4.0; write 4",
    ),
    (
        {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "bucket_size": "25"},
        r"bucket_size must be .*write the number 25",
    ),
]


@pytest.mark.parametrize("entry, message", REFUSED)
def test_forms_the_reference_refuses_name_the_field_and_the_fix(entry, message) -> None:
    with pytest.raises(piper.DirectiveError, match=r"directive 2.*" + message):
        directive_from_dict(entry, 2)


@pytest.mark.parametrize("field", ["shard_params", "shard_grads"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_bool_fields_must_be_real_bools(field, value) -> None:
    """The reference reads bool("false") == True: ZeRO-3 from a string that says false."""
    entry = {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], field: value}
    with pytest.raises(piper.DirectiveError, match=f"{field} must be true or false, got"):
        directive_from_dict(entry, 0)


@pytest.mark.parametrize("size", [math.nan, math.inf, -math.inf, -1, 0])
def test_bucket_size_must_be_a_finite_positive_number(size) -> None:
    with pytest.raises(piper.DirectiveError, match="bucket_size must be a finite number"):
        piper.replicate({"PP": 0}, [0, 1], bucket_size=size)
    assert Replicate({"PP": 0}, (0, 1), bucket_size=0.5).bucket_size == 0.5


def test_nan_bucket_size_in_a_json_file_is_refused(tmp_path) -> None:
    path = tmp_path / "nan.json"
    path.write_text('[{"op": "replicate", "filter": {}, "devices": [0, 1], "bucket_size": NaN}]')
    with pytest.raises(piper.DirectiveError, match="directive 0: replicate: bucket_size"):
        piper.load_directives(path)


@pytest.mark.parametrize("stream", ["", 3, None])
def test_stream_names_must_be_strings(stream) -> None:
    with pytest.raises(piper.DirectiveError, match="place: stream must be a stream name"):
        piper.place({"PP": 0}, [0], stream=stream)


def test_op_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(piper.DirectiveError, match=r"directive 0: unknown op \['place'\]"):
        directive_from_dict({"op": ["place"], "filter": {"PP": 0}, "devices": [0]}, 0)


def test_strategy_file_that_is_not_utf8_is_refused(tmp_path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(
        '[{"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": "é"}]'.encode("latin-1")
    )
    with pytest.raises(piper.DirectiveError, match=r"latin1.json: not UTF-8 text \(byte 65 "):
        piper.load_directives(path)


def test_missing_strategy_file_is_refused(tmp_path) -> None:
    with pytest.raises(piper.DirectiveError, match="cannot read strategy file .*nowhere.json"):
        piper.load_directives(tmp_path / "nowhere.json")


def test_round_trip_keeps_the_empty_filter(tmp_path) -> None:
    directives = [piper.split({}, num_microbatches=2), piper.place({}, [0], stream="pp")]
    piper.dump_directives(directives, tmp_path / "out.json")
    assert piper.load_directives(tmp_path / "out.json") == directives
