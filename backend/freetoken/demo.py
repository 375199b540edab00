"""Tiny random checkpoints with a small trained tokenizer, built locally with no downloads.

``freetoken demo-model DIR`` writes one; the server and ``freetoken generate`` use one when given no
model; tests build checkpoints of several shapes and both families with ``build_checkpoint``.
Checkpoints are saved by transformers itself (``save_pretrained`` of the released model classes),
so they have the released layout (Qwen4-Exp's n-gram tables split into ``split_ngram_parts``
shards). The tokenizer is byte-level BPE with Qwen3.5's pre-tokenizer and NFC normalisation,
exactly what ``AutoTokenizer`` rebuilds for these model types.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = """\
FreeToken serves hybrid mixture-of-experts models behind Triton Inference Server.
The quick brown fox jumps over the lazy dog; the lazy dog sleeps in the warm sun.
Gated DeltaNet layers keep a recurrent state, full attention layers keep paged keys and values.
Experts that do not fit in GPU memory wait in pinned host memory until a token needs them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1024 3.14159 2026-11-29 v1.2.3 (x + y) * z = 7!
Unicode: café naïve résumé Ελληνικά русский 日本語の文章 中文句子 한국어 emoji 🙂🚀 ü ö ä ß ñ.
def generate(prompt, max_tokens=16):\n    return model(prompt)[:max_tokens]\n
Once upon a time there was a small model that wanted to speak. It learned a few words, then more.
"""
DEMO_TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
QWEN4_EXP_TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    hc_count=3,
    hc_lowrank=8,
    ple_layer_ids=[1, 3],
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=61,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=12,
    # Eight indexer heads: a block scores 0 only when all eight see it negatively, so exact ties
    # (which torch.topk breaks arbitrarily) between dropped and kept blocks stay out of the tests.
    indexer_n_heads=8,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=4,
    max_position_embeddings=1024,
    initializer_range=0.05,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
# family -> (transformers class-name prefix, default text config)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5_moe": ("Qwen3_5Moe", DEMO_TEXT_CONFIG),
    "qwen4_exp": ("Qwen4Exp", QWEN4_EXP_TEXT_CONFIG),
}
DEMO_VERSION = "1"


def qwen_pre_tokenizer():
    """Qwen3.5's pre-tokenizer: its split regex (digits one by one), then byte-level mapping."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 400) -> int:
    """Train a byte-level BPE on the embedded corpus and save it; returns its size (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen3_5Tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = qwen_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = dict(model["vocab"])
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    hf_tokenizer = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(str(out_dir))
    return len(hf_tokenizer)


def randomize_parameters(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give the parameters transformers initialises to constants non-trivial values: norm
    multipliers (zero-centred ones around 0, the gated GDN norm around 1), Qwen4-Exp's PLE
    convolutions (zeros) and n-gram tables large enough that a wrong row changes the output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(".linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif "norm" in name.rsplit(".", 2)[-2]:
                param.copy_(0.2 * noise)
            elif name.endswith(".ple.conv1d.weight"):
                param.copy_(0.3 * noise)
            elif name.endswith("ngram_embedding.weight"):
                param.copy_(noise)


def build_checkpoint(
    out_dir: str | os.PathLike,
    text_config: dict[str, Any] | None = None,
    *,
    family: str = "qwen3_5_moe",
    vocab_size: int | None = None,
    text_only: bool = False,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_vocab_size: int = 400,
    max_shard_size: str | None = None,
) -> Path:
    """A random checkpoint of ``family`` (``qwen3_5_moe`` or ``qwen4_exp``) plus tokenizer in
    ``out_dir``; ``text_config`` overrides the family's tiny defaults. ``vocab_size`` above the
    tokenizer's pads the vocabulary (as released checkpoints do). EOS is ``<|im_end|>``."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    prefix, defaults = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size = build_tokenizer(out, tokenizer_vocab_size)
    eos_id = tokenizer_size - 1  # <|im_end|>
    fields = {**defaults, **(text_config or {})}
    fields.update(
        vocab_size=vocab_size or tokenizer_size,
        eos_token_id=eos_id,
        pad_token_id=tokenizer_size - 3,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    if text_only:
        config = getattr(transformers, f"{prefix}TextConfig")(**fields)
        config.architectures = [f"{prefix}ForCausalLM"]
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=fields["hidden_size"])
        config = getattr(transformers, f"{prefix}Config")(
            text_config=fields, vision_config=vision, tie_word_embeddings=tie_word_embeddings
        )
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    randomize_parameters(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    transformers.GenerationConfig(eos_token_id=eos_id, pad_token_id=fields["pad_token_id"]).save_pretrained(str(out))
    return out


def default_demo_dir(family: str = "qwen3_5_moe") -> Path:
    root = os.environ.get("FREETOKEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "freetoken")
    suffix = "" if family == "qwen3_5_moe" else f"-{family}"
    return Path(root) / f"demo-model{suffix}-v{DEMO_VERSION}"


def ensure_demo_model(out_dir: str | os.PathLike | None = None, family: str = "qwen3_5_moe") -> Path:
    """The embedded demo model's directory (a Qwen3.5-MoE by default), built on first use."""
    out = Path(out_dir) if out_dir else default_demo_dir(family)
    marker = out / ".freetoken-demo"
    if not marker.exists():
        build_checkpoint(out, family=family, seed=1234)
        marker.write_text(DEMO_VERSION)
    return out
