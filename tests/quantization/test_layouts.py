"""Base-model checkpoints as base and embedding models ship them (config.json names the base class,
``LlamaModel`` or ``Gemma3TextModel``; tensors without the causal LM's ``model.`` prefix; no head):
cpu_int4 quantizes them, verify proves every tensor and, end to end, compares the last hidden states
with the source's (a base model has no logits), and transformers' AutoModel loads the result; int4q's runtime,
which generates text, refuses them in one line; a GGUF file of them is the converter's own
architecture (an embedding Gemma as gemma-embedding), and llama.cpp's llama-embedding gives nearly
the embedding of the converter's own bf16 file."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from conftest import TOKENIZER_FILES

from quantizer.cli.main import main
from quantizer.formats.gguf.converter import converter_root

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
BASES = {
    "llama": ("LlamaConfig", dict(SMALL, tie_word_embeddings=True)),
    # six layers: llama.cpp's gemma-embedding takes Gemma's pattern of one global layer in six, and with
    # two its llama-embedding aborts on the converter's own bf16 file too
    "gemma3": ("Gemma3TextConfig", dict(SMALL, head_dim=16, sliding_window=16, tie_word_embeddings=True,
                                         num_hidden_layers=6)),
}
LLAMA_EMBEDDING = f"{sys.prefix}/share/int4q/llama.cpp/build/bin/llama-embedding"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def save_base_model(family: str, folder, smollm2_bf16):
    """A seeded random base model (transformers' AutoModel) of ``family`` with SmolLM2's tokenizer."""
    import transformers

    config_class, sizes = BASES[family]
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(getattr(transformers, config_class)(**sizes)).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_bf16 / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=list(BASES))
def base_model(request, smollm2_bf16, tmp_path_factory):
    return request.param, save_base_model(request.param, tmp_path_factory.mktemp(request.param) / "bf16", smollm2_bf16)


def test_a_base_model_is_saved_as_base_models_ship(base_model):
    from safetensors import safe_open

    family, folder = base_model
    names = list(safe_open(str(folder / "model.safetensors"), "pt").keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)


@pytest.mark.parametrize("method", ["minmax", "weighted"])
def test_a_base_model_quantizes_to_cpu_int4_verifies_and_loads_in_transformers(base_model, tmp_path, method):
    import transformers

    import quantizer.integrations.transformers  # noqa: F401  (registers cpu_int4 with transformers)

    family, source = base_model
    out = tmp_path / "int4"
    done = run("quantize", "--model", source, "--out", out, "--method", method, "--nsamples", 2, "--seqlen", 32,
               "--no-progress")
    assert done.exit_code == 0, done.output
    checked = run("verify", out, "--model", source, "--ctx", 64, "--max-windows", 2)
    assert "[ok] round trip" in checked.stdout and "[ok] kernel layout" in checked.stdout, checked.output
    assert "[ok] end to end" in checked.stdout and checked.stdout.strip().endswith("PASS"), checked.output
    line = next(x for x in checked.stdout.splitlines() if "last hidden states vs source over 128 tokens" in x)
    assert float(line.split("cosine mean ")[1].split(",")[0]) > 0.9
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = transformers.AutoModel.from_pretrained(source).float()(ids).last_hidden_state
        loaded = transformers.AutoModel.from_pretrained(out)
        assert type(loaded).__name__ == type(transformers.AutoModel.from_pretrained(source)).__name__
        got = loaded(ids).last_hidden_state.float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), exact.flatten(), dim=0) > 0.9


def test_max_kld_on_a_base_model_is_refused_in_one_line_before_any_check(base_model, tmp_path):
    family, source = base_model
    assert run("quantize", "--model", source, "--out", tmp_path / "int4", "--no-progress").exit_code == 0
    done = run("verify", tmp_path / "int4", "--model", source, "--max-kld", "0.1", "--ctx", 64, "--max-windows", 1)
    assert done.exit_code == 2 and "drop --max-kld" in done.output and "Traceback" not in done.output, done.output
    assert "structure ..." not in done.output


def test_a_base_models_tensors_under_a_causal_lms_config_are_named_with_the_fix(base_model, tmp_path):
    family, source = base_model
    mislabelled = tmp_path / "mislabelled"
    shutil.copytree(source, mislabelled)
    config = json.loads((mislabelled / "config.json").read_text())
    base_class = config["architectures"][0]
    config["architectures"] = [base_class.replace("TextModel", "ForCausalLM").replace("Model", "ForCausalLM")]
    (mislabelled / "config.json").write_text(json.dumps(config))
    done = run("quantize", "--model", mislabelled, "--out", tmp_path / "int4", "--no-progress")
    assert done.exit_code != 0 and "Traceback" not in done.output, done.output
    named = config["architectures"][0]
    assert (f"the tensors are a base model's (no 'model' prefix, no head), but config.json names {named}; "
            f'set "architectures": ["{base_class}"]') in done.output
    assert not (tmp_path / "int4").exists()


def test_the_runtime_refuses_a_base_model_in_one_line(base_model, tmp_path):
    family, source = base_model
    assert run("quantize", "--model", source, "--out", tmp_path / "int4", "--no-progress").exit_code == 0
    done = run("generate", tmp_path / "int4", "--prompt", "hello")
    assert done.exit_code != 0 and "is a base model" in done.output and "Traceback" not in done.output


@pytest.mark.skipif(not shutil.which(LLAMA_EMBEDDING), reason="llama.cpp's tools are not built here: "
                    "bash scripts/setup_gguf.sh --build")
def test_a_base_models_gguf_is_the_converters_architecture_and_llama_embedding_runs_it(base_model, tmp_path):
    gguf = pytest.importorskip("gguf")
    family, source = base_model
    out = tmp_path / "m.gguf"
    done = run("quantize", "--model", source, "--out", out, "--format", "gguf", "--gguf-type", "q4_0",
               "--no-progress")
    assert done.exit_code == 0, done.output
    reader = gguf.GGUFReader(out)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == {"llama": "llama", "gemma3": "gemma-embedding"}[family]
    assert {t.tensor_type.name for t in reader.tensors if t.name.endswith("ffn_down.weight")} == {"Q4_0"}
    bf16 = tmp_path / "bf16.gguf"
    subprocess.run([sys.executable, converter_root() / "convert_hf_to_gguf.py", source, "--outtype", "bf16",
                    "--outfile", bf16], check=True, capture_output=True, timeout=300)
    mine, reference = (llama_embedding(path) for path in (out, bf16))
    assert len(mine) == BASES[family][1]["hidden_size"] and all(math.isfinite(v) for v in mine)
    assert sum(a * b for a, b in zip(mine, reference)) > 0.9  # both unit vectors: their cosine


def llama_embedding(path) -> list[float]:
    """The embedding llama.cpp's llama-embedding gives a fixed sentence with the model ``path``."""
    ran = subprocess.run([LLAMA_EMBEDDING, "-m", str(path), "-p", "The capital of France is", "-t", "2",
                          "--no-warmup", "--embd-output-format", "json"], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout)["data"][0]["embedding"]
