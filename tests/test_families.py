"""Model families (kdrun/models/adaptors.py): the features record, truncation and describe() of tiny random
BERT, RoBERTa, DistilBERT, ELECTRA and DeBERTa-v2 models, token types only where a family takes them,
refusals naming the family, and distillation runs with a BERT teacher and a student of each family."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kdrun.engine.objective import plan_stages
from kdrun.models import loading as M
from kdrun.models.adaptors import ADAPTORS, check_features, get_adaptor
from kdrun.models.features import extract_features, model_inputs
from tests.conftest import compose

FAMILIES = ["bert", "roberta", "distilbert", "electra", "deberta-v2"]
ALL_NEEDS = frozenset({"logits", "hidden_states", "attentions", "attention_scores", "qkv"})
B, N, D, H, L = 3, 7, 16, 2, 3


def tiny(family: str, layers: int = L, attentions: bool = True, seed: int = 0):
    cfg = SimpleNamespace(family=family, hidden_size=D, num_hidden_layers=layers, num_attention_heads=H,
                          intermediate_size=2 * D, dropout=None)
    torch.manual_seed(seed)
    return M.random_classifier(cfg, 60, 2, need_attentions=attentions).eval()


def batch(n: int = N) -> dict[str, torch.Tensor]:
    """Padded sentence pairs: segment ids of 1 on the second sentence (a BERT tokenizer's pairs)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, n - 2:] = 0
    mask[2, 3:] = 0
    ids = torch.randint(5, 60, (B, n), generator=g) * mask
    types = (torch.arange(n) >= n // 2).long().expand(B, n) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


@pytest.mark.parametrize("family", FAMILIES)
def test_features_record_shapes_and_scores_reproduce_eager_attention(family: str) -> None:
    model, b = tiny(family), batch()
    f = extract_features(model, b, ALL_NEEDS)
    assert f.logits.shape == (B, 2)
    assert len(f.hidden_states) == L + 1 and all(h.shape == (B, N, D) for h in f.hidden_states)
    assert len(f.attentions) == L and all(a.shape == (B, H, N, N) for a in f.attentions)
    rec = f.qkv()
    assert rec.num_layers == L and rec.heads == H
    for which in ("q", "k", "v"):
        assert rec.projection(which, L).shape == (B, N, D)
        assert rec.heads_of(which, 1).shape == (B, H, N, D // H)
    # the scores are the logits of the layer's own softmax: masked over padded keys they give its
    # attention probabilities (rows of padded queries differ by family and are never read)
    key_pad = ~b["attention_mask"].bool()[:, None, None, :]
    real_q = b["attention_mask"].bool()
    for layer in range(1, L + 1):
        scores = f.attention_scores(layer)
        assert scores.shape == (B, H, N, N) and scores.dtype == torch.float32
        probs = scores.masked_fill(key_pad, float("-inf")).softmax(-1)
        got, want = probs.permute(0, 2, 1, 3)[real_q], f.attentions[layer - 1].permute(0, 2, 1, 3)[real_q]
        assert torch.allclose(got, want, atol=1e-5), (family, layer, (got - want).abs().max())
    with pytest.raises(IndexError, match=f"layers 1..{L}"):
        f.attention_scores(L + 1)


def test_deberta_scores_hold_the_disentangled_terms_and_hooks_stay_registered_once() -> None:
    model, b = tiny("deberta-v2"), batch()
    f = extract_features(model, b, ALL_NEEDS)
    rec = f.qkv()
    attn = M.attention_projections(model)[0]
    # scale 1/sqrt(3 d_head) with c2p and p2c, and the relative terms move the scores off plain Q K^T
    assert rec.scaling == pytest.approx(1 / math.sqrt(3 * D // H))
    plain = rec.heads_of("q", 1) @ rec.heads_of("k", 1).transpose(-1, -2) * rec.scaling
    assert not torch.allclose(plain, f.attention_scores(1), atol=1e-3)
    # the hooks stay registered (a compiled model keeps them), once, however many extractions ran
    again = extract_features(model, b, ALL_NEEDS)
    assert torch.equal(again.attention_scores(1), f.attention_scores(1))
    assert all(len(getattr(attn, n)._forward_hooks) == 1 for n in ADAPTORS["deberta-v2"].projections)
    # the same logits without capturing anything, and nothing kept from that pass
    assert torch.allclose(extract_features(model, b, frozenset({"logits"})).logits, f.logits, atol=1e-6)
    from kdrun.models.features import capture_of

    assert all(x is None for w in ("q", "k", "v") for x in capture_of(model).store[w])


@pytest.mark.parametrize("family", [f for f in FAMILIES if ADAPTORS[f].sdpa])
def test_sdpa_gives_the_same_scores_and_logits(family: str) -> None:
    eager, b = tiny(family), batch()
    sdpa = tiny(family, attentions=False)
    assert sdpa.config._attn_implementation == "sdpa"
    needs = frozenset({"logits", "attention_scores"})
    fe, fs = extract_features(eager, b, needs), extract_features(sdpa, b, needs)
    assert torch.allclose(fe.logits, fs.logits, atol=1e-5)
    assert torch.allclose(fe.attention_scores(2), fs.attention_scores(2), atol=1e-5)


def test_deberta_stays_eager() -> None:
    model = tiny("deberta-v2", attentions=False)
    assert model.config._attn_implementation == "eager"
    M.set_attn_implementation(model, False)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", FAMILIES)
def test_truncation_keeps_the_first_layers(family: str) -> None:
    full, b = tiny(family, layers=4), batch()
    short = M.truncate_layers(full, 2)
    assert len(M.encoder_layers(short)) == 2 and len(M.encoder_layers(full)) == 4
    assert M.describe(short)["layers"] == 2 and short.config.num_hidden_layers == 2
    assert all(a is not b_ for a, b_ in zip(M.encoder_layers(short), M.encoder_layers(full)))  # a copy
    needs = frozenset({"hidden_states", "attention_scores"})
    fs, ff = extract_features(short, b, needs), extract_features(full, b, needs)
    assert len(fs.hidden_states) == 3
    for i in range(3):
        assert torch.equal(fs.hidden_states[i], ff.hidden_states[i])
    assert torch.equal(fs.attention_scores(2), ff.attention_scores(2))
    with pytest.raises(ValueError, match="choose 1..4"):
        M.truncate_layers(full, 5)


@pytest.mark.parametrize("family", FAMILIES)
def test_describe(family: str) -> None:
    model = tiny(family)
    info = M.describe(model)
    assert {k: info[k] for k in ("layers", "hidden", "heads", "family")} == {
        "layers": L, "hidden": D, "heads": H, "family": family}
    assert info["params_m"] == round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    assert type(model.config).__name__ == ADAPTORS[family].config_class


@pytest.mark.parametrize("family,types", [("bert", True), ("electra", True), ("roberta", False),
                                          ("distilbert", False), ("deberta-v2", False)])
def test_token_types_only_where_the_family_takes_them(family: str, types: bool) -> None:
    model, b = tiny(family), batch()
    assert ("token_type_ids" in model_inputs(b, model)) is types
    assert "token_type_ids" in model_inputs(b)  # without a model: the batch's inputs as they are
    if family == "roberta":  # segment ids of 1 index past its one-entry table
        with pytest.raises(IndexError):
            model(**b)


def test_roberta_positions_fit_512_tokens_after_the_padding_offset() -> None:
    model = tiny("roberta")
    assert model.config.pad_token_id == 0 and model.config.max_position_embeddings == 513
    ids = torch.randint(5, 60, (1, 512))
    assert model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape == (1, 2)
    other = M.random_classifier(SimpleNamespace(family="roberta", hidden_size=D, num_hidden_layers=1,
                                                num_attention_heads=H, intermediate_size=D, dropout=None),
                                60, 2, pad_token_id=1)
    assert other.config.max_position_embeddings == 514  # roberta-base's: padding index 1


def test_unknown_families_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="model.family='albert' is not one of bert, roberta"):
        M.random_classifier(SimpleNamespace(family="albert"), 60, 2)
    other = SimpleNamespace(config=SimpleNamespace(model_type="xlnet"))
    with pytest.raises(ValueError, match="model family 'xlnet': loss 'tinybert_embedding' \\(student hidden_states\\)"):
        check_features(plan_stages(compose(["objective=tinybert"]).objective), other, None)
    check_features(plan_stages(compose(["objective=logit"]).objective), other, other)  # logits only: fine
    with pytest.raises(ValueError, match="'xlnet': kdrun has layer access for bert, roberta, electra, distilbert, "
                                         "deberta-v2 only"):
        get_adaptor(other)


def test_preflight_refuses_an_unknown_family(run_cfg) -> None:
    from kdrun.app.run import ConfigError, preflight

    with pytest.raises(ConfigError, match="student.family='albert' must be one of bert, roberta"):
        preflight(run_cfg("student.family=albert"))
    assert compose(["student=tiny_random"]).student.family == "bert"  # existing configs are BERT


# ---------------------------------------------------------------------------------- end to end

SMALL = ["experiment=quickstart", "logger=none", "task.toy.num_train=64", "task.toy.num_validation=32",
         "train.epochs=1", "teacher.finetune.epochs=1", "train.eval_batch_size=64",
         "train.checkpoint_every_steps=null"]
STUDENTS = {"roberta": "tiny_roberta", "distilbert": "tiny_distilbert", "electra": "tiny_electra",
            "deberta-v2": "tiny_deberta"}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families_cache")


def _run(run_dir: Path, cache: Path, *overrides: str) -> dict:
    from kdrun.app.run import run

    out = run(compose([*SMALL, f"cache_dir={cache}", *overrides]), run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [v for line in lines for k, v in line.items() if k.startswith("train/")]
    assert train and all(math.isfinite(v) for v in train)
    return out


@pytest.mark.parametrize("objective", ["tinybert", "ckd", "logit"])
@pytest.mark.parametrize("family", list(STUDENTS))
def test_bert_teacher_distils_into_each_family(family: str, objective: str, tmp_path: Path,
                                               shared_cache: Path) -> None:
    """`kdrun experiment=quickstart student=tiny_<family> teacher=tiny_random objective=...`."""
    out = _run(tmp_path, shared_cache, f"student={STUDENTS[family]}", "teacher=tiny_random", f"objective={objective}")
    assert out["student"]["info"]["family"] == family and out["teacher"]["info"]["family"] == "bert"
    assert out["student"]["info"]["layers"] == 2
    assert 0.0 <= out["student"]["metrics"]["validation"]["accuracy"] <= 1.0
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "student")
    assert saved.config.model_type == family


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["tinybert", "ckd", "logit"])
def test_pretrained_minilm_teacher_with_a_roberta_student(objective: str, tmp_path: Path,
                                                          shared_cache: Path) -> None:
    """The realistic case: the real all-MiniLM-L6-v2 (BERT, 12 heads) teaches a RoBERTa student;
    TinyBERT's attention loss needs the teacher's head count, so that student has 12 heads."""
    heads = ["student.hidden_size=48", "student.num_attention_heads=12"] if objective == "tinybert" else []
    out = _run(tmp_path, shared_cache, "student=tiny_roberta", f"objective={objective}", *heads)
    assert out["teacher"]["info"] | {"params_m": 0} == {"layers": 6, "hidden": 384, "heads": 12, "params_m": 0,
                                                      "family": "bert"}
    assert out["student"]["info"]["family"] == "roberta"


@pytest.mark.slow
def test_tinybert_refuses_unequal_heads_across_families(shared_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tinybert_attention.*student has 2 heads and the teacher 12"):
        _run(tmp_path, shared_cache, "student=tiny_distilbert", "objective=tinybert")
