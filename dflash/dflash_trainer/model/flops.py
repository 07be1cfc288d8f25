"""Model FLOPs of a drafter step, and MFU against the GPU's dense bf16 peak.

Convention (README, "Performance"): useful model FLOPs (2 per multiply-add; attention
counted over the visible query-key pairs only, not the padded tiles), forward + backward, divided
by the datasheet dense bf16 peak (989 TFLOP/s for H100/H200), the convention SpecForge's 43.5% uses.
Backward: 2x forward for trained layers and attention; the frozen LM head and the fc input need
only one of their two gradients. The head runs on the B-1 scored slots of each block only.
"""

from __future__ import annotations

import torch

# Dense bf16 datasheet peaks, TFLOP/s.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0,
               "RTX PRO 6000": 503.8, "L40S": 362.0}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def visible_pairs(anchors: torch.Tensor, keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """Query-key pairs the DFlash mask allows: each kept block sees a_j context keys + B block keys."""
    return ((anchors + block_size) * block_size * keep).sum()


def drafter_step_flops(config, batch: int, ctx_len: int, num_blocks: int, pairs: float, vocab: int) -> float:
    h, layers = config.hidden_size, config.num_hidden_layers
    d, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    k_feats = len(config.dflash_config["target_layer_ids"])
    q_rows = batch * num_blocks * config.block_size
    kv_rows = batch * ctx_len + q_rows
    per_layer = 2 * (q_rows * h * nh * d + 2 * kv_rows * h * nkv * d + q_rows * nh * d * h + 3 * q_rows * h * inter)
    attention = 4 * pairs * d * nh  # QK^T and PV over the visible pairs
    fc = 2 * batch * ctx_len * k_feats * h * h
    head = 2 * batch * num_blocks * (config.block_size - 1) * h * vocab  # slot 0 (the anchor) has no head rows
    dflash, selector = config.dflash_config, 0
    if "selector_rank" in dflash:  # DFlash 2: two kernel projections per layer, the selector's hidden projection
        groups = h // int(dflash["conv_group_size"])
        per_layer += 2 * 2 * q_rows * h * 2 * int(dflash["conv_kernel_size"]) * groups
        selector = 2 * batch * num_blocks * (config.block_size - 1) * h * int(dflash["selector_rank"])
    if "markov_rank" in dflash:  # DSpark: the Markov bias's rank x vocab GEMM, trained (forward, both gradients)
        selector = 2 * batch * num_blocks * (config.block_size - 1) * int(dflash["markov_rank"]) * vocab
    return 3 * (layers * (per_layer + attention) + selector) + 2 * fc + 2 * head
