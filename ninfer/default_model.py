"""The built-in tiny random Qwen3.5 model ("ninfer-tiny-random") and its tokenizer.

Everything here is generated deterministically on the CPU, so the model needs no download and two
machines produce byte-identical files. It is a *real* Qwen3.5 checkpoint in the official composite
layout (``model.language_model.*``, ``model.visual.*``, ``mtp.*``) written with transformers' own
classes, so transformers can act as the oracle for anything ninfer computes on it.

Heavy imports (torch, transformers, tokenizers) happen inside the functions: ``default_model_path``
is called on CLI/server start-up paths where the model usually already exists.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_MODEL_NAME = "ninfer-tiny-random"
# Bump whenever the generated files change; an older cached copy is then regenerated.
DEFAULT_MODEL_VERSION = "1"
_MARKER = ".ninfer-default-model"

CHAT_TEMPLATE_PATH = Path(__file__).parent / "assets" / "chat_template.jinja"

# Pre-tokenizer split pattern of the Qwen3.5 tokenizer (reference §13.1).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The 33 Qwen special tokens in the order of the real vocabulary (reference §13.1).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# Single tokens that must still decode as text (reasoning/tool parsers look for them).
TEXT_TAGS = frozenset(
    {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
)

# Fixed training text for the tiny BPE: plain English plus a little code and chat-like text so the
# merges look like those of a real tokenizer. Changing it changes every token id above 255.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model is still a model: it has an embedding
table, a stack of layers and a head that turns the last hidden state into scores for every token
in the vocabulary. When the model reads a prompt it processes all of the tokens at once, and when
it writes an answer it produces one token at a time, feeding each new token back as the next input.
This is the part of the work that inference engines try to make fast. They keep the keys and values
of the attention layers in a cache, and for the linear attention layers they keep a small recurrent
state instead, which does not grow with the length of the conversation.
Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us think
about the question step by step before we answer it. First, we read the question carefully. Then
we write down what we know, what we need, and what we can compute. Finally, we check the answer.
The weather was warm and the sky was clear, so the children played outside until the evening.
Their parents sat in the garden, talking about the news, the weather, and the plans for the week.
In the morning the town was quiet; in the afternoon the market was full of people buying bread,
fruit, fish and flowers. Everyone agreed that it had been a good day, and they went home happy.
def add(a, b):
    return a + b

for i in range(10):
    print("the value is", add(i, i))

class Model:
    def __init__(self, config):
        self.config = config
        self.layers = []

    def forward(self, input_ids, positions):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions)
        return self.norm(hidden)
{"name": "get_weather", "description": "Get the current weather in a given city", "parameters": {}}
The user asked for the weather in the city. The assistant called the function with the name of
the city and then answered with the temperature, the wind and the chance of rain for the day.
Reading, writing, thinking and talking are the things that language models are trained to do.
"""


def special_token_ids(num_regular: int = 448) -> dict[str, int]:
    """Map each Qwen special token to its id in the tiny tokenizer (``<|endoftext|>`` = num_regular)."""
    return {tok: num_regular + i for i, tok in enumerate(SPECIAL_TOKENS)}


def build_tokenizer(out_dir: Path, num_regular: int = 448) -> None:
    """Write a tiny Qwen-style byte-level BPE tokenizer (fast tokenizer files + chat template).

    Ids ``0..num_regular-1`` are the 256 byte symbols plus BPE merges trained on a fixed text;
    the 33 Qwen special tokens follow in real-Qwen order. Output is deterministic.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen3_5Tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # The trainer sorts the initial alphabet by code point, which for the byte-level alphabet is
    # exactly GPT-2/Qwen byte order, and breaks count ties by pair id: the result is reproducible.
    trainer = trainers.BpeTrainer(
        vocab_size=num_regular,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != num_regular:
        raise RuntimeError(
            f"BPE training produced {tok.get_vocab_size()} tokens, expected {num_regular}; "
            "the embedded training text is too short for this num_regular"
        )
    tok.add_tokens([
        AddedToken(t, special=t not in TEXT_TAGS, normalized=False, single_word=False,
                   lstrip=False, rstrip=False)
        for t in SPECIAL_TOKENS
    ])
    ids = special_token_ids(num_regular)
    assert all(tok.token_to_id(t) == i for t, i in ids.items()), "special tokens got unexpected ids"

    # Qwen3_5Tokenizer wraps the given pipeline unchanged (same as PreTrainedTokenizerFast) but
    # records tokenizer_class "Qwen3_5Tokenizer" like a real checkpoint; on load it rebuilds the
    # identical normaliser/pre-tokenizer from vocab+merges.
    hf_tok = Qwen3_5Tokenizer(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=262144,
        chat_template=CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
    )
    hf_tok.save_pretrained(str(out_dir))


def generation_config_dict(num_regular: int = 448) -> dict[str, Any]:
    """Qwen3.5-style ``generation_config.json`` contents for the tiny tokenizer's ids."""
    ids = special_token_ids(num_regular)
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }


