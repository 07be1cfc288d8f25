"""Training objective: anchors, blocks, the attention mask, chunked loss, flex vs dense reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from dflash_trainer.model.anchors import build_blocks, default_gamma, sample_anchors
from dflash_trainer.model.loss import chunked_block_loss
from dflash_trainer.model.mask import dense_mask, dflash_block_mask
from torch.nn.attention.flex_attention import BlockMask

from tests.helpers.attention import reference_block_mask


def brute_force_mask(anchors, keep, block, ctx_len):
    """The visibility rule written as plainly as possible, one (b, q, kv) at a time."""
    b, n = anchors.shape
    out = torch.zeros(b, n * block, ctx_len + n * block, dtype=torch.bool)
    for i in range(b):
        for q in range(n * block):
            j = q // block
            if not keep[i, j]:
                continue
            for t in range(ctx_len + n * block):
                if t < ctx_len:
                    out[i, q, t] = t < anchors[i, j]
                else:
                    out[i, q, t] = (t - ctx_len) // block == j
    return out


def random_case(seed, b=2, ctx_len=150, n=5, block=4):
    g = torch.Generator().manual_seed(seed)
    lm = torch.rand(b, ctx_len, generator=g) < 0.7
    lm[1, ctx_len // 3:] = False  # the second sample has few valid positions
    lm[1, : ctx_len // 3 - 6] = False
    anchors, keep = sample_anchors(lm, n, g)
    return lm, anchors, keep


def test_anchors_are_sorted_valid_unique_and_padded():
    lm, anchors, keep = random_case(0, n=8)
    for i in range(2):
        a = anchors[i][keep[i]].tolist()
        assert a == sorted(a) and len(set(a)) == len(a)
        assert all(lm[i, x] and lm[i, x + 1] for x in a)
        valid = int((lm[i, :-1] & lm[i, 1:]).sum())
        assert int(keep[i].sum()) == min(8, valid)
        assert anchors[i][~keep[i]].eq(0).all()


def test_anchors_pad_when_sequences_are_shorter_than_the_anchor_count():
    lm = torch.ones(1, 6, dtype=torch.bool)
    anchors, keep = sample_anchors(lm, 10)
    assert anchors.shape == (1, 10) and int(keep.sum()) == 5


@pytest.mark.parametrize("ctx_len", [150, 128, 257])
def test_block_mask_matches_brute_force(ctx_len):
    for seed in range(3):
        _, anchors, keep = random_case(seed, ctx_len=ctx_len)
        reference = brute_force_mask(anchors, keep, 4, ctx_len)
        assert torch.equal(dense_mask(anchors, keep, 4, ctx_len)[:, 0], reference)
        bm = dflash_block_mask(anchors, keep, 4, ctx_len)
        assert bm.shape[-2:] == (5 * 4, ctx_len + 5 * 4)
        # The same tiles as create_block_mask evaluating mask_mod everywhere, and the same full tiles.
        generic = reference_block_mask(anchors, keep, 4, ctx_len)
        assert torch.equal(bm.to_dense(), generic.to_dense())
        assert torch.equal(bm.full_kv_num_blocks, generic.full_kv_num_blocks)
        # The backward's Q-direction tables, set from the transposed tiles, are what torch derives.
        derived = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                           bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE, seq_lengths=bm.seq_lengths)
        for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(bm, name), getattr(derived, name)), name
        # Every tile the BlockMask skips is empty in the reference (no visible pair is dropped).
        dense_tiles = bm.to_dense()[:, 0].bool()
        tile_q, tile_kv = bm.BLOCK_SIZE
        for i in range(anchors.shape[0]):
            for qt in range(dense_tiles.shape[1]):
                for kt in range(dense_tiles.shape[2]):
                    tile = reference[i, qt * tile_q:(qt + 1) * tile_q, kt * tile_kv:(kt + 1) * tile_kv]
                    if tile.any():
                        assert dense_tiles[i, qt, kt]


def test_blocks_labels_weights_and_inputs():
    ids = torch.arange(100, 140).unsqueeze(0)
    lm = torch.zeros(1, 40, dtype=torch.uint8)
    lm[0, 10:38] = 1
    anchors, keep = torch.tensor([[12, 30, 0]]), torch.tensor([[True, True, False]])
    blk = build_blocks(ids, lm, anchors, keep, block_size=16, mask_token_id=7)
    tok = blk.token_ids.view(3, 16)
    assert tok[0, 0] == 112 and tok[1, 0] == 130 and tok[0, 1:].eq(7).all() and tok[2].eq(7).all()
    assert blk.position_ids.view(3, 16)[1].tolist() == list(range(30, 46))
    lab = blk.labels.view(3, 16)
    assert lab[0, 3] == 115  # same position: slot k predicts x[a + k]
    w = blk.weights.view(3, 16)
    assert w[0, 0] == 0 and w[0, 1] == 1 and math.isclose(w[0, 2], math.exp(-1 / 7), rel_tol=1e-6)
    assert w[1, 8:].eq(0).all()  # a+k >= 38 is outside the loss mask (and a+k >= 40 outside the sequence)
    assert w[1, 7] > 0 and w[2].eq(0).all()
    assert default_gamma(16) == 7.0


def test_chunked_loss_equals_the_full_computation():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 16, generator=g, requires_grad=True)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(50, (2, 24), generator=g)
    weights = torch.rand(2, 24, generator=g) * (torch.rand(2, 24, generator=g) > 0.3)
    weights.view(2, 6, 4)[:, :, 0] = 0  # slot 0, the anchor, never carries loss (build_blocks)
    scale = torch.tensor(0.37, requires_grad=True)  # the backward must apply the incoming gradient
    x = hidden * scale  # and flow on to what produced the hidden states
    sums = chunked_block_loss(x, head, labels, weights, block_size=4, chunk_rows=7)
    grad_chunked = torch.autograd.grad(3.0 * sums.weighted_loss, (hidden, scale))
    x = hidden * scale
    logits = x @ head.T
    full = (F.cross_entropy(logits.view(-1, 50), labels.view(-1), reduction="none") * weights.view(-1)).sum()
    grad_full = torch.autograd.grad(3.0 * full, (hidden, scale))
    torch.testing.assert_close(sums.weighted_loss, full)
    torch.testing.assert_close(grad_chunked, grad_full)
    hit = (logits.argmax(-1) == labels) & (weights > 0)
    assert sums.slot_correct.tolist() == hit.view(-1, 4).sum(0).float().tolist()
    assert sums.slot_count.tolist() == (weights > 0).view(-1, 4).sum(0).float().tolist()
    with torch.no_grad():  # evaluation: same sums, no gradient work
        again = chunked_block_loss(x, head, labels, weights, block_size=4, chunk_rows=5)
    torch.testing.assert_close(again.weighted_loss, full.detach())
    assert again.slot_correct.tolist() == sums.slot_correct.tolist()


def test_chunked_loss_in_bf16_matches_the_fp32_reference():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
    head = (torch.randn(300, 32, generator=g) * 0.3).bfloat16()
    labels = torch.randint(300, (1, 40), generator=g)
    weights = torch.rand(1, 40, generator=g)
    weights.view(1, 5, 8)[:, :, 0] = 0  # slot 0, the anchor, never carries loss
    sums = chunked_block_loss(hidden.unsqueeze(0), head, labels, weights, block_size=8, chunk_rows=16)
    (grad,) = torch.autograd.grad(sums.weighted_loss, hidden)
    ref_h = hidden.detach().float().requires_grad_()
    ref = (F.cross_entropy(ref_h @ head.float().T, labels[0], reduction="none") * weights[0]).sum()
    (ref_grad,) = torch.autograd.grad(ref, ref_h)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(sums.weighted_loss, ref, rtol=2e-3, atol=1e-2)
    torch.testing.assert_close(grad.float(), ref_grad, rtol=0.05, atol=2e-3)


def test_chunked_loss_refuses_a_trainable_head():
    head = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match="must be frozen"):
        chunked_block_loss(torch.randn(1, 8, 4), head, torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8), 4)


@pytest.mark.slow
def test_flex_path_equals_dense_sdpa_reference_on_cpu():
    """The drafter with compiled flex_attention (CPU: forward only) equals the SDPA reference."""
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
    from dflash_trainer.model.objective import block_attention
    from transformers import Qwen3Config

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = DFlashDrafter(drafter_config(tc, DrafterShape(num_layers=2, block_size=4, mask_token_id=3))).eval()
    lm, anchors, keep = random_case(1, ctx_len=200, n=6)
    ids = torch.randint(64, lm.shape)
    blocks = build_blocks(ids, lm.to(torch.uint8), anchors, keep, 4, 3)
    feats = torch.randn(2, 200, 2 * 32)
    emb = torch.randn(64, 32)
    pos = torch.cat([torch.arange(200).expand(2, -1), blocks.position_ids], 1)
    x = F.embedding(blocks.token_ids, emb)
    with torch.no_grad():
        ref = model(feats, x, pos, block_attention("sdpa", blocks, 200, 4, model.config))
        flex = model(feats, x, pos, block_attention("flex", blocks, 200, 4, model.config))
    torch.testing.assert_close(flex, ref, rtol=1e-4, atol=1e-4)


def test_prepare_micro_batch_is_the_helpers_in_order():
    """The train loop, the compile step's probe and the bench all build a micro-batch through it."""
    from dflash_trainer.model.drafter import DrafterShape, drafter_config
    from dflash_trainer.model.objective import prepare_micro_batch
    from transformers import Qwen3Config

    g = torch.Generator().manual_seed(3)
    ctx_len, n, block = 300, 12, 4
    lm = (torch.rand(2, ctx_len, generator=g) < 0.7).to(torch.uint8)
    ids = torch.randint(64, (2, ctx_len), generator=g)
    tc = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    dc = drafter_config(tc, DrafterShape(num_layers=2, block_size=block, mask_token_id=3))
    mb = prepare_micro_batch(ids, lm, n, dc, 3, 2.0, "sdpa", torch.Generator().manual_seed(5))
    anchors, keep = sample_anchors(lm, n, torch.Generator().manual_seed(5))
    blocks = build_blocks(ids, lm, anchors, keep, block, 3, 2.0)
    for name in ("anchors", "keep", "token_ids", "position_ids", "labels", "weights"):
        assert torch.equal(getattr(mb.blocks, name), getattr(blocks, name)), name
    assert mb.visible_pairs == ((anchors + block) * block * keep).sum()
    with pytest.raises(ValueError, match="unknown attention backend"):
        prepare_micro_batch(ids, lm, n, dc, 3, None, "dense")
