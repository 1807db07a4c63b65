import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmscli.errors import InputError
from lmscli.units import format_flops, format_size, parse_bandwidth, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("16GiB", 16 << 30),
        ("512MiB", 512 << 20),
        ("1.5e9", 1_500_000_000),
        ("32GB", 32_000_000_000),
        ("16G", 16 << 30),
        ("1024", 1024),
        (" 2 KiB ", 2048),
        ("0.5GiB", 1 << 29),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "16 parsecs", "-1GiB", "1e999", "abc", "16GiBs"])
def test_parse_size_rejects(text):
    with pytest.raises(InputError):
        parse_size(text)


def test_format_size():
    assert format_size(3 << 30) == "3.00 GiB"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(12) == "12 B"
    assert format_size(None) == "unknown"
    assert format_size(5 << 40) == "5.00 TiB"


def test_format_flops():
    assert format_flops(0) == "0 FLOP"
    assert format_flops(2.5e7) == "25.00 MFLOP"
    assert format_flops(4.77e11) == "477.00 GFLOP"
    assert format_flops(3.3e12) == "3.30 TFLOP"
    assert format_flops(999_999) == "1.00 MFLOP"  # (not "1000.00 kFLOP")


@given(st.floats(min_value=0, max_value=1e18))
def test_format_flops_names_a_unit(flops):
    number, unit = format_flops(flops).split()
    assert unit.endswith("FLOP") and (0 <= float(number) < 1000 or unit == "PFLOP")


def test_parse_bandwidth():
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("16GiB/s") == float(16 << 30)
    with pytest.raises(InputError):
        parse_bandwidth("fast")


@given(st.integers(min_value=0, max_value=1 << 50))
def test_size_round_trip_bytes(n):
    assert parse_size(str(n)) == n


@given(st.integers(min_value=1, max_value=1 << 20), st.sampled_from(["KiB", "MiB", "GiB"]))
def test_size_round_trip_units(n, unit):
    factor = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    assert parse_size(f"{n}{unit}") == n * factor


@given(st.text(max_size=20))
def test_parse_size_never_crashes(text):
    try:
        assert parse_size(text) >= 0
    except InputError:
        pass
