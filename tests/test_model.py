"""The draft against a naive re-implementation written from the architecture description."""

import pytest
import torch

from _tiny_models import train_draft, train_llama, train_qwen3
from nemo_dflash import DFlashConfig, DFlashDraftModel


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x: [heads, P, D]; rotate pairs (i, i + D/2) by pos * theta^(-2i/D), one position at a time."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for p_idx, p in enumerate(pos.tolist()):
        for i in range(d // 2):
            ang = p * theta ** (-2 * i / d)
            c, s = torch.cos(torch.tensor(ang, dtype=torch.float64)), torch.sin(torch.tensor(ang, dtype=torch.float64))
            x1, x2 = x[:, p_idx, i], x[:, p_idx, i + d // 2]
            out[:, p_idx, i] = x1 * c - x2 * s
            out[:, p_idx, i + d // 2] = x2 * c + x1 * s
    return out


def naive_draft(draft, noise, target_hidden, positions, mask):
    """Batch 1. mask: bool [Q, C+Q] or None."""
    cfg = draft.config
    sd = {k: v.double() for k, v in draft.state_dict().items()}
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    theta = cfg.rope_parameters["rope_theta"]
    ctx = rms(target_hidden[0].double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    h = noise[0].double()
    q_len, c_len = h.shape[0], ctx.shape[0]
    for li in range(cfg.num_hidden_layers):
        p = lambda n: sd[f"layers.{li}.{n}"]  # noqa: E731
        x = rms(h, p("input_layernorm.weight"), eps)
        q = (x @ p("self_attn.q_proj.weight").T).view(q_len, nh, hd).transpose(0, 1)
        kv_in = torch.cat([ctx, x], 0)
        k = (kv_in @ p("self_attn.k_proj.weight").T).view(c_len + q_len, nkv, hd).transpose(0, 1)
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(c_len + q_len, nkv, hd).transpose(0, 1)
        q = rope(rms(q, p("self_attn.q_norm.weight"), eps), positions[-q_len:], theta)
        k = rope(rms(k, p("self_attn.k_norm.weight"), eps), positions, theta)
        out = torch.zeros(nh, q_len, hd, dtype=torch.float64)
        for head in range(nh):
            kh, vh = k[head // (nh // nkv)], v[head // (nh // nkv)]
            for qi in range(q_len):
                scores = (q[head, qi] @ kh.T) / hd**0.5
                vis = mask[qi] if mask is not None else torch.ones(c_len + q_len, dtype=torch.bool)
                if vis.any():
                    probs = torch.exp(scores[vis] - scores[vis].max())
                    out[head, qi] = (probs / probs.sum()) @ vh[vis]
        attn = out.transpose(0, 1).reshape(q_len, nh * hd) @ p("self_attn.o_proj.weight").T
        h = h + attn
        x = rms(h, p("post_attention_layernorm.weight"), eps)
        g, u = x @ p("mlp.gate_proj.weight").T, x @ p("mlp.up_proj.weight").T
        h = h + (torch.nn.functional.silu(g) * u) @ p("mlp.down_proj.weight").T
    return rms(h, sd["norm.weight"], eps)


@pytest.mark.parametrize("factory", [train_qwen3, train_llama])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("masked", [False, True])
def test_draft_matches_naive_attention(factory, backend, masked):
    target = factory()
    draft = train_draft(target, num_layers=2, block_size=4)
    torch.manual_seed(0)
    c_len, q_len, hidden = 9, 8, target.config.hidden_size
    noise = torch.randn(1, q_len, hidden)
    th = torch.randn(1, c_len, 2 * hidden)
    positions = torch.cat([torch.arange(c_len), torch.tensor([3, 4, 5, 6, 7, 8, 9, 10])])
    mask = None
    if masked:  # two blocks with anchors 3 and 7, one row entirely invisible
        mask = torch.zeros(q_len, c_len + q_len, dtype=torch.bool)
        mask[:4, :3] = True
        mask[:4, c_len : c_len + 4] = True
        mask[4:7, :7] = True
        mask[4:7, c_len + 4 :] = True
    with torch.no_grad():
        got = draft(noise, th, positions.unsqueeze(0), None if mask is None else mask[None, None], backend=backend)
    ref = naive_draft(draft, noise, th, positions, mask)
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def test_draft_has_no_embedding_or_head_and_contract_names():
    draft = train_draft(train_qwen3(), num_layers=2)
    names = set(draft.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= names
    assert not any(n.startswith("model.") for n in names)


def test_rotary_is_lazy_fp32_and_survives_meta_init():
    target = train_qwen3()
    cfg = train_draft(target).config
    with torch.device("meta"):
        draft = DFlashDraftModel(cfg)
    assert draft.rotary_emb._inv_freq is None  # nothing built on the meta device
    draft = draft.to_empty(device="cpu")
    draft.init_weights()
    draft = draft.to(torch.bfloat16)
    noise = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    out = draft(noise, torch.randn(1, 3, 128), torch.arange(7).unsqueeze(0))
    assert torch.isfinite(out).all()
    assert draft.rotary_emb._inv_freq.dtype == torch.float32
    assert draft.rotary_emb._inv_freq.device.type == "cpu"


def test_config_roundtrip(tmp_path):
    draft = train_draft(train_qwen3(), num_layers=2, block_size=8)
    draft.save_pretrained(tmp_path)
    cfg = DFlashConfig.from_pretrained(tmp_path)
    assert cfg.block_size == 8 and cfg.mask_token_id == draft.mask_token_id
    assert cfg.target_layer_ids == draft.target_layer_ids and cfg.num_target_layers == 6
    again = DFlashDraftModel.from_pretrained(tmp_path)
    for (n, a), (_, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_flex_attention_runs_in_the_autocast_dtype(monkeypatch):
    """Under autocast the fp32 norm weights leave q/k in fp32; flex_attention (not on autocast's
    list) must get the autocast dtype, as SDPA would, and the same output as SDPA under autocast."""
    from nemo_dflash.objective.block_mask import build_flex_block_mask, build_dense_block_mask
    from nemo_dflash.draft.model import modeling

    draft = train_draft(train_qwen3(), num_layers=1, block_size=4)
    seen = []
    real_flex = modeling._flex

    def spy(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real_flex(q, k, v, *a, **kw)

    monkeypatch.setattr(modeling, "_flex", spy)
    torch.manual_seed(0)
    hidden, c_len = draft.config.hidden_size, 12
    anchors, valid = torch.tensor([[3, 7]]), torch.tensor([[True, True]])
    noise, th = torch.randn(1, 8, hidden), torch.randn(1, c_len, len(draft.config.target_layer_ids) * hidden)
    pos = torch.cat([torch.arange(c_len), torch.tensor([3, 4, 5, 6, 7, 8, 9, 10])]).unsqueeze(0)
    key_valid = torch.ones(1, c_len)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        flex = draft(noise, th, pos, build_flex_block_mask(anchors, valid, key_valid, 4), backend="flex")
        dense = draft(noise, th, pos, build_dense_block_mask(anchors, valid, key_valid, 4), backend="eager")
    assert seen == [(torch.bfloat16,) * 3]
    torch.testing.assert_close(flex.float(), dense.float(), rtol=0.05, atol=0.05)  # bf16 attention either way
