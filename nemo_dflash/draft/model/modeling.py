"""The Qwen3-style DFlash draft model.

The draft predicts a whole block in one non-causal forward. Queries come from the block
tokens only; keys/values are `[ctx ; block]` where `ctx` is the fused target context
(`hidden_norm(fc(concat(target layers)))`), projected by the SAME k/v projections as the
block in every layer. The block/anchor structure lives entirely in the attention mask,
which the trainer module (`nemo_dflash.objective.trainer_module`) builds. The draft has no embedding and no
lm_head: both are the frozen target's.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from nemo_dflash.draft.model.configuration import DFlashConfig, rotary_dim
from nemo_dflash.engine.compiled import compiled

try:  # flex_attention is optional at import time (needs torch >= 2.5)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

AttnMask = Union[torch.Tensor, "BlockMask", None]


# Tiles for head_dim <= 64 (docs/performance.md). Forward: Inductor's H100/H200 default for bf16 at
# head_dim 64 is 128x128 with 4 warps; in the SmolLM2 draft's training step its forward took 12 ms
# per layer, six times its own backward, against 0.65 ms with 64x64 tiles (max-autotune's pick; H200).
# Backward: at the packed step's shape (4 x 8192-token rows, 5,120 anchors a row; H100) the default
# (64, 128, 128, 64; 8 warps) took 9.19 ms per layer, 64x64 tiles with 4 warps 8.22 ms.
_SMALL_HEAD_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                     "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3}


# Inductor's flex_attention kernel needs head_dim >= 16 (tl.dot); smaller heads (tiny test drafts) run the eager op
FLEX_MIN_HEAD_DIM = 16


def flex_kernel_options(head_dim: int) -> Optional[dict]:
    """The tiles the draft's flex_attention asks for at this head size (None: Inductor's defaults)."""
    return dict(_SMALL_HEAD_TILES) if head_dim <= 64 else None


def _flex(q, k, v, block_mask, scale, enable_gqa):
    """Compiled flex_attention on accelerators (the eager one materialises the scores).

    Compiled with automatic dynamic shapes: sequence length and anchor count change from
    batch to batch, and a static compile would recompile per shape until it hits dynamo's
    cache limit and silently falls back to the eager, memory-hungry kernel.
    """
    if q.device.type == "cpu" or q.shape[-1] < FLEX_MIN_HEAD_DIM:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    options = flex_kernel_options(q.shape[-1])
    return compiled(flex_attention)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                    kernel_options=options)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE whose frequency table is built lazily, in fp32, on the device of the positions.

    Built at first use (not in __init__) so that meta-device init, FSDP sharding and
    `from_pretrained` never leave a meta or low-precision table behind (a known resume bug).
    The table covers the rotated dimensions only (`rotary_dim`: head_dim times the target's
    `partial_rotary_factor`), neox (rotate-half) layout, as vLLM's and SGLang's `get_rope` build it
    from the exported config.json.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary_dim = rotary_dim(config)
        self._inv_freq: Optional[torch.Tensor] = None
        self._scaling = 1.0

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            rope = dict(getattr(self.config, "rope_parameters", None) or {})
            rope_type = rope.get("rope_type", "default")
            if rope_type == "default":
                base = float(rope.get("rope_theta", 10000.0))
                dim = self.rotary_dim
                inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
                self._inv_freq, self._scaling = inv, 1.0
            else:  # transformers' scaled types read partial_rotary_factor from rope_parameters themselves
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, device)
                self._inv_freq, self._scaling = inv.float(), float(scaling)
            if 2 * self._inv_freq.numel() != self.rotary_dim:
                raise ValueError(f"RoPE {rope_type!r} gave {self._inv_freq.numel()} frequencies for a rotary dim of "
                                 f"{self.rotary_dim}: check rope_parameters in the draft config")
        return self._inv_freq

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, P, rotary_dim] of `position_ids` [B, P]."""
        inv = self._table(position_ids.device)
        freqs = position_ids[..., None].float() * inv  # [B, P, rotary_dim/2], fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._scaling).to(dtype), (emb.sin() * self._scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, P, D]; cos/sin: [B, P, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first `cos.shape[-1]` head dimensions, the rest passed through (partial rotary,
    the layout of HF's Qwen3.5 and vLLM's `get_rope`); plain `apply_rope` when cos spans the head."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, use_sdpa: bool
) -> torch.Tensor:
    """Masked attention that returns 0 (not NaN) for rows that see no key.

    q: [B, Hq, Q, D]; k, v: [B, Hkv, K, D]; mask: bool [B, 1|Hq, Q, K] (True = visible) or None.
    """
    n_rep = q.shape[1] // k.shape[1]
    row_ok = None
    if mask is not None:
        row_ok = mask.any(dim=-1, keepdim=True)  # [B, 1, Q, 1]
        mask = mask | ~row_ok  # an empty row attends everywhere; its output is zeroed below
    if use_sdpa:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=n_rep > 1)
    else:
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
    if row_ok is not None:
        out = out * row_ok.to(out.dtype)
    return out


