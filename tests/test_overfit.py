"""One-sample overfit: a drafter trained on one target-generated answer must accept full blocks (tau = B).

This is the train/serve alignment gate (labels at the same position, context strictly before the
anchor, slot-1 weight 1): a drafter that memorises one sample under the training objective must
reproduce it under real speculative decoding against the target.
"""

import torch
from dflash_trainer.model.drafter import DFlashDrafter, DrafterShape, drafter_config
from dflash_trainer.model.optim import MasterWeightAdamW
from dflash_trainer.run.evaluate import evaluate_tau, speculative_generate
from dflash_trainer.target.frozen import FrozenTarget
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.training import sdpa_step

BLOCK = 8


def test_one_sample_overfit_reaches_tau_equal_to_block_size(tiny_target):
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_target["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_target["target"], dtype=torch.float32)
    config = drafter_config(model.config, DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=tok.mask_token_id))
    target = FrozenTarget(model, config.dflash_config["target_layer_ids"])
    drafter = DFlashDrafter(config)

    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 3 to 9."}], tokenize=False,
                                     add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    answer_len = 1 + 3 * BLOCK  # the prefill token, then three full blocks
    with torch.no_grad():  # the target's own greedy answer: what the drafter must predict
        full = model.generate(torch.tensor([prompt_ids]), max_new_tokens=answer_len, min_new_tokens=answer_len,
                              do_sample=False)[0].tolist()
    ids = torch.tensor([full])
    loss_mask = torch.zeros_like(ids, dtype=torch.uint8)
    loss_mask[0, len(prompt_ids):] = 1
    feats = target.features(ids)

    opt = MasterWeightAdamW(drafter.parameters(), lr=3e-3, max_grad_norm=1.0)
    for step in range(300):
        sdpa_step(drafter, opt, target, ids, loss_mask, feats, answer_len, step)
        if step % 50 == 49 and evaluate_tau(drafter, target, [prompt_ids], answer_len).tau == BLOCK:
            break

    result = speculative_generate(drafter, target, prompt_ids, max_new_tokens=answer_len)
    assert result.tokens == full  # speculative decoding is lossless: the target's greedy answer
    assert result.accept_lengths == [BLOCK] * 3, f"accepted {result.accept_lengths} after {step + 1} steps"
