"""A drafter in speculators' DFlash or DSpark format (speculators 0.9.0: models/dflash/config.py,
models/dspark/config.py), which speculators' `DFlashDraftModel` / `DSparkDraftModel.from_pretrained` and vLLM
load. Written without speculators installed. DSpark's heads keep speculators' names (markov_head.*,
confidence_head.*), and its blocks are ours: the first token is the verified one (sample_from_anchor false).

The body's weights keep their names; the embedding and the LM head stay the target's (speculators fills them
from the verifier when it loads). Layer ids: z-lab's `target_layer_ids` count the target's layers from 0 and
take each one's output (`hidden_states[i + 1]`), speculators' `aux_hidden_state_layer_ids` index
`hidden_states` itself, so they are each id + 1 (speculators' converter: convert/dflash/converter.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..model.drafter import IDENTITY_SCALES
from .source import Drafter, ExportError

SPECULATORS_VERSION = "0.9.0"  # the version whose config and model this format was checked against
# Keys of our config.json that are not the draft transformer's (speculators' converter drops the same).
_NOT_TRANSFORMER = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "logit_scale"}


def _unserved_scales(config: dict) -> dict:
    dflash = config["dflash_config"]
    return {k: dflash[k] for k, identity in IDENTITY_SCALES.items() if dflash.get(k, identity) != identity}


def speculators_config(config: dict, target: str, target_cfg: dict) -> dict:
    if "DFlash2DraftModel" in (config.get("architectures") or []):
        raise ExportError("the drafter is a DFlash 2 drafter (DFlash2DraftModel: convolutions and a candidate "
                          "selector), and --format speculators writes speculators' DFlash model, which has neither: "
                          "serve this directory as it is (z-lab's dflash or AutoModel, docs/serving.md)")
    if scales := _unserved_scales(config):
        raise ExportError(f"the drafter was trained with its target's {scales}, which speculators' DFlash model has "
                          "no key for (it applies no embedding scale, logit multiplier or softcap): its export would "
                          "draft other tokens than the drafter does. Serve this directory as it is (docs/serving.md)")
    if config.get("hidden_size") != target_cfg.get("hidden_size"):
        raise ExportError(f"the drafter's hidden_size {config.get('hidden_size')} differs from --target {target}'s "
                          f"{target_cfg.get('hidden_size')}: give the target the drafter was trained against")
    block_size = int(config["block_size"])
    dflash = config["dflash_config"]
    transformer = {k: v for k, v in config.items() if k not in _NOT_TRANSFORMER}
    dspark = "DSparkDraftModel" in (config.get("architectures") or [])
    algorithm = "dspark" if dspark else "dflash"
    heads = ({"markov_rank": dflash["markov_rank"], "markov_head_type": dflash["markov_head_type"],
              "enable_confidence_head": True,
              "confidence_head_with_markov": dflash["confidence_head_with_markov"]} if dspark else {})
    return {
        "architectures": ["DSparkDraftModel" if dspark else "DFlashDraftModel"],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": transformer,
        "draft_vocab_size": config["vocab_size"],
        "block_size": block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
        "mask_token_id": dflash["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,  # the first block token is the verified one: block_size - 1 are drafted
        "tie_word_embeddings": False,
        "dtype": config.get("dtype"),
        **heads,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": target, "architectures": target_cfg.get("architectures") or []},
        },
    }


def write(drafter: Drafter, target: str, target_cfg: dict, out: Path) -> None:
    config = speculators_config(drafter.config, target, target_cfg)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(drafter.weights, out / "model.safetensors")  # the same names: speculators' body is z-lab's