def write_generation_config(out_dir: Path, num_regular: int = 448) -> None:
    """Write ``generation_config.json`` (stop on both ``<|im_end|>`` and ``<|endoftext|>``)."""
    text = json.dumps(generation_config_dict(num_regular), indent=2, sort_keys=True) + "\n"
    (Path(out_dir) / "generation_config.json").write_text(text, encoding="utf-8")


def randomize_(model: "torch.nn.Module", seed: int) -> None:
    """Overwrite every parameter of a Qwen3.5 model with deterministic random values, in place.

    Default inits hide bugs (zero-centred norms start at 0, so a missing ``1 + w`` is invisible),
    hence every tensor gets a non-trivial value: matrices ``N(0, std=fan_in**-0.5)`` so that
    activations stay O(1) through the stack (an untied ``lm_head`` uses 4x that std), embeddings
    ``N(0, 1)``, biases ``N(0, 0.1)``, zero-centred RMSNorm offsets ``N(0, 0.1)``, plain (``w``)
    norms ``1 + N(0, 0.1)``, ``A_log = log U(1, 16)`` and ``dt_bias ~ N(-3, 0.5)``, which puts
    most GDN decays ``exp(g)`` between 0.3 and 0.98: a short-memory recurrence would hide
    state hand-off bugs.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod_name, _, leaf = name.rpartition(".")
            new = _random_like(p, mod_name, leaf, modules[mod_name], gen)
            p.copy_(new.to(p.dtype))


def _random_like(p: "torch.Tensor", mod_name: str, leaf: str, mod: Any, gen: Any) -> "torch.Tensor":
    import torch

    cls = type(mod).__name__

    def normal(mean: float, std: float) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean

    if leaf == "A_log":
        return torch.rand(p.shape, generator=gen, dtype=torch.float32).mul(15).add(1).log()
    if leaf == "dt_bias":
        return normal(-3.0, 0.5)
    if leaf == "bias":
        return normal(0.0, 0.1)
    if isinstance(mod, torch.nn.Embedding):
        return normal(0.0, 1.0)
    if p.ndim == 1:
        # Qwen3_5RMSNorm / Qwen3_5MoeRMSNorm compute x * (1 + w); the GDN output norm
        # (RMSNormGated) and the ViT LayerNorms compute x * w.
        zero_centred = cls.endswith("RMSNorm")
        if not (zero_centred or cls.endswith("RMSNormGated") or "LayerNorm" in cls):
            raise ValueError(f"don't know how to randomise 1-D parameter of {cls}")
        return normal(0.0 if zero_centred else 1.0, 0.1)
    if mod_name.split(".")[-1] == "lm_head":
        # Logits with std ~4 give a peaked next-token distribution, so greedy decoding is not
        # decided by rounding noise when ninfer (bf16) is compared with the fp32 oracle.
        return normal(0.0, 4.0 * p.shape[-1] ** -0.5)
    if isinstance(mod, torch.nn.modules.conv._ConvNd):
        fan_in = math.prod(p.shape[1:])
    else:  # nn.Linear weights [out, in]; fused experts [E, out, in]; router [E, H]
        fan_in = p.shape[-1]
    return normal(0.0, fan_in ** -0.5)


def mtp_shapes(text_config: Any) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of a one-layer MTP head (reference §10.1) for a Qwen3.5 text config.

    Dense configs get a SwiGLU MLP; MoE configs get the full MoE block with per-expert 2-D
    experts, the storage seen in official MoE checkpoints' MTP layer.
    """
    c = text_config
    h, nh, nkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nh * dh, h),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * dh, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * dh, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, nh * dh),
        "mtp.layers.0.self_attn.q_norm.weight": (dh,),
        "mtp.layers.0.self_attn.k_norm.weight": (dh,),
    }
    mlp = "mtp.layers.0.mlp."
    if getattr(c, "num_experts", None):
        i, i_s = c.moe_intermediate_size, c.shared_expert_intermediate_size
        shapes[mlp + "gate.weight"] = (c.num_experts, h)
        for e in range(c.num_experts):
            shapes[f"{mlp}experts.{e}.gate_proj.weight"] = (i, h)
            shapes[f"{mlp}experts.{e}.up_proj.weight"] = (i, h)
            shapes[f"{mlp}experts.{e}.down_proj.weight"] = (h, i)
        shapes[mlp + "shared_expert.gate_proj.weight"] = (i_s, h)
        shapes[mlp + "shared_expert.up_proj.weight"] = (i_s, h)
        shapes[mlp + "shared_expert.down_proj.weight"] = (h, i_s)
        shapes[mlp + "shared_expert_gate.weight"] = (1, h)
    else:
        shapes[mlp + "gate_proj.weight"] = (c.intermediate_size, h)
        shapes[mlp + "up_proj.weight"] = (c.intermediate_size, h)
        shapes[mlp + "down_proj.weight"] = (h, c.intermediate_size)
    return shapes


