"""AdamW and a warmup schedule from transformers (a library schedule, not our own)."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    warmup = int(math.ceil(cfg.warmup_ratio * total_steps))
    if cfg.scheduler == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    if cfg.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)
