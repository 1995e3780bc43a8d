"""Sanity checks for the test fixtures, the tiny tokenizer, the chat template and the default model."""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers import Qwen3_5ForCausalLM

from ninfer import default_model as dm
from tiny_checkpoints import TinyCheckpoint, expert_layout_of, make_dense, make_moe

IDS = dm.special_token_ids()
PROMPT = torch.tensor([[IDS["<|im_start|>"], 84, 82, 264, 198, 39, 275, 75, 78, 260, 273,
                        IDS["<|im_end|>"], 198, IDS["<|im_start|>"], 307, 82, 314]])
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def _render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


# ------------------------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "  leading spaces\n\n\ttabs and trailing   ",
    "Ünïcödé café naïve — “quotes” «guillemets» 日本語のテキスト 中文 한국어 Ελληνικά",
    "emoji 🤖🚀👩‍👩‍👧 flags 🇫🇷 math ∑∫√ ½",
    "digits 1234567890 and 3.14159; code: def f(x): return x**2\r\n",
    "\x00\x01\x7f control bytes and\u00a0nbsp\u200bzwsp",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_roundtrip_unicode(dense_ckpt: TinyCheckpoint, text: str) -> None:
    tok = dense_ckpt.tokenizer
    ids = tok.encode(text, add_special_tokens=True)
    assert all(0 <= i < 448 for i in ids)  # plain text never produces special ids, and no BOS
    assert tok.decode(ids) == text


def test_tokenizer_nfc_normalises(dense_ckpt: TinyCheckpoint) -> None:
    tok = dense_ckpt.tokenizer
    nfd = "cafe\u0301"
    assert tok.decode(tok.encode(nfd)) == unicodedata.normalize("NFC", nfd)


def test_special_tokens_are_single_ids(dense_ckpt: TinyCheckpoint) -> None:
    tok = dense_ckpt.tokenizer
    assert len(tok) == 481 and len(dm.SPECIAL_TOKENS) == 33
    for text, i in IDS.items():
        assert tok.encode(text) == [i], text
        assert tok.encode(f"a{text}b") == [tok.encode("a")[0], i, tok.encode("b")[0]]
    assert [IDS[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_pad|>")] == [448, 449, 450, 480]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 450
    assert tok.pad_token_id == 448 and tok.bos_token is None
    ids = tok.encode("<|im_start|>x<|vision_start|><think>y</think><tool_call><|im_end|>")
    # think/tool tags are not "special": they survive skip_special_tokens like real Qwen.
    assert tok.decode(ids, skip_special_tokens=True) == "x<think>y</think><tool_call>"


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    dm.build_tokenizer(tmp_path / "a")
    dm.build_tokenizer(tmp_path / "b")
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")


# --------------------------------------------------------------------------- chat template

def test_chat_template_generation_prompt(dense_ckpt: TinyCheckpoint) -> None:
    tok = dense_ckpt.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _render(tok, msgs, add_generation_prompt=True) == base + "<think>\n"
    assert _render(tok, msgs, add_generation_prompt=True, enable_thinking=True) == base + "<think>\n"
    no_think = base + "<think>\n\n</think>\n\n"
    assert _render(tok, msgs, add_generation_prompt=True, enable_thinking=False) == no_think
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False,
                                  return_dict=True)["input_ids"]
    assert ids.count(IDS["<think>"]) == 1 and ids.count(IDS["</think>"]) == 1
    assert tok.decode(ids) == no_think


def test_chat_template_reasoning_history(dense_ckpt: TinyCheckpoint) -> None:
    tok = dense_ckpt.tokenizer
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"},  # reasoning parsed from content
    ]
    out = _render(tok, msgs)
    assert out == ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
                   "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n")
    kept = _render(tok, msgs, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nr1\n</think>\n\na1<|im_end|>" in kept


def test_chat_template_tools(dense_ckpt: TinyCheckpoint) -> None:
    tok = dense_ckpt.tokenizer
    msgs = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            {"function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    out = _render(tok, msgs, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    system = out.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nSys.\n\n")
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in system
    assert "<tool_call>\n<function=" in system and "<parameter=" in system
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>"
            "<|im_end|>\n") in out
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nrainy\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n") in out
    assert out.count("<|im_start|>user") == 2


