"""General (task-agnostic) distillation: the corpus task kind, the masked-LM distribution term
against a naive implementation, masking, label-free objectives on tiny models, exact mid-corpus
resume, and the saved student as the student of a task run."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdrun.app.run import run
from kdrun.engine.trainer import SimulatedInterrupt
from kdrun.errors import ConfigError
from kdrun.models.features import Features, extract_features
from kdrun.strategies.general.data import CorpusCollator
from kdrun.tasks.data.common import DataError

WORDS = ("the cat sat on a mat while dogs ran through green fields under bright summer skies and birds sang "
         "songs of rivers mountains cities").split()


def write_corpus(path: Path, docs: int = 80, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            for _ in range(rng.randint(1, 5)):
                f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "\n")
            f.write("\n")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


def corpus_args(corpus: Path, objective: str, *extra: str) -> list[str]:
    return ["task=text_corpus", f"task.data_files={corpus}", "task.validation_percent=15", "task.max_seq_length=24",
            f"objective={objective}", "train.epochs=1", "train.eval_batch_size=16", *extra]


# --------------------------------------------------------------------------- the masked-LM term

def naive_mlm_kd(zs: torch.Tensor, zt: torch.Tensor, temperature: float) -> float:
    """-sum_v p_t(v) log p_s(v), averaged over the masked tokens, with explicit loops."""
    total = 0.0
    for row_s, row_t in zip(zs.tolist(), zt.tolist()):
        es = [math.exp(x / temperature) for x in row_s]
        et = [math.exp(x / temperature) for x in row_t]
        zs_sum, zt_sum = sum(es), sum(et)
        total += -sum((b / zt_sum) * math.log(a / zs_sum) for a, b in zip(es, et))
    return total / len(zs)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_mlm_kd_matches_naive_soft_cross_entropy(temperature: float) -> None:
    from kdrun.losses.mlm import MLMParams, mlm_kd

    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(7, 11, generator=g, dtype=torch.float64), 3 * torch.randn(7, 11, generator=g,
                                                                                  dtype=torch.float64)
    mask = torch.ones(2, 5)
    value = mlm_kd(Features(None, mask, mlm_logits=zs), Features(None, mask, mlm_logits=zt), {}, None,
                   MLMParams(temperature=temperature))
    assert float(value) == pytest.approx(naive_mlm_kd(zs, zt, temperature), rel=1e-9)
    # equal distributions: the loss is the teacher's entropy (its minimum), not zero
    same = mlm_kd(Features(None, mask, mlm_logits=zt), Features(None, mask, mlm_logits=zt), {}, None,
                  MLMParams(temperature=temperature))
    pt = torch.softmax(zt / temperature, -1)
    assert float(same) == pytest.approx(float(-(pt * pt.log()).sum(-1).mean()), rel=1e-9)


def tiny_mlm(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    return BertForMaskedLM(cfg).eval()


def test_masked_rows_only_give_the_full_heads_logits_at_those_positions() -> None:
    model = tiny_mlm()
    ids = torch.randint(5, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    positions = torch.tensor([1, 4, 9 + 3, 18 + 2, 18 + 5])
    batch = {"input_ids": ids, "attention_mask": mask, "mlm_positions": positions}
    with torch.no_grad():
        feats = extract_features(model, batch, frozenset({"mlm_logits", "hidden_states"}))
        full = model(input_ids=ids, attention_mask=mask).logits
    assert feats.logits is None and feats.mlm_logits.shape == (5, 50)
    torch.testing.assert_close(feats.mlm_logits, full.reshape(-1, 50)[positions])
    assert len(feats.hidden_states) == 3
    # the gathering hook stays registered (once) but acts only inside extract_features: the plain
    # forward above gave every position's logits
    assert len(model.cls._forward_pre_hooks) == 1 and full.shape == (3, 9, 50)


# ------------------------------------------------------------------------------------- masking

def test_masking_is_bert_like_deterministic_per_segment_and_spares_special_tokens() -> None:
    col = CorpusCollator(pad_token_id=0, mask_token_id=3, vocab_size=50, probability=0.15, seed=7)
    rows = [{"input_ids": [1, *range(10, 10 + n), 2], "idx": i} for i, n in enumerate([40, 7, 1, 25])]
    batch = col(rows)
    width = batch["input_ids"].shape[1]
    flat = batch["input_ids"].reshape(-1)
    pos = batch["mlm_positions"]
    rows_of, cols_of = pos // width, pos % width
    for i, r in enumerate(rows):
        mine = cols_of[rows_of == i]
        assert len(mine) == max(1, round(0.15 * (len(r["input_ids"]) - 2)))  # at least one per segment
        assert mine.min() >= 1 and mine.max() <= len(r["input_ids"]) - 2  # never [CLS], [SEP] or padding
    torch.testing.assert_close(batch["mlm_targets"], torch.tensor([rows[int(p // width)]["input_ids"][int(p % width)]
                                                                   for p in pos]))
    # the same segment gets the same mask in any batch (epochs, evaluation, resume)
    alone = col([rows[3]])
    torch.testing.assert_close(alone["input_ids"][0, :27], batch["input_ids"][3, :27])
    assert not torch.equal(col([{**rows[3], "idx": 99}])["input_ids"], alone["input_ids"])
    # 80 % [MASK], 10 % random, 10 % unchanged over many segments
    many = col([{"input_ids": [1, *range(10, 40), 2], "idx": i} for i in range(400)])
    new = many["input_ids"].reshape(-1)[many["mlm_positions"]]
    share_mask = float((new == 3).float().mean())
    share_kept = float((new == many["mlm_targets"]).float().mean())
    assert 0.77 < share_mask < 0.83 and 0.08 < share_kept < 0.13
    assert flat.numel() == batch["attention_mask"].numel()


def test_no_masking_without_an_mlm_term() -> None:
    col = CorpusCollator(pad_token_id=0)
    batch = col([{"input_ids": [1, 10, 11, 2], "idx": 0}, {"input_ids": [1, 12, 2], "idx": 1}])
    assert "mlm_positions" not in batch
    assert batch["input_ids"].tolist() == [[1, 10, 11, 2], [1, 12, 2, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


# ------------------------------------------------------------------------------------ preflight

def test_label_terms_are_refused_on_a_corpus(run_cfg, corpus: Path, tmp_path: Path) -> None:
    from kdrun.app.preflight import preflight

    with pytest.raises(ConfigError, match=r"terms \['ce', 'logit_kd'\] need gold labels or task logits.*ckd_general"):
        preflight(run_cfg(*corpus_args(corpus, "ckd"), toy=False))
    with pytest.raises(ConfigError, match="soft_ce"):
        preflight(run_cfg(*corpus_args(corpus, "tinybert"), toy=False))
    with pytest.raises(ConfigError, match="task.data_files"):
        preflight(run_cfg(*corpus_args(corpus, "ckd_general"), "task.data_files=null", toy=False))
    with pytest.raises(ConfigError, match="task.metrics"):
        preflight(run_cfg(*corpus_args(corpus, "ckd_general"), "task.metrics=[accuracy]", toy=False))
    pre = preflight(run_cfg(*corpus_args(corpus, "mlm_ckd"), toy=False))
    assert [t.key for t in pre.plans[0].terms][0] == "mlm_kd"


@pytest.mark.parametrize("objective,twin", [("ckd_general", "ckd"), ("tinybert_general", "tinybert"),
                                            ("minilmv2_general", "minilmv2"), ("distilbert_general", "distilbert")])
def test_label_free_objectives_are_refused_on_a_labelled_task(run_cfg, objective: str, twin: str) -> None:
    """On a GLUE-style task nothing would train the classifier: a random head's scores are refused."""
    from kdrun.app.preflight import preflight

    with pytest.raises(ConfigError, match=rf"'{objective}' has no term that reads labels.*objective={twin}$"):
        preflight(run_cfg(f"objective={objective}"))


