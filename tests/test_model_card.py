"""The published drafter's model card: the hub's front matter, tau rewritten by each evaluation, and what each
engine does with the target's scales said plainly."""

from dflash_trainer.run import model_card
from huggingface_hub import ModelCard

CONFIG = {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3]}, "block_size": 8,
          "num_hidden_layers": 2, "hidden_size": 64, "target_model_type": "qwen3", "num_target_layers": 6,
          "dtype": "bfloat16"}


def test_card_front_matter_and_tau_rewritten_by_an_evaluation(tmp_path):
    model_card.write_card(tmp_path, CONFIG, "Qwen/Qwen3-8B", ["data/train.jsonl"], 300)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-8B" and "dflash" in card.data.tags
    assert "Not measured yet" in card.text and "data/train.jsonl" in card.text
    rows = [model_card.TauRow("mt-bench", 80, 3.456), model_card.TauRow("gsm8k", 100, 4.0)]
    assert model_card.update_tau(tmp_path, rows, "measured by a test")
    text = (tmp_path / "README.md").read_text()
    assert "| mt-bench | 80 | 3.46 |" in text and "| gsm8k | 100 | 4.00 |" in text and "Not measured" not in text
    assert model_card.update_tau(tmp_path, rows[:1], "again") and "gsm8k" not in (tmp_path / "README.md").read_text()


def test_a_directory_without_our_card_is_left_alone(tmp_path):
    assert not model_card.update_tau(tmp_path, [model_card.TauRow("x", 1, 2.0)], "s")
    (tmp_path / "README.md").write_text("someone else's card\n")
    assert not model_card.update_tau(tmp_path, [model_card.TauRow("x", 1, 2.0)], "s")
    assert (tmp_path / "README.md").read_text() == "someone else's card\n"


def test_a_local_target_is_no_base_model_and_unserved_scales_are_said(tmp_path):
    gemma = {**CONFIG, "dflash_config": {**CONFIG["dflash_config"], "input_embedding_scale": 8.0}}
    text = model_card.card_text(gemma, str(tmp_path), [], None, [], "")
    assert "base_model" not in text.split("---")[1]
    assert "cannot serve this drafter faithfully" in text and "`input_embedding_scale` = 8.0" in text
    plain = model_card.card_text(CONFIG, "Qwen/Qwen3-8B", [], None, [], "")
    assert "The target's scales" not in plain and '"num_speculative_tokens": 7' in plain


def test_a_dspark_card_serves_its_speculators_export_with_vllms_dspark_method():
    dspark = {**CONFIG, "architectures": ["DSparkDraftModel"]}
    text = model_card.card_text(dspark, "Qwen/Qwen3-8B", [], None, [], "")
    assert "dflash-export --format speculators" in text and '"method": "dspark"' in text
    assert "from dflash.model import" not in text


def test_a_dflash2_card_names_its_class_and_no_speculators_export():
    dflash2 = {**CONFIG, "architectures": ["DFlash2DraftModel"]}
    text = model_card.card_text(dflash2, "Qwen/Qwen3-8B", [], None, [], "")
    assert "from dflash.model import DFlash2DraftModel" in text and "--format speculators" not in text
    plain = model_card.card_text(CONFIG, "Qwen/Qwen3-8B", [], None, [], "")
    assert "from dflash.model import DFlashDraftModel" in plain and "--format speculators" in plain