class DFlashContextCache:
    """Rotated context K/V per layer for speculative decoding.

    It only ever holds *verified* context: block K/V are recomputed each step and never
    stored, so there is nothing to crop after verification except via `crop` on rollback.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scale = self.head_dim**-0.5
        h, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttnMask,
        backend: str,
        cache: Optional[DFlashContextCache] = None,
    ) -> torch.Tensor:
        b, q_len, _ = hidden.shape
        c_len = context.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k_ctx, v_ctx = self._kv(context)
        k_blk, v_blk = self._kv(hidden)
        # cos/sin cover [new ctx ; block]; queries take the trailing q_len slice.
        k_ctx = apply_partial_rope(k_ctx, cos[:, :c_len], sin[:, :c_len])
        k_blk = apply_partial_rope(k_blk, cos[:, c_len:], sin[:, c_len:])
        q = apply_partial_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        if cache is not None:
            k_ctx, v_ctx = cache.update(self.layer_idx, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if backend == "flex":
            if torch.is_autocast_enabled(q.device.type):
                # flex_attention is not on autocast's list, and the fp32 norm weights leave q/k in fp32
                # (v in bf16): without this cast the kernel's dot products run in fp32, off the tensor
                # cores. SDPA under autocast computes in the autocast dtype, so both backends now agree.
                dt = torch.get_autocast_dtype(q.device.type)
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
            out = _flex(q, k, v, mask, self.scale, self.num_heads != self.num_kv_heads)
        else:
            out = dense_attention(q, k, v, mask, self.scale, use_sdpa=backend == "sdpa")
        out = out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden, context, cos, sin, mask, backend, cache=None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin, mask, backend, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(PreTrainedModel):
    """Qwen3-style DFlash draft. Parameter names match the serving contract unprefixed
    (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...)."""

    config_class = DFlashConfig
    base_model_prefix = "dflash"
    main_input_name = "noise_embedding"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False
    layer_cls: type[nn.Module] = DFlashDecoderLayer  # a variant's layers (`dflash2.DFlash2DecoderLayer`)

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        n_ctx_layers = len(config.target_layer_ids)
        if n_ctx_layers == 0:
            raise ValueError("DFlashConfig.dflash_config['target_layer_ids'] is empty: set the target layers to fuse.")
        self.fc = nn.Linear(n_ctx_layers * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.attn_backend = "sdpa"  # "sdpa" (dense mask), "eager" (explicit softmax) or "flex" (BlockMask)
        self.add_variant_modules(config)
        self.post_init()

    def add_variant_modules(self, config: DFlashConfig) -> None:
        """Where a variant adds the modules DFlash lacks (DFlash2's selector), before weights are initialised."""

    @property
    def has_selector(self) -> bool:
        """Whether proposals come from a candidate selector's walk (DFlash2, `propose_block`) rather than each
        slot's own distribution."""
        return False

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The slots' own logits from the lm_head's (a variant may scale or soft-cap them). Callers go through
        `slot_logits`, so the transform is applied once."""
        return logits

    def slot_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The slots' unary logits from the draft's final states `hidden` [..., H] through the target's lm_head:
        the one place `unary_logits` is applied. Every decoder, replay and the benchmarks form the slots' logits
        here; `propose_block` and the slot-wise proposals take them as they are (applied twice, a DFlash2 draft
        with a multiplier or a soft-cap would decode other tokens and q than it trained and replays with)."""
        return self.unary_logits(lm_head(hidden.to(lm_head.weight.dtype)))

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, S, n_layers*H] concatenated target features -> [B, S, H] draft context."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: AttnMask = None,
        cache: Optional[DFlashContextCache] = None,
        backend: Optional[str] = None,
        block_size: Optional[int] = None,
    ) -> torch.Tensor:
        """Run the draft over block tokens (`block_size`: the blocks' length, which the attention mask alone
        carries here; a variant that mixes positions within a block reads it).

        noise_embedding: [B, Q, H] embedded block tokens (anchor + MASKs), Q = n_blocks * block_size.
        target_hidden: [B, C, n_layers*H] target features of the (new) context.
        position_ids: [B, C + Q] positions of `[context ; block]` keys (queries use the last Q).
        attention_mask: bool [B, 1, Q, K] (True = visible), a flex BlockMask, or None (all visible).
            With a cache, K = cached + C + Q.
        Returns the final-normed block hidden states [B, Q, H]; logits come from the target's lm_head.
        """
        backend = backend or self.attn_backend
        if backend == "flex" and BlockMask is not None and not isinstance(attention_mask, BlockMask):
            backend = "sdpa"
        context = self.fuse_context(target_hidden.to(self.fc.weight.dtype))
        hidden = noise_embedding.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        extra = self.layer_args(hidden.shape[1], block_size)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask, backend, cache, *extra)
        return self.norm(hidden)

    def layer_args(self, q_len: int, block_size: Optional[int]) -> tuple:
        """What a variant's layers take beyond DFlash's (DFlash2's: the blocks' length)."""
        return ()


__all__ = ["DFlashDraftModel", "DFlashContextCache", "dense_attention", "apply_partial_rope", "apply_rope"]