def test_mlm_terms_are_refused_on_a_task_without_masking(run_cfg) -> None:
    from kdrun.app.preflight import preflight

    with pytest.raises(ConfigError, match=r"terms \['mlm_kd'\].*only a corpus task.*task.kind=classification"):
        preflight(run_cfg("objective=mlm_ckd"))
    with pytest.raises(ConfigError, match=r"terms \['mlm_kd'\].*task.kind=qa"):
        preflight(run_cfg("objective=mlm_ckd", "task=squad", toy=False))


def test_a_teacher_without_an_mlm_head_is_refused(run_cfg, corpus: Path, tmp_path: Path) -> None:
    cfg = run_cfg(*corpus_args(corpus, "mlm_ckd"), "teacher=minilm_l6", "student=general_L4_H256", toy=False)
    with pytest.raises(ConfigError, match="has no masked-LM head.*ckd_general"):
        run(cfg, tmp_path / "r")
    assert not (tmp_path / "r" / "results.json").exists()


@pytest.mark.parametrize("content, message", [
    (b"", "holds no text"),
    (b"\x00\x01binary\x00" * 50, "looks binary"),
    (b"just a few words\n", "less than one segment"),
])
def test_bad_corpora_fail_clearly_and_cache_nothing(run_cfg, tmp_path: Path, cache_dir: Path, content: bytes,
                                                    message: str) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    with pytest.raises(DataError, match=message):
        run(run_cfg(*corpus_args(bad, "ckd_general"), toy=False), tmp_path / "r")
    entries = list((cache_dir / "corpus").glob("*")) if (cache_dir / "corpus").exists() else []
    assert not [e for e in entries if e.is_dir() and not e.name.startswith(".")]  # no entry published


