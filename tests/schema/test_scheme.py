"""The per-module scheme: what it can say, what it refuses, and its config entry round trip."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quantizer.errors import UnsupportedError
from quantizer.schema.scheme import GROUP_SIZES, KEPT_BITS, ModuleScheme

DEFAULT = ModuleScheme(4, 64, False)
schemes = st.one_of(
    st.builds(ModuleScheme, st.just(4), st.sampled_from(GROUP_SIZES), st.booleans()),
    st.builds(ModuleScheme, st.just(5), st.just(32), st.booleans()),
    st.just(ModuleScheme(6, 16, True)),
    st.builds(ModuleScheme, st.just(8), st.none(), st.booleans()),
    st.just(ModuleScheme(KEPT_BITS)),
)


@given(schemes)
def test_an_override_entry_reads_back_as_the_same_scheme(scheme):
    assert ModuleScheme.from_dict(scheme.to_dict(), DEFAULT) == scheme


def test_an_entry_takes_what_it_leaves_out_from_the_default():
    assert ModuleScheme.from_dict({"group_size": 32}, DEFAULT) == ModuleScheme(4, 32, False)
    assert ModuleScheme.from_dict({"bits": 8}, ModuleScheme(4, 64, True)) == ModuleScheme(8, None, True)
    assert ModuleScheme.from_dict({"bits": 16}, DEFAULT).kept
    assert ModuleScheme.from_dict({"bits": 6}, DEFAULT) == ModuleScheme(6, 16, True)
    assert ModuleScheme.from_dict({"bits": 5}, DEFAULT) == ModuleScheme(5, 32, False)


@pytest.mark.parametrize("args,message", [
    ((3, None, False), "bits 3 is not one of 4, 5, 6, 8, 16"),
    ((4, 48, False), "group_size 48 is not one of"),
    ((4, None, False), "group_size None is not one of"),
    ((5, 64, False), "group_size 64 is not one of 32 for 5 bits"),
    ((6, 16, False), "6-bit modules .GGUF's Q6_K. are symmetric"),
    ((8, 64, True), "group_size is for group-wise modules"),
])
def test_impossible_schemes_are_refused(args, message):
    with pytest.raises(UnsupportedError, match=message):
        ModuleScheme(*args)


def test_an_entry_with_unknown_keys_is_refused():
    with pytest.raises(UnsupportedError, match="bits, group_size and symmetric only"):
        ModuleScheme.from_dict({"bits": 4, "clip": True}, DEFAULT)
