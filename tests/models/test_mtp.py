"""The MTP head against an independent plain-torch reference written from reference §5-§7, §9, §10.

The reference reads the ``mtp.*``, embedding and LM-head tensors straight from the safetensors file
and keeps a dense (non-paged) K/V list, so neither ninfer's loader nor its paged cache is trusted.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import ninfer
from ninfer.checkpoint import CheckpointError, fused_parts
from ninfer.models.batch import ForwardBatch, make_batch
from ninfer.models.mtp import MTPHead, draft
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from tiny_checkpoints import TinyCheckpoint

TOL = 1e-4
PAGE = 4  # small pages so a short sequence spans several of them
N_TOKENS = 23


# ---------------------------------------------------------------- independent reference

def _norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Zero-centred RMSNorm (§5): ``x * rsqrt(mean(x²) + eps) * (1 + w)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """Partial NeoX RoPE (§7) on the first ``rot`` channels of ``x [T, heads, dh]``; text positions
    (all M-RoPE axes equal) make the interleaved M-RoPE exactly this."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot)
    freqs = pos.float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return torch.cat([xr * emb.cos() + rotated * emb.sin(), xp], -1)


class RefMTP:
    """One MTP layer (§10.2) with a dense K/V list; ``step`` processes pairs at given positions."""

    def __init__(self, ckpt_dir: Path, cfg: dict) -> None:
        raw = load_file(str(ckpt_dir / "model.safetensors"))
        self.w = {k[4:]: v.float() for k, v in raw.items() if k.startswith("mtp.")}
        self.embed = raw["model.language_model.embed_tokens.weight"].float()
        self.lm_head = raw["lm_head.weight"].float()
        self.nh, self.nkv, self.dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        rope = cfg["rope_parameters"]
        self.rot, self.theta = int(self.dh * rope["partial_rotary_factor"]), rope["rope_theta"]
        self.num_experts, self.top_k = cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def _attn(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        w, t = self.w, x.shape[0]
        qg = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(t, self.nh, 2 * self.dh)
        q, gate = qg[..., :self.dh], qg[..., self.dh:].reshape(t, -1)  # per-head [q_h | gate_h]
        k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(t, self.nkv, self.dh)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(t, self.nkv, self.dh)
        q = _rope(_norm(q, w["layers.0.self_attn.q_norm.weight"]), pos, self.rot, self.theta)
        k = _rope(_norm(k, w["layers.0.self_attn.k_norm.weight"]), pos, self.rot, self.theta)
        self.k.append(k)
        self.v.append(v)
        keys = torch.cat(self.k).repeat_interleave(self.nh // self.nkv, dim=1)  # [S, nh, dh]
        vals = torch.cat(self.v).repeat_interleave(self.nh // self.nkv, dim=1)
        s = keys.shape[0]
        scores = torch.einsum("thd,shd->hts", q, keys) * self.dh ** -0.5
        causal = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hts,shd->thd", p, vals).reshape(t, -1) * torch.sigmoid(gate)
        return o @ w["layers.0.self_attn.o_proj.weight"].T

    def _swiglu(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.w
        g, u = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
        return (F.silu(g) * u) @ w[prefix + "down_proj.weight"].T

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        if not self.num_experts:
            return self._swiglu(x, "layers.0.mlp.")
        p = (x @ self.w["layers.0.mlp.gate.weight"].T).softmax(-1)  # §9: softmax, top-k, renormalise
        top_w, top_i = p.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for row in range(x.shape[0]):
            for weight, e in zip(top_w[row].tolist(), top_i[row].tolist()):
                out[row] += weight * self._swiglu(x[row:row + 1], f"layers.0.mlp.experts.{e}.")[0]
        shared = torch.sigmoid(x @ self.w["layers.0.mlp.shared_expert_gate.weight"].T)
        return out + shared * self._swiglu(x, "layers.0.mlp.shared_expert.")

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        e = _norm(self.embed[tokens], w["pre_fc_norm_embedding.weight"])
        h = _norm(hidden.float(), w["pre_fc_norm_hidden.weight"])
        x = torch.cat([e, h], -1) @ w["fc.weight"].T  # embedding first
        x = x + self._attn(_norm(x, w["layers.0.input_layernorm.weight"]), pos)
        x = x + self._ffn(_norm(x, w["layers.0.post_attention_layernorm.weight"]))
        h_prime = _norm(x, w["norm.weight"])
        return h_prime, h_prime @ self.lm_head.T


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module", params=["dense", "moe"])
def setup(request: pytest.FixtureRequest) -> tuple[TinyCheckpoint, ninfer.LLM, MTPHead]:
    ckpt = request.getfixturevalue("composite_ckpt" if request.param == "dense" else "composite_moe_ckpt")
    llm = ninfer.load(ckpt.path, device="cpu", progress=False)
    return ckpt, llm, MTPHead.from_report(llm.model, llm.load_report.mtp)


def _reference(ckpt: TinyCheckpoint) -> RefMTP:
    return RefMTP(ckpt.path, ckpt.config["text_config"])


def _sequence(llm: ninfer.LLM, n: int = N_TOKENS) -> tuple[list[int], torch.Tensor]:
    ids = torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.runner.start(n)
    return ids, llm.runner.extend(ids)  # the target's final-norm hidden states [n, H]


def _block_table(num_pages: int) -> torch.Tensor:
    # A shuffled page order, so a slot computed as if pages were contiguous would show up.
    return torch.randperm(num_pages, generator=torch.Generator().manual_seed(2)).to(torch.int32)


def _batch(start: int, n: int, table: torch.Tensor) -> ForwardBatch:
    pos = torch.arange(start, start + n)
    slots = table.long()[pos // PAGE] * PAGE + pos % PAGE
    return make_batch(input_ids=torch.zeros(n, dtype=torch.long), positions=pos, seq_lens=[n],
                      context_lens=[start + n], block_tables=table[None], slot_mapping=slots, state_slots=[0])


# ---------------------------------------------------------------- tests

def test_loads_from_report_without_owning_shared_weights(setup) -> None:
    ckpt, llm, head = setup
    raw = load_file(str(ckpt.path / "model.safetensors"))
    params = dict(head.named_parameters())
    assert not any(n.startswith(("target.", "embed_tokens.", "lm_head.")) for n in params)
    shared = {t.data_ptr() for t in llm.model.parameters()}
    stacked: dict[str, list[str]] = {}
    for part, where in sorted(fused_parts(head).items(), key=lambda item: item[1].start):
        stacked.setdefault(f"{where.module}.weight", []).append(part)
    assert {"layers.0.self_attn.qkv_proj.weight"} <= set(stacked)
    assert not any(p.data_ptr() in shared for p in params.values())
    for name, p in params.items():
        if name.endswith("experts.gate_up_proj"):
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):  # gate rows first, then up
                assert torch.equal(p[e, :inter], raw[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"])
                assert torch.equal(p[e, inter:], raw[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"])
        elif name in stacked:  # a fused projection: its parts' rows in order
            assert torch.equal(p, torch.cat([raw[f"mtp.{part}.weight"] for part in stacked[name]])), name
        elif name.endswith("experts.down_proj"):
            assert torch.equal(p, torch.stack([raw[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"]
                                               for e in range(p.shape[0])]))
        else:
            assert torch.equal(p, raw["mtp." + name]), name
    assert ("experts.gate_up_proj" in " ".join(params)) == llm.config.is_moe


def test_logits_match_reference_one_chunk_and_chunked(setup) -> None:
    ckpt, llm, head = setup
    ids, hidden = _sequence(llm)
    n = len(ids) - 1  # pairs (h_t, x_{t+1}) at positions t = 0 .. n-1
    nxt, pos = torch.tensor(ids[1:]), torch.arange(n)
    ref_h, ref_logits = _reference(ckpt).step(hidden[:n], nxt, pos)
    table = _block_table(-(-n // PAGE))
    cache = head.allocate_cache(num_pages=table.numel(), page_size=PAGE)
    with torch.inference_mode():
        h1, logits1 = head(hidden[:n], nxt, _batch(0, n, table), cache)
    assert (logits1 - ref_logits).abs().max().item() < TOL
    assert (h1 - ref_h).abs().max().item() < TOL

    # Same pairs as two chunks, then single steps: the paged KV must carry over between calls.
    cache = head.allocate_cache(num_pages=table.numel(), page_size=PAGE)
    spans = [(0, 7), (7, 13)] + [(t, t + 1) for t in range(13, n)]
    outs = []
    with torch.inference_mode():
        for a, b in spans:
            outs.append(head(hidden[a:b], nxt[a:b], _batch(a, b - a, table), cache)[1])
    assert (torch.cat(outs) - ref_logits).abs().max().item() < TOL


@pytest.mark.parametrize("rope_delta", [0, 5])
def test_draft_equals_recursive_reference(setup, rope_delta: int) -> None:
    ckpt, llm, head = setup
    ids, hidden = _sequence(llm)
    k, p = 4, len(ids) - 2  # draft from (h_p, x_{p+1}); the MTP KV holds pairs 0 .. p-1 first
    table = _block_table(-(-(p + k) // PAGE))
    cache = head.allocate_cache(num_pages=table.numel(), page_size=PAGE)
    prefix = _batch(0, p, table)
    prefix.positions = prefix.positions + rope_delta
    with torch.inference_mode():
        head(hidden[:p], torch.tensor(ids[1:p + 1]), prefix, cache)
    got = draft(llm.model, head, hidden[p], ids[p + 1], p, k, cache=cache, block_table=table, rope_delta=rope_delta)

    ref = _reference(ckpt)
    ref.step(hidden[:p], torch.tensor(ids[1:p + 1]), torch.arange(p) + rope_delta)
    h, tok, want = hidden[p:p + 1], ids[p + 1], []
    for i in range(k):
        h, logits = ref.step(h, torch.tensor([tok]), torch.tensor([p + i + rope_delta]))
        tok = int(logits[0].argmax())
        want.append(tok)
    assert got == want
    assert len(got) == k and all(0 <= t < llm.config.vocab_size for t in got)


def test_draft_rejects_other_target_and_bad_k(setup) -> None:
    _, llm, head = setup
    cache = head.allocate_cache(num_pages=1, page_size=PAGE)
    h = torch.zeros(llm.config.hidden_size)
    with pytest.raises(ValueError, match="k must be"):
        draft(llm.model, head, h, 1, 0, 0, cache=cache, block_table=torch.zeros(1, dtype=torch.int32))
    with torch.device("meta"):
        other = Qwen3_5TextModel(llm.config)
    with pytest.raises(ValueError, match="different target"):
        draft(other, head, h, 1, 0, 1, cache=cache, block_table=torch.zeros(1, dtype=torch.int32))


def test_bf16_head_runs_in_the_model_dtype(composite_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(composite_ckpt.path, device="cpu", dtype="bf16", progress=False)
    head = MTPHead.from_report(llm.model, llm.load_report.mtp)
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}
    ids, hidden = _sequence(llm)
    n = len(ids) - 1
    table = _block_table(-(-n // PAGE))
    with torch.inference_mode():
        h, logits = head(hidden[:n], torch.tensor(ids[1:]), _batch(0, n, table),
                         head.allocate_cache(num_pages=table.numel(), page_size=PAGE))
    assert h.dtype == logits.dtype == torch.bfloat16
    ref = _reference(composite_ckpt).step(hidden[:n].float(), torch.tensor(ids[1:]), torch.arange(n))[1]
    assert (logits.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def _errors(llm: ninfer.LLM) -> list[tuple[dict[str, torch.Tensor], str]]:
    good = dict(llm.load_report.mtp)
    cases = []
    missing = dict(good)
    del missing["layers.0.self_attn.k_norm.weight"]
    cases.append((missing, "mtp.layers.0.self_attn.k_norm.weight is missing"))
    cases.append(({**good, "fc.weight": good["fc.weight"].T}, r"mtp.fc.weight has shape \[128, 64\]"))
    cases.append(({**good, "layers.1.input_layernorm.weight": good["norm.weight"]},
                  "unexpected tensor mtp.layers.1.input_layernorm.weight"))
    cases.append(({**good, "layers.0.self_attn.q_proj.weight": good["layers.0.self_attn.q_proj.weight"].int()},
                  "mtp.layers.0.self_attn.q_proj.weight has dtype"))
    cases.append(({}, "no mtp.* tensors"))
    if llm.config.is_moe:
        no_expert = dict(good)
        del no_expert["layers.0.mlp.experts.3.up_proj.weight"]
        cases.append((no_expert, "mtp.layers.0.mlp.experts.3.up_proj.weight is missing"))
        extra = good["layers.0.mlp.experts.0.down_proj.weight"]
        cases.append(({**good, "layers.0.mlp.experts.8.down_proj.weight": extra},
                      "experts.8.down_proj.weight: expert 8 is beyond num_experts=8"))
        bad = {**good, "layers.0.mlp.experts.2.gate_proj.weight": good["layers.0.mlp.experts.2.down_proj.weight"]}
        cases.append((bad, r"mtp.layers.0.mlp.experts.2.gate_proj.weight has shape \[64, 32\]"))
    else:
        cases.append(({**good, "layers.0.mlp.experts.0.gate_proj.weight": good["norm.weight"]},
                      "unexpected tensor mtp.layers.0.mlp.experts.0.gate_proj.weight"))
    return cases


def test_bad_or_missing_tensors_name_the_tensor(setup) -> None:
    _, llm, _ = setup
    for tensors, message in _errors(llm):
        with pytest.raises(CheckpointError, match=message):
            MTPHead.from_report(llm.model, tensors)