# ----------------------------------------------------------------------------------- whole runs

@pytest.mark.parametrize("objective", ["ckd_general", "tinybert_general", "minilmv2_general", "distilbert_general"])
def test_label_free_objectives_run_and_lower_the_heldout_loss(run_cfg, corpus: Path, tmp_path: Path,
                                                              objective: str) -> None:
    extra = ["objective.params.relation_heads=2"] if objective == "minilmv2_general" else []
    args = corpus_args(corpus, objective, "train.lr=3e-3", "objective.stages.0.eval_every_steps=3",
                       "objective.stages.0.batch_size=8", *extra)
    res = run(run_cfg(*args, toy=False), tmp_path / "r")
    evals = [e["metrics"]["validation"]["distill_loss"] for e in res["evals"]]
    assert len(evals) >= 3 and min(evals[1:]) < evals[0]
    assert res["student"]["selected"]["metric"] == "distill_loss"
    assert res["student"]["selected"]["value"] == pytest.approx(min(evals))  # the lowest loss is kept
    assert res["student"]["metrics"]["validation"]["distill_loss"] == pytest.approx(min(evals), rel=1e-5)
    from transformers import AutoModel

    saved = AutoModel.from_pretrained(tmp_path / "r" / "student")
    assert type(saved).__name__ == "BertModel" and saved.config.num_hidden_layers == 2
    assert (tmp_path / "r" / "student" / "tokenizer.json").exists()


