"""Fast checks on the models that scripts/prepare_models.py builds under models/.

A missing or stale model is a failure (with the command that fixes it), never a skip: `make test`
prepares the models before running pytest, so a missing one means that step did not happen.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "prepare_models.py"
TINY = ROOT / "models" / "tiny-llama"
SMOL = ROOT / "models" / "smollm2-135m-instruct"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


prepare_models = load_script()


def require(path: Path, recipe: str, only: str) -> Path:
    stamp = prepare_models.read_stamp(path)
    if stamp is None:
        pytest.fail(
            f"{path.relative_to(ROOT)} is missing or incomplete: "
            f"run `python scripts/prepare_models.py --only {only}` first (make test does)",
            pytrace=False,
        )
    if stamp.get("recipe") != recipe:
        pytest.fail(
            f"{path.relative_to(ROOT)} was built with recipe {stamp.get('recipe')!r}, "
            f"expected {recipe!r}: run `python scripts/prepare_models.py --only {only}`",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def tiny() -> Path:
    return require(TINY, prepare_models.TINY_RECIPE, "tiny")


@pytest.fixture(scope="module")
def smol() -> Path:
    return require(SMOL, prepare_models.SMOL_RECIPE, "smollm2")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


# --------------------------------------------------------------------------------------------
# tiny-llama
# --------------------------------------------------------------------------------------------


def test_tiny_config(tiny: Path) -> None:
    config = read_json(tiny / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 128
    assert config["num_attention_heads"] == 2
    assert config["num_key_value_heads"] == 2
    # vLLM's CPU attention rejects head_dim 16; the model must use 64.
    assert config["head_dim"] == 64 == config["hidden_size"] // config["num_attention_heads"]
    assert config["num_hidden_layers"] == 2
    assert config["intermediate_size"] <= 512
    assert config["max_position_embeddings"] == 2048
    assert config["vocab_size"] == prepare_models.TINY_VOCAB
    assert config["dtype"] == "bfloat16"  # what vLLM runs on CPU anyway
    assert config["tie_word_embeddings"] is True
    generation = read_json(tiny / "generation_config.json")
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert generation["bos_token_id"] == config["bos_token_id"]


def test_tiny_weights(tiny: Path) -> None:
    from safetensors import safe_open

    with safe_open(tiny / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        embed = weights.get_tensor("model.embed_tokens.weight")
        tensors = [weights.get_tensor(name) for name in names]
    assert tuple(embed.shape) == (prepare_models.TINY_VOCAB, 128)
    assert {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)} <= names
    assert "model.layers.2.self_attn.q_proj.weight" not in names
    assert all(bool(t.float().isfinite().all()) for t in tensors)
    assert sum(t.numel() for t in tensors) < 2_000_000


def test_tiny_tokenizer_round_trip(tiny: Path, tiny_tokenizer: Any) -> None:
    config = read_json(tiny / "config.json")
    tok = tiny_tokenizer
    assert len(tok) == config["vocab_size"]
    assert tok.bos_token_id == config["bos_token_id"]
    assert tok.eos_token_id == config["eos_token_id"]
    assert tok.pad_token_id == config["pad_token_id"]
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    texts = [
        "ROMEO:\nBut, soft! what light through yonder window breaks?",
        "  leading spaces, tabs\tand\nnew lines\n\n",
        "Unicode: café, naïve, 日本語, emoji 🎭, digits 0123456789.",
    ]
    for text in texts:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    # Trained on Shakespeare: common words are single tokens, so text compresses well.
    line = "First Citizen:\nWe are accounted poor citizens, the patricians good."
    assert len(tok(line, add_special_tokens=False).input_ids) < len(line) / 2.5


def test_tiny_chat_template(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    messages = [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Speak of the moon."},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nYou are a poet.<|im_end|>\n"
        "<|im_start|>user\nSpeak of the moon.<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.endswith("assistant\n")
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    # The template supplies BOS; tokenizing the rendered chat must not add a second one.
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2


def test_tiny_chat_template_in_tokenizer_config(tiny: Path) -> None:
    config = read_json(tiny / "tokenizer_config.json")
    assert config["chat_template"] == prepare_models.TINY_CHAT_TEMPLATE


def test_tiny_distributions_are_peaked_but_not_degenerate(tiny: Path, tiny_tokenizer: Any) -> None:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    text = (
        "KING HENRY VI:\nWhat, will you not be gone? I pray thee, peace;\n"
        "And let me speak, for I have heard enough."
    )
    ids = tiny_tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(input_ids=ids).logits[0].float().softmax(-1)
    assert bool(probs.isfinite().all())
    top1 = probs.max(-1).values
    cover90 = (probs.sort(-1, descending=True).values.cumsum(-1) < 0.9).sum(-1) + 1
    vocab = probs.shape[-1]
    # Far from uniform (1/4096) and from one-hot; 90% of the mass needs more than one token.
    assert 0.05 < top1.median().item() < 0.9
    assert 1 < cover90.median().item() < vocab / 4
    # Next-token loss on this text is far below uniform guessing (ln 4096 = 8.3).
    nll = -probs[:-1].gather(-1, ids[0, 1:, None]).log().mean().item()
    assert nll < 0.75 * math.log(vocab)


def test_tiny_stamp_records_statistics(tiny: Path) -> None:
    stats = read_json(tiny / prepare_models.STAMP)["stats"]
    assert 0.05 < stats["prompts_median_top1"] < 0.9
    assert stats["val_loss"] < 6.0


def test_training_data_is_vendored() -> None:
    """The tiny model trains on data/tinyshakespeare (a fresh clone has nothing beside it)."""
    path = prepare_models.DEFAULT_DATA
    assert path == ROOT / "data" / "tinyshakespeare" / "input.txt"
    assert path.is_file() and path.stat().st_size > 1_000_000
    if prepare_models.DATA_ENV not in os.environ:
        assert prepare_models.data_path() == path


def test_second_run_is_instant_and_skips_torch(tiny: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, 'scripts'); import prepare_models as p; "
        "rc = p.main(['--only', 'tiny']); "
        "print('TORCH-LOADED' if 'torch' in sys.modules else 'NO-TORCH'); sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "models ready" in result.stdout
    assert "NO-TORCH" in result.stdout


# --------------------------------------------------------------------------------------------
# smollm2-135m-instruct (files only: loading the 135M model is the engine tests' job)
# --------------------------------------------------------------------------------------------


def test_smollm2_config_and_stamp(smol: Path) -> None:
    config = read_json(smol / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == prepare_models.SMOL_DTYPE
    stamp = read_json(smol / prepare_models.STAMP)
    assert prepare_models.SMOL_CHECK_WORD in stamp["check"]["answer"]


def test_smollm2_tokenizer_and_chat_template(smol: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.eos_token_id == read_json(smol / "config.json")["eos_token_id"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    sentence = "The quick brown fox jumps over the lazy dog in 2024."
    assert tok.decode(tok(sentence).input_ids, skip_special_tokens=True) == sentence
