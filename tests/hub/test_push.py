"""int4q push against a real Hub-compatible HTTP server on 127.0.0.1 (tests/hub_server.py)."""

import hashlib
import shutil

import pytest
import yaml
from click.testing import CliRunner
from conftest import save_byte_tokenizer
from hub_server import HubServer
from huggingface_hub import hf_hub_download

from quantizer.cli.main import main

TOKEN, OTHER = "hf_alice_secret_token", "hf_bob_token"


@pytest.fixture
def hub():
    server = HubServer({TOKEN: "alice", OTHER: "bob"}).start()
    yield server
    try:
        server.stop()
    except OSError:
        pass


@pytest.fixture
def folder(tiny_q, tmp_path):
    folder = shutil.copytree(tiny_q, tmp_path / "model")
    save_byte_tokenizer(folder)
    return folder


def push(folder, hub_url, *extra, token=TOKEN):
    args = ["push", str(folder), "--endpoint", hub_url] + (["--token", token] if token else []) + list(extra)
    return CliRunner().invoke(main, args)


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(hub, repo, name, tmp_path, token=TOKEN, revision=None):
    from pathlib import Path

    return Path(hf_hub_download(repo, name, endpoint=hub.url, token=token or False, revision=revision,
                                cache_dir=tmp_path / "cache"))


def test_push_uploads_every_file_with_the_same_bytes_and_a_model_card(hub, folder, tmp_path):
    result = push(folder, hub.url, "--repo-id", "alice/tiny-int4")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith(f"{hub.url}/alice/tiny-int4/commit/")
    assert TOKEN not in result.output
    assert hub.state.lfs_puts  # the safetensors went through LFS
    for path in sorted(folder.iterdir()):
        assert sha(download(hub, "alice/tiny-int4", path.name, tmp_path)) == sha(path), path.name
    card = download(hub, "alice/tiny-int4", "README.md", tmp_path).read_text()
    assert TOKEN not in card
    _, front, body = card.split("---", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "int4q" and meta["pipeline_tag"] == "text-generation"
    assert {"4-bit", "cpu_int4"} <= set(meta["tags"])
    assert "| group size | 64 |" in body and "bits per weight" in body


def test_private_repo_is_unreadable_without_the_token(hub, folder, tmp_path):
    assert push(folder, hub.url, "--repo-id", "alice/secret", "--private").exit_code == 0
    with pytest.raises(Exception) as err:
        download(hub, "alice/secret", "config.json", tmp_path / "anon", token=None)
    assert "401" in str(err.value) or "not found" in str(err.value).lower()
    with pytest.raises(Exception):
        download(hub, "alice/secret", "config.json", tmp_path / "bob", token=OTHER)
    assert download(hub, "alice/secret", "config.json", tmp_path).read_bytes() == (folder / "config.json").read_bytes()


def test_wrong_token_is_refused_with_a_clear_message(hub, folder):
    result = push(folder, hub.url, "--repo-id", "alice/x", token="hf_wrong")
    assert result.exit_code == 1
    assert "refused the token (401 Unauthorized)" in result.stderr and "Traceback" not in result.stderr
    assert "hf_wrong" not in result.output


def test_second_push_replaces_a_changed_file_and_resends_nothing_else(hub, folder, tmp_path):
    assert push(folder, hub.url, "--repo-id", "alice/m").exit_code == 0
    puts = len(hub.state.lfs_puts)
    (folder / "generation_config.json").write_text('{"max_new_tokens": 7}\n')
    result = push(folder, hub.url, "--repo-id", "alice/m", "--commit-message", "tweak")
    assert result.exit_code == 0, result.output
    assert len(hub.state.lfs_puts) == puts  # the unchanged safetensors was not uploaded again
    sent = [line["value"]["path"] for line in hub.state.commit_payloads[-1] if line["key"] != "header"]
    assert sent == ["generation_config.json"]
    assert len(hub.state.repos["alice/m"].commits) == 3  # empty, first push, second push
    got = download(hub, "alice/m", "generation_config.json", tmp_path / "c2").read_text()
    assert "7" in got
    assert sha(download(hub, "alice/m", "model.safetensors", tmp_path / "c2")) == sha(folder / "model.safetensors")


def test_server_stopping_mid_upload_is_a_clear_error(hub, folder, monkeypatch):
    import quantizer.hub.push as hubmod

    monkeypatch.setattr(hubmod, "RETRIES", 2)
    monkeypatch.setattr(hubmod.time, "sleep", lambda s: None)
    hub.state.stop_on_lfs_put = True
    result = push(folder, hub.url, "--repo-id", "alice/down")
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "push to alice/down failed: Error while uploading 'model.safetensors'" in lines[0]
    assert "Traceback" not in result.output


def test_transient_server_errors_are_retried(hub, folder, monkeypatch):
    import quantizer.hub.push as hubmod

    monkeypatch.setattr(hubmod.time, "sleep", lambda s: None)
    hub.state.fail_next_commits = 2
    result = push(folder, hub.url, "--repo-id", "alice/flaky")
    assert result.exit_code == 0, result.output
    assert hub.state.fail_next_commits == 0 and len(hub.state.repos["alice/flaky"].commits) == 2


def test_dry_run_lists_files_and_contacts_nothing(folder):
    result = push(folder, "http://127.0.0.1:9", "--repo-id", "alice/dry", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "model.safetensors" in result.stdout and "(generated model card)" in result.stdout
    assert "dry run: nothing sent" in result.stdout
    assert not (folder / "README.md").exists()


def test_a_folder_failing_verify_is_not_pushed(hub, folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, folder / "model.safetensors")
    result = push(folder, hub.url, "--repo-id", "alice/broken")
    assert result.exit_code == 1 and "fails verify's structural check" in result.stderr
    assert "alice/broken" not in hub.state.repos


@pytest.mark.parametrize("fault", ["no tokenizer", "verify said FAIL", "verify said INCOMPLETE"])
def test_a_folder_verify_would_not_pass_is_not_pushed(hub, folder, fault):
    import json

    if fault == "no tokenizer":
        for p in folder.glob("tokenizer*"):
            p.unlink()
    else:
        outcome = fault.rsplit(" ", 1)[1]
        (folder / "verify_report.json").write_text(json.dumps({"ok": False, "outcome": outcome}))
    result = push(folder, hub.url, "--repo-id", "alice/unrunnable")
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "alice/unrunnable" not in hub.state.repos and not (folder / "README.md").exists()


def test_push_without_any_token_says_how_to_give_one(hub, folder, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    result = push(folder, hub.url, "--repo-id", "alice/anon", token=None)
    assert result.exit_code == 1 and "needs a token" in result.stderr and "refused" not in result.stderr
    assert not (folder / "README.md").exists()  # a failed push leaves the folder as it was


def test_push_real_smollm2_checkpoint(hub, smollm2_g64, tmp_path):
    folder = shutil.copytree(smollm2_g64, tmp_path / "smol")
    result = push(folder, hub.url, "--repo-id", "alice/smollm2-int4-g64")
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert sha(download(hub, "alice/smollm2-int4-g64", name, tmp_path)) == sha(folder / name)


def test_the_card_shows_verify_numbers_beside_the_sources_and_the_plot(folder, tiny_model, tmp_path):
    import json

    from quantizer.hub.card import PLOT_NAME, model_card

    verify = CliRunner().invoke(main, ["verify", str(folder), "--reference", str(tiny_model), "--max-windows", "2",
                                       "--ctx", "64", "--greedy-tokens", "4",
                                       "--json", str(folder / "verify_report.json"), "--plot", str(folder / PLOT_NAME)])
    assert verify.exit_code in (0, 1), verify.output
    fid = json.loads((folder / "verify_report.json").read_text())["fidelity"]
    card = model_card(folder, "alice/tiny-int4")
    _, front, body = card.split("---", 2)
    meta = yaml.safe_load(front)
    assert "base_model" not in meta  # a local source with no Hub id: left out, never a path
    assert f"| perplexity | {fid['ppl_reference']:.4f} | {fid['ppl_quantized']:.4f} (x{fid['ppl_ratio']:.4f}) |" in body
    assert f"{fid['kld_mean']:.4f} / {fid['kld_p999']:.4f}" in body
    assert f"{100 * fid['top1_agreement']:.2f}%" in body
    assert f"{fid['greedy_matches']}/{fid['greedy_total']}" in body
    assert f"![Per-tensor SNR and the KLD distribution]({PLOT_NAME})" in body
    assert "hf download alice/tiny-int4" in body and "huggingface-cli" not in body
    assert "import quantizer" in body and 'pipeline("text-generation", model="alice/tiny-int4")' in body


@pytest.mark.parametrize("named, config, explicit, expected", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", {}, None, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("models/smollm2-135m-bf16", {"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, None,
     "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("models/smollm2-135m-bf16", {}, None, None),
    ("/abs/path/model", {"_name_or_path": "/abs/path/model"}, None, None),
    ("models/x", {}, "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
])
def test_base_model_is_a_hub_id_or_nothing(named, config, explicit, expected, tmp_path, monkeypatch):
    from quantizer.io.source import base_model_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "smollm2-135m-bf16").mkdir(parents=True)  # a local folder is not a Hub id
    assert base_model_id(named, config, explicit) == expected


def test_a_malformed_base_model_is_refused(tiny_model, tmp_path):
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(tmp_path / "q"),
                                       "--base-model", "not a repo"])
    assert result.exit_code == 1 and "--base-model not a repo: not a Hub id" in result.stderr
    assert not (tmp_path / "q").exists()