def test_mlm_student_is_saved_with_its_head_and_feeds_a_task_run(run_cfg, corpus: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

    res = run(run_cfg(*corpus_args(corpus, "mlm_ckd"), toy=False), tmp_path / "g")
    assert {"mlm_kd", "ckd_wr_pair"} <= set(res["student"]["metrics"]["validation"])
    saved = tmp_path / "g" / "student"
    mlm, info = AutoModelForMaskedLM.from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"]  # the trained MLM head was saved
    clf = AutoModelForSequenceClassification.from_pretrained(saved, num_labels=2)
    enc = load_file(str(saved / "model.safetensors"))
    torch.testing.assert_close(clf.bert.encoder.layer[1].output.dense.weight,
                               enc["bert.encoder.layer.1.output.dense.weight"])
    # the general student as the student of a task run (round trip through student=pretrained)
    task = run(run_cfg("objective=finetune", "student=pretrained", "student.name=general",
                       f"student.name_or_path={saved}"), tmp_path / "t")
    assert task["student"]["info"]["layers"] == 2 and task["student"]["name"] == "general"
    assert 0.0 <= task["student"]["metrics"]["validation"]["accuracy"] <= 1.0


def test_interrupted_corpus_run_resumes_mid_corpus_exactly(run_cfg, corpus: Path, tmp_path: Path) -> None:
    args = corpus_args(corpus, "mlm_ckd", "train.checkpoint_every_steps=4", "objective.stages.0.batch_size=8",
                       "logger.log_every_steps=1")
    ref = run(run_cfg(*args, toy=False), tmp_path / "ref")
    rd = tmp_path / "resumed"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg(*args, "train.stop_after_steps=6", toy=False), rd)
    state = json.loads((rd / "checkpoints" / "last" / "state.json").read_text())
    assert state["global_step"] == 4 and 0 < state["batch_in_epoch"] < ref["stages"][0]["steps"]  # mid-epoch
    out = run(run_cfg(*args, toy=False), rd)
    assert out["student"]["metrics"] == ref["student"]["metrics"]
    a, b = load_file(str(tmp_path / "ref" / "student" / "model.safetensors")), \
        load_file(str(rd / "student" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    logs = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (tmp_path / "ref", rd)]
    train = [[(r["step"], r.get("train/loss")) for r in log if "train/loss" in r] for log in logs]
    # the same batches in the same order: the same losses at every step
    assert len(train[0]) == ref["stages"][0]["steps"] and train[0] == train[1]


def test_corpus_shards_are_cached_by_content(run_cfg, corpus: Path, tmp_path: Path, cache_dir: Path, capsys) -> None:
    run(run_cfg(*corpus_args(corpus, "distilbert_general"), toy=False), tmp_path / "a")
    run(run_cfg(*corpus_args(corpus, "distilbert_general"), "seed=3", toy=False), tmp_path / "b")
    out = capsys.readouterr().out
    assert out.count("tokens/s:") == 1 and out.count("from cache:") == 1
    with open(corpus, "a") as f:
        f.write("\nthe birds sang of mountains and rivers under green skies again\n")
    run(run_cfg(*corpus_args(corpus, "distilbert_general"), toy=False), tmp_path / "c")
    assert capsys.readouterr().out.count("tokens/s:") == 1  # changed text: rebuilt
    assert len([e for e in (cache_dir / "corpus").iterdir() if e.is_dir() and not e.name.startswith(".")]) == 2


def test_probe_fine_tunes_the_general_student_next_to_its_random_twin(run_cfg, corpus: Path, tmp_path: Path,
                                                                      cache_dir: Path) -> None:
    from kdrun.runtime import forkrun
    from tests.test_sweeps import env_for

    run(run_cfg(*corpus_args(corpus, "ckd_general"), toy=False), tmp_path / "g")
    out = tmp_path / "probe"
    args = ["probe", str(tmp_path / "g"), "--tasks", "toy", "--seeds", "1", "--out", str(out),
            "task.toy.num_train=160", "task.toy.num_validation=64", "train.epochs=1", f"cache_dir={cache_dir}"]
    # python -m kdrun.strategies.general.cli ARGS, forked from a process that imported kdrun's libraries
    done = forkrun.run(args, env_for(tmp_path), tmp_path, 600, module="kdrun.strategies.general.cli")
    assert done.returncode == 0, done.stderr[-2000:]
    table = json.loads((out / "probe.json").read_text())
    assert set(table) == {"ckd_general", "random-init"}
    assert table["ckd_general"]["toy"]["n"] == 1 and table["ckd_general"]["toy"]["metric"] == "accuracy"
    twin = json.loads(next((out / "toy" / "random-init").rglob("results.json")).read_text())
    general = json.loads(next((out / "toy" / "ckd_general").rglob("results.json")).read_text())
    assert twin["student"]["info"] == general["student"]["info"]  # the same shape, the same parameter count
    assert twin["config"]["student"]["kind"] == "random" and general["config"]["student"]["kind"] == "pretrained"
    assert "| ckd_general | " in (out / "probe.md").read_text()