def random_mtp_tensors(text_config: Any, seed: int, dtype: "torch.dtype") -> dict[str, "torch.Tensor"]:
    """Random MTP tensors (all RMSNorms zero-centred, matrices ``N(0, 1/fan_in)``)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for key, shape in mtp_shapes(text_config).items():
        std = 0.1 if len(shape) == 1 else shape[-1] ** -0.5
        out[key] = (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)
    return out


def append_tensors(safetensors_file: Path, extra: dict[str, "torch.Tensor"]) -> None:
    """Rewrite a single-file safetensors checkpoint with ``extra`` tensors added."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(safetensors_file))
    tensors.update(extra)
    save_file(tensors, str(safetensors_file), metadata={"format": "pt"})


def default_text_config(vocab_size: int = 512) -> dict[str, Any]:
    """Text config of ninfer-tiny-random (official key names; unread keys kept for fidelity)."""
    ids = special_token_ids()
    return {
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "max_position_embeddings": 262144,
        "eos_token_id": ids["<|endoftext|>"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        # Keys transformers ignores but official configs carry (reference §2).
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "attn_output_gate": True, "mamba_ssm_dtype": "float32",
    }


def write_default_model(out_dir: Path) -> None:
    """Write the ninfer-tiny-random checkpoint (composite Qwen3.5 layout, bf16) into ``out_dir``."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = special_token_ids()
    torch.manual_seed(0)
    config = Qwen3_5Config(
        text_config=default_text_config(),
        vision_config={
            "depth": 2, "hidden_size": 32, "num_heads": 2, "patch_size": 16,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 128,
            "num_position_embeddings": 256, "intermediate_size": 64,
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize_(model, seed=0)
    with torch.no_grad():
        # Rows past the tokenizer's 481 ids are vocabulary padding. Zero them, as an untrained row
        # would be, so sampling almost never lands on an id the tokenizer cannot decode.
        n_ids = len(SPECIAL_TOKENS) + 448
        model.model.language_model.embed_tokens.weight[n_ids:] = 0
        model.lm_head.weight[n_ids:] = 0
    # bf16 storage like real checkpoints keeps the files small (~3 MB).
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    append_tensors(out_dir / "model.safetensors",
                   random_mtp_tensors(config.text_config, seed=1, dtype=torch.bfloat16))
    write_generation_config(out_dir)
    build_tokenizer(out_dir)
    for f in out_dir.iterdir():  # safetensors' atomic writer leaves 0600; the cache may be shared
        f.chmod(0o644)


def _ninfer_home() -> Path:
    return Path(os.environ.get("NINFER_HOME") or Path.home() / ".cache" / "ninfer").expanduser()


def _is_current(path: Path) -> bool:
    marker = path / _MARKER
    try:
        return marker.read_text(encoding="utf-8").strip() == DEFAULT_MODEL_VERSION
    except OSError:
        return False


def default_model_path() -> Path:
    """Return ``$NINFER_HOME/default-model`` (default ``~/.cache/ninfer``), generating it on first use.

    Generation goes to a temporary sibling directory that is renamed into place, so readers never
    see a half-written model; a file lock serialises concurrent first uses, and a version marker
    makes a future ``DEFAULT_MODEL_VERSION`` regenerate the files.
    """
    home = _ninfer_home()
    target = home / "default-model"
    if _is_current(target):
        return target
    home.mkdir(parents=True, exist_ok=True)
    with _file_lock(home / ".default-model.lock"):
        if _is_current(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".default-model.tmp-", dir=home))
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            write_default_model(tmp)
            (tmp / _MARKER).write_text(DEFAULT_MODEL_VERSION + "\n", encoding="utf-8")
            if target.exists():  # stale version: move aside, then swap in
                old = Path(tempfile.mkdtemp(prefix=".default-model.old-", dir=home))
                os.replace(target, old / "model")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


class _file_lock:
    """Exclusive advisory lock on a file (no-op where ``fcntl`` is unavailable)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "_file_lock":
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
