"""The one integrity rule: a file's sha256 recorded when int4q writes it, checked before use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from quantizer import integrity


def test_a_file_never_recorded_does_not_match(tmp_path):
    path = tmp_path / "artefact"
    path.write_bytes(b"data")
    assert not integrity.matches_digest(path) and integrity.changed_files([path]) == [path]


@settings(max_examples=25, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096), position=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_flipped_bit_is_found(tmp_path_factory, data, position, bit):
    path = tmp_path_factory.mktemp("i") / "artefact"
    path.write_bytes(data)
    integrity.record_digest(path)
    assert integrity.matches_digest(path)
    flipped = bytearray(data)
    flipped[position % len(data)] ^= 1 << bit
    path.write_bytes(bytes(flipped))
    assert not integrity.matches_digest(path) and integrity.changed_files([path]) == [path]


def test_a_missing_file_or_record_does_not_match(tmp_path):
    path = tmp_path / "artefact"
    assert not integrity.matches_digest(path)
    path.write_bytes(b"x")
    integrity.record_digest(path)
    integrity.digest_path(path).unlink()
    assert not integrity.matches_digest(path)