def test_the_card_names_the_base_model_the_quantize_run_recorded(tiny_model, tmp_path):
    from quantizer.hub.card import model_card

    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", "--model", str(tiny_model), "--out", str(out), "--no-progress",
                                       "--base-model", "alice/tiny-llama"])
    assert result.exit_code == 0, result.output
    meta = yaml.safe_load(model_card(out, "alice/tiny-int4").split("---", 2)[1])
    assert meta["base_model"] == "alice/tiny-llama"


def test_a_link_out_of_the_folder_is_refused_before_anything_is_sent(hub, folder, tmp_path):
    secret = tmp_path / "hf-token"
    secret.write_text("hf_secret")
    (folder / "notes.txt").symlink_to(secret)
    for extra in ([], ["--dry-run"]):
        result = push(folder, hub.url, "--repo-id", "alice/leak", *extra)
        assert result.exit_code == 1 and "notes.txt is a link to" in result.output, result.output
        assert "Traceback" not in result.output
    assert "alice/leak" not in hub.state.repos and not (folder / "README.md").exists()


def test_the_card_is_never_written_through_a_readme_link(hub, folder, tmp_path):
    elsewhere = tmp_path / "elsewhere.md"
    (folder / "README.md").symlink_to(elsewhere)  # dangling: exists() is False
    result = push(folder, hub.url, "--repo-id", "alice/card")
    assert result.exit_code == 1 and "README.md is a link to" in result.output, result.output
    assert not elsewhere.exists() and (folder / "README.md").is_symlink()


def test_dry_run_lists_exactly_what_a_push_sends(hub, folder):
    from quantizer.hub.push import upload_files

    result = push(folder, hub.url, "--repo-id", "alice/dry", "--dry-run")
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.stdout.splitlines()[:-1]]
    assert listed == ["README.md", *(f.path for f in upload_files(folder))]
