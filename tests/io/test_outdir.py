"""Output folders: atomic publication, resumable partials, and never deleting what int4q did not write."""

import hashlib
import json
import shutil

import pytest
from click.testing import CliRunner

from quantizer.cli.main import main
from quantizer.errors import InputError
from quantizer.io.outdir import atomic_output_dir, is_int4q_output


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree_digest(root):
    """sha256 over every file's relative path and bytes below ``root``."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def models_tree(tiny_model, tmp_path):
    """tmp/models/{src (a real bf16 model), notes.txt (an unrelated file)}."""
    models = tmp_path / "models"
    shutil.copytree(tiny_model, models / "src")
    (models / "notes.txt").write_text("a user's file that int4q must never touch\n")
    return models


def assert_refused_and_untouched(result, models, before, pattern):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and pattern in lines[0], result.stderr
    assert tree_digest(models) == before
    assert not any(p.name.startswith(".") for p in models.parent.rglob("*int4q*"))


@pytest.mark.parametrize("where", ["source", "parent"])
def test_overwrite_never_replaces_the_source_or_a_folder_holding_it(models_tree, where):
    before = tree_digest(models_tree)
    out = models_tree / "src" if where == "source" else models_tree
    result = run("quantize", "--model", models_tree / "src", "--out", out, "--overwrite", "--no-progress")
    assert_refused_and_untouched(result, models_tree, before, "is" if where == "source" else "contains")


def test_overwrite_of_dot_refuses_a_folder_int4q_did_not_write(models_tree, monkeypatch):
    before = tree_digest(models_tree)
    monkeypatch.chdir(models_tree)
    result = run("quantize", "--model", "src", "--out", ".", "--overwrite", "--no-progress")
    assert_refused_and_untouched(result, models_tree, before, "contains the input")


def test_overwrite_refuses_an_unrelated_folder(models_tree, tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    result = run("quantize", "--model", models_tree / "src", "--out", other, "--overwrite", "--no-progress")
    assert result.exit_code == 1 and "not a folder int4q wrote" in result.stderr
    assert (other / "cat.jpg").read_bytes() == b"\xff\xd8"


def test_overwrite_refuses_a_file(models_tree, tmp_path):
    target = tmp_path / "weights.txt"
    target.write_text("keep me")
    result = run("quantize", "--model", models_tree / "src", "--out", target, "--overwrite", "--no-progress")
    assert result.exit_code == 1 and "not a folder" in result.stderr and target.read_text() == "keep me"


def test_overwrite_replaces_an_earlier_int4q_output(models_tree, tmp_path):
    out = tmp_path / "q"
    args = ("quantize", "--model", models_tree / "src", "--out", out, "--group-size", "64", "--no-progress")
    assert run(*args).exit_code == 0 and is_int4q_output(out)
    (out / "stale.txt").write_text("from the first run")
    result = run(*args, "--overwrite")
    assert result.exit_code == 0, result.output
    assert not (out / "stale.txt").exists() and is_int4q_output(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "q"]


def test_calibration_file_is_an_input_too(models_tree, tmp_path):
    calib = tmp_path / "work" / "calib.txt"
    calib.parent.mkdir()
    calib.write_text("text " * 100)
    result = run("quantize", "--model", models_tree / "src", "--out", calib.parent, "--overwrite",
                 "--method", "gptq", "--calib", calib, "--no-progress")
    assert result.exit_code == 1 and "contains the input" in result.stderr and calib.is_file()


def test_bundled_model_refuses_an_unrelated_existing_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    result = run("bundled-model", tmp_path / "mine")
    assert result.exit_code == 2 and "not the bundled model" in result.stderr
    result = run("bundled-model", tmp_path / "mine", "--overwrite")
    assert result.exit_code == 1 and "not a folder int4q wrote" in result.stderr
    assert (tmp_path / "mine" / "keep.txt").read_text() == "x"


def test_is_int4q_output_needs_a_quantization_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_int4q_output(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    assert not is_int4q_output(tmp_path)
    (tmp_path / "quantization_report.json").write_text("{}")
    assert is_int4q_output(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert not is_int4q_output(tmp_path)


def test_atomic_output_dir_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, overwrite=False) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir_replaces_only_with_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "cpu_int4"}}))
    with pytest.raises(InputError, match="--overwrite"):
        with atomic_output_dir(out, overwrite=False):
            pass
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("y")
    assert [p.name for p in out.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_empty_folder_may_be_replaced(tmp_path):
    (tmp_path / "out").mkdir()
    with atomic_output_dir(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "new").write_text("y")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new"]


def test_partial_folder_is_kept_for_resume_and_cleared_otherwise(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(out, overwrite=False, keep_partial=True) as tmp:
            (tmp / "progress").write_text("layer 3")
            raise KeyboardInterrupt
    assert not out.exists() and (tmp / "progress").is_file()
    with atomic_output_dir(out, overwrite=False, keep_partial=True, resume=True) as again:
        assert again == tmp and (again / "progress").read_text() == "layer 3"
    assert (out / "progress").is_file()
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(tmp_path / "b", overwrite=False, keep_partial=True) as tmp2:
            (tmp2 / "stale").write_text("x")
            raise KeyboardInterrupt
    with atomic_output_dir(tmp_path / "b", overwrite=False, keep_partial=True) as fresh:
        assert not (fresh / "stale").exists()


def test_a_second_run_into_the_same_out_is_refused_while_the_first_writes(tiny_model, tmp_path):
    from quantizer.io.outdir import lock_path, output_lock, partial_dir

    out = tmp_path / "q"
    with output_lock(out):  # the first run, still writing
        partial_dir(out).mkdir()
        (partial_dir(out) / "model.safetensors").write_bytes(b"half")
        result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(out), "--no-progress"])
        assert result.exit_code == 1 and f"another int4q run is writing {out}" in result.output, result.output
        assert (partial_dir(out) / "model.safetensors").read_bytes() == b"half"  # untouched
    assert not lock_path(out).exists()
    partial_dir(out).joinpath("model.safetensors").unlink()
    partial_dir(out).rmdir()
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert not lock_path(out).exists() and not partial_dir(out).exists()


def test_the_lock_refuses_a_second_holder_and_passes_on_when_released(tmp_path):
    from quantizer.io.outdir import output_lock

    with output_lock(tmp_path / "q"):
        with pytest.raises(InputError, match="another int4q run"):
            with output_lock(tmp_path / "q"):
                pass
    with output_lock(tmp_path / "q"):
        pass


def test_an_out_under_a_file_is_one_line_naming_the_file(tmp_path):
    from quantizer.io.outdir import check_output_file, check_output_target

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(InputError, match=f"--out {blocker}/sub/out: {blocker} is a file, not a folder"):
        check_output_target(blocker / "sub" / "out", overwrite=False)
    with pytest.raises(InputError, match=f"--imatrix-out {blocker}/m.gguf: {blocker} is a file, not a folder; "
                                         "choose another --imatrix-out"):
        check_output_file(blocker / "m.gguf", False, [], lambda p: True, "--imatrix-out")


def test_free_space_is_said_in_a_unit_that_shows_it():
    from quantizer.io.outdir import readable_bytes

    assert [readable_bytes(n) for n in (3, 4_500, 2_500_000, 7_000_000_000)] == \
        ["3 bytes", "4.50 kB", "2.50 MB", "7.00 GB"]