def test_chat_template_multimodal_parts(dense_ckpt: TinyCheckpoint) -> None:
    tok = dense_ckpt.tokenizer
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image"},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": " with "}, {"type": "video"}]}]
    out = _render(tok, msgs, add_generation_prompt=True)
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    vid = "<|vision_start|><|video_pad|><|vision_end|>"
    assert out.startswith(f"<|im_start|>user\nCompare {img}{img} with {vid}<|im_end|>\n")


# ------------------------------------------------------------------------------ checkpoints

def _assert_fully_random(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        v = p.detach()
        assert not torch.all(v == 0) and not torch.all(v == 1), f"{name} left at its default init"
        if v.numel() > 1:
            assert v.std() > 0, name


@pytest.mark.parametrize("fixture,loader", [
    ("dense_ckpt", AutoModelForCausalLM),
    ("moe_ckpt", AutoModelForCausalLM),
    ("composite_ckpt", AutoModelForImageTextToText),
    ("composite_moe_ckpt", AutoModelForImageTextToText),
])
def test_fixture_loads_in_transformers(request: pytest.FixtureRequest, fixture: str, loader) -> None:
    ck: TinyCheckpoint = request.getfixturevalue(fixture)
    _assert_fully_random(ck.hf_model)
    model, info = loader.from_pretrained(str(ck.path), output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = ck.hf_model.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        # Equal up to fp32 rounding: transformers' expert kernels round differently on mmapped
        # (differently aligned) tensors, so bitwise equality only holds for dense models.
        torch.testing.assert_close(model(PROMPT).logits, ck.hf_model(PROMPT).logits, rtol=1e-5, atol=1e-4)
    if fixture.startswith("composite"):
        with safe_open(str(ck.path / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "mtp.fc.weight" in keys and "model.language_model.embed_tokens.weight" in keys
        assert any(k.startswith("model.visual.") for k in keys)


def test_moe_fused_and_per_expert_agree(moe_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    fused = make_moe(tmp_path / "fused", expert_layout="fused")
    assert expert_layout_of(moe_ckpt.path) == {"per_expert"} and expert_layout_of(fused.path) == {"fused"}
    with safe_open(str(fused.path / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()) == [8, 64, 64]
        assert list(f.get_slice("model.layers.0.mlp.experts.down_proj").get_shape()) == [8, 64, 32]
    a = AutoModelForCausalLM.from_pretrained(str(moe_ckpt.path), attn_implementation="eager")
    b = AutoModelForCausalLM.from_pretrained(str(fused.path), attn_implementation="eager")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        torch.testing.assert_close(a(PROMPT).logits, b(PROMPT).logits, rtol=1e-5, atol=1e-4)


def test_dense_sharded_and_tied(tmp_path: Path) -> None:
    ck = make_dense(tmp_path, tie_word_embeddings=True, shard_size="50KB", dtype=torch.bfloat16)
    assert (ck.path / "model.safetensors.index.json").exists()
    assert len(list(ck.path.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(str(ck.path), dtype=torch.float32,
                                                 attn_implementation="eager")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, ck.hf_model(PROMPT).logits, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- default model

def test_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))
    path = dm.default_model_path()
    assert path == tmp_path / "home" / "default-model"
    assert dm.default_model_path() == path  # cached: no rewrite
    dm.write_default_model(tmp_path / "again")
    first = _digests(path)
    first.pop(dm._MARKER)
    assert first == _digests(tmp_path / "again")  # byte-identical, safetensors included

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.language_model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_slice("mtp.fc.weight").get_shape() == [128, 256]
        assert f.get_slice("mtp.layers.0.self_attn.q_proj.weight").get_shape() == [256, 128]
    assert any(k.startswith("model.visual.") for k in keys)

    vlm = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    _assert_fully_random(vlm.model.visual)
    lm, info = Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    tok = AutoTokenizer.from_pretrained(str(path))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                     enable_thinking=False, tools=TOOLS, return_tensors="pt", return_dict=True)
    out_a = vlm.generate(**prompt, max_new_tokens=8, do_sample=False)
    out_b = lm.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(out_a, out_b)
    assert vlm.generation_config.eos_token_id == [450, 448] and vlm.generation_config.top_k == 20

    # A version bump regenerates the cached copy.
    (path / dm._MARKER).write_text("stale\n")
    (path / "junk").write_text("x")
    assert dm.default_model_path() == path and not (path / "junk").exists()
