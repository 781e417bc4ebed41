"""Only the files a checkpoint needs are copied into an output, and never through a link that
leaves the model folder."""

import logging
import os

from quantizer.io.aux_files import copy_aux_files


def test_aux_files_are_copied_but_not_weights_or_model_card(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json", "config.json", "README.md",
                 "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", ".int4q-bundled"):
        (src / name).write_text("x")
    assert copy_aux_files(src, dst) == ["chat_template.jinja", "generation_config.json", "tokenizer.json"]


def test_notes_scripts_and_stray_files_are_not_copied(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for name in ("tokenizer.json", "notes.txt", "modeling_custom.py", "passwd.txt", "LICENSE", "spiece.model"):
        (src / name).write_text("x")
    assert copy_aux_files(src, dst) == ["LICENSE", "spiece.model", "tokenizer.json"]


def test_a_link_that_leaves_the_model_folder_is_never_followed(tmp_path, caplog):
    secret = tmp_path / "token"
    secret.write_text("hf_secret")
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    (src / "tokenizer.json").symlink_to(secret)
    (src / "vocab.json").write_text("{}")
    (src / "merges.txt").symlink_to(src / "vocab.json")  # inside the folder: copied as a plain file
    with caplog.at_level(logging.WARNING):
        assert copy_aux_files(src, dst) == ["merges.txt", "vocab.json"]
    assert not (dst / "tokenizer.json").exists() and not (dst / "merges.txt").is_symlink()
    assert "tokenizer.json is a link" in caplog.text and "hf_secret" not in (dst / "merges.txt").read_text()


def test_a_hub_cache_snapshot_links_into_its_own_blobs(tmp_path):
    repo = tmp_path / "models--a--b"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snap = repo / "snapshots" / "rev"
    snap.mkdir(parents=True)
    os.symlink("../../blobs/abc", snap / "tokenizer.json")
    dst = tmp_path / "dst"
    dst.mkdir()
    assert copy_aux_files(snap, dst) == ["tokenizer.json"]
