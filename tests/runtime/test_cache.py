"""The int4q cache is trusted only as a private folder of this user's, and an artefact in it is
loaded only when it is, byte for byte, the one int4q recorded when it built it."""

import logging
import os

import pytest

from quantizer import integrity
from quantizer.native import cache
from quantizer.runtime.decode import compiled as fastpath
from quantizer.runtime.decode import opening
from quantizer.runtime.loader import load_model


def test_the_cache_folder_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(tmp_path / "c"))
    root = cache.trusted_cache_dir()
    assert root == tmp_path / "c" and (root.stat().st_mode & 0o777) == 0o700


def test_a_cache_folder_others_can_write_is_refused_in_one_line(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(shared))
    with pytest.raises(cache.UntrustedCache, match=f"can be written by others; run chmod go-w {shared}"):
        cache.trusted_cache_dir()


@pytest.mark.parametrize("plant", ["link", "shared"])
def test_a_planted_cache_subfolder_is_refused_with_one_warning(tmp_path, monkeypatch, caplog, plant):
    root = tmp_path / "c"
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(root))
    monkeypatch.setattr(cache, "_warned", set())
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if plant == "link":
        (root / "compiled").symlink_to(elsewhere)
    else:
        (root / "compiled").mkdir()
        (root / "compiled").chmod(0o777)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with pytest.raises(cache.UntrustedCache, match="is a link" if plant == "link" else "written by others"):
                cache.trusted_cache_dir("compiled")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert cache.trusted_cache_dir() == root  # the root itself is still the user's


def test_a_recorded_digest_matches_only_the_same_bytes(tmp_path):
    artefact = tmp_path / "step.aot"
    artefact.write_bytes(b"compiled")
    assert not integrity.matches_digest(artefact)  # never recorded
    integrity.record_digest(artefact)
    assert integrity.matches_digest(artefact)
    artefact.write_bytes(b"compiled, then planted")
    assert not integrity.matches_digest(artefact)


def test_an_untrusted_cache_decodes_compiled_but_loads_and_saves_nothing_there(tiny_model, tmp_path, monkeypatch,
                                                                               caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("INT4Q_CACHE_DIR", str(shared))
    monkeypatch.setattr(cache, "_warned", set())
    monkeypatch.setattr(fastpath, "load_step", lambda path, decoder: pytest.fail("loaded a step from an untrusted cache"))
    with caplog.at_level(logging.WARNING):
        decoder = opening.open_decoder(load_model(tiny_model), 16)
    assert decoder.compiled is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and not r.getMessage().startswith("compiling the decode step")]
    assert len(warnings) == 1 and "can be written by others" in warnings[0]
    assert os.listdir(shared) == []


def test_a_planted_step_is_never_unpickled(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(fastpath, "compiled_dir", lambda: tmp_path)
    model = load_model(tiny_model)
    fastpath.checked_steps.clear()
    opening.open_decoder(model, 16)
    artifact = fastpath.artifact_path(model)
    assert integrity.matches_digest(artifact)
    artifact.write_bytes(b"\x80\x04 a pickle someone else wrote")
    fastpath.checked_steps.clear()
    monkeypatch.setattr(fastpath, "load_step", lambda path, decoder: pytest.fail("unpickled a file int4q did not save"))
    assert opening.open_decoder(model, 16).compiled is not None
