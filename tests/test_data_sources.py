"""Tests for kdrun.tasks.data (GLUE TSV parsing, csv/json files, hub wrapper, subsampling, toy task)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import datasets
import pytest
from omegaconf import OmegaConf

from kdrun.config import TaskConfig, ToyConfig
from kdrun.tasks.data import sources
from kdrun.tasks.data.sources import DataError, check_task_data, expected_tsv_paths, load_task_data
from kdrun.tasks.data.toy import NEGATIVE_WORDS, NEGATORS, POSITIVE_WORDS, make_toy_splits, toy_label

ROOT = Path(__file__).resolve().parents[1]
CONF_TASK = Path(__file__).parents[1] / "conf" / "task"
GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"


def task_cfg(name: str, **overrides: Any) -> Any:
    return OmegaConf.merge(
        OmegaConf.structured(TaskConfig), OmegaConf.load(CONF_TASK / f"{name}.yaml"), overrides
    )


def write(path: Path, text: str, newline: str = "\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))
    return path


def rows(ds: datasets.Dataset) -> list[dict[str, Any]]:
    return [dict(r) for r in ds]


# ---------------------------------------------------------------------------------------------
# GLUE TSV formats


def test_cola_headerless_no_final_newline(tmp_path: Path) -> None:
    write(tmp_path / "train.tsv", 'gj04\t1\t\tThe sailors rode the breeze.\nw_80\t0\t*\the said "hi" to them.\n')
    # dev.tsv without a final newline, as in the real CoLA download
    write(tmp_path / "dev.tsv", "cj99\t1\t\tIt's 'quoted' here.\nab01\t0\t*\tHim left.")
    dd = load_task_data(task_cfg("cola", data_dir=str(tmp_path)))
    assert set(dd) == {"train", "validation"}
    assert dd["train"].column_names == ["text_a", "label", "idx"]
    assert rows(dd["train"]) == [
        {"text_a": "The sailors rode the breeze.", "label": 1, "idx": 0},
        {"text_a": 'he said "hi" to them.', "label": 0, "idx": 1},
    ]
    assert rows(dd["validation"]) == [
        {"text_a": "It's 'quoted' here.", "label": 1, "idx": 0},
        {"text_a": "Him left.", "label": 0, "idx": 1},
    ]
    assert dd["train"].features["label"].dtype == "int64"
    assert dd["train"].features["idx"].dtype == "int64"


def test_sst2_header_and_trailing_blank_lines(tmp_path: Path) -> None:
    write(tmp_path / "train.tsv", 'sentence\tlabel\nit \'s a charming journey . \t1\nhe said "hi \t0\n\n\n')
    write(tmp_path / "dev.tsv", "sentence\tlabel\nbleak and desperate \t0\n")
    dd = load_task_data(task_cfg("sst2", data_dir=str(tmp_path)))
    assert rows(dd["train"]) == [
        {"text_a": "it 's a charming journey . ", "label": 1, "idx": 0},
        {"text_a": 'he said "hi ', "label": 0, "idx": 1},
    ]
    assert rows(dd["validation"]) == [{"text_a": "bleak and desperate ", "label": 0, "idx": 0}]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_mrpc_bom_header_and_crlf(tmp_path: Path, newline: str) -> None:
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    write(
        tmp_path / "train.tsv",
        header + '1\t702876\t702977\tAmrozi called him "the witness".\tReferring to "the witness", he left.\n'
        "0\t2108705\t2108831\tYucaipa owned Dominick's.\tYucaipa bought Dominick's.\n",
        newline,
    )
    write(tmp_path / "dev.tsv", header + "1\t1\t2\tA cat sat.\tA cat was sitting.", newline)
    dd = load_task_data(task_cfg("mrpc", data_dir=str(tmp_path)))
    assert dd["train"].column_names == ["text_a", "text_b", "label", "idx"]
    assert rows(dd["train"]) == [
        {
            "text_a": 'Amrozi called him "the witness".',
            "text_b": 'Referring to "the witness", he left.',
            "label": 1,
            "idx": 0,
        },
        {"text_a": "Yucaipa owned Dominick's.", "text_b": "Yucaipa bought Dominick's.", "label": 0, "idx": 1},
    ]
    assert rows(dd["validation"]) == [{"text_a": "A cat sat.", "text_b": "A cat was sitting.", "label": 1, "idx": 0}]


def test_stsb_float_scores(tmp_path: Path) -> None:
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    write(
        tmp_path / "train.tsv",
        head + "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane "
        "is taking off.\t5.000\n"
        "1\tmain-news\theadlines\t2013\t0002\tnone\tnone\tHe said \"no\".\tShe said yes.\t0.800\n",
    )
    write(tmp_path / "dev.tsv", head + "0\tg\tf\t2012\t0\tnone\tnone\tA man sings.\tA man plays.\t1.25\n")
    dd = load_task_data(task_cfg("stsb", data_dir=str(tmp_path)))
    assert dd["train"].features["label"].dtype == "float32"
    tr = rows(dd["train"])
    assert [r["text_a"] for r in tr] == ["A plane is taking off.", 'He said "no".']
    assert [r["text_b"] for r in tr] == ["An air plane is taking off.", "She said yes."]
    assert [r["label"] for r in tr] == pytest.approx([5.0, 0.8])
    assert dd["validation"][0]["label"] == pytest.approx(1.25)


@pytest.mark.parametrize(
    ("name", "header"),
    [("rte", "index\tsentence1\tsentence2\tlabel"), ("qnli", "index\tquestion\tsentence\tlabel")],
)
def test_rte_qnli_string_labels(tmp_path: Path, name: str, header: str) -> None:
    write(
        tmp_path / "train.tsv",
        f"{header}\n0\tNo weapons were found.\tWeapons were found.\tnot_entailment\n"
        "1\tWhat did he say?\tHe said \"go\".\tentailment\n",
    )
    write(tmp_path / "dev.tsv", f"{header}\n0\tA b.\tC d.\tentailment\n")
    dd = load_task_data(task_cfg(name, data_dir=str(tmp_path)))
    assert [r["label"] for r in dd["train"]] == [1, 0]
    assert dd["train"][1]["text_b"] == 'He said "go".'
    assert dd["train"][0]["text_a"] == "No weapons were found."
    assert rows(dd["validation"]) == [{"text_a": "A b.", "text_b": "C d.", "label": 0, "idx": 0}]


def test_mnli_train_and_two_dev_files_gold_label_last(tmp_path: Path) -> None:
    train_head = (
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
        "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
    )
    dev_head = train_head.replace("label1\tgold_label", "label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label")
    parse = "( x )\t( y )\t(ROOT x)\t(ROOT y)"
    write(
        tmp_path / "train.tsv",
        train_head + f"0\t31193\t31193n\tgovernment\t{parse}\tConceptually cream skimming.\tProduct and "
        "geography.\tneutral\tneutral\n"
        f"1\t101457\t101457e\ttelephone\t{parse}\tyou know \"during\" the season\tYou lose the things."
        "\tentailment\tentailment\n",
    )
    write(
        tmp_path / "dev_matched.tsv",
        dev_head + f"0\t63735\t63735n\tslate\t{parse}\tThe new rights are nice.\tEveryone likes them."
        "\tneutral\tentailment\tneutral\tneutral\tneutral\tcontradiction\n",
    )
    write(
        tmp_path / "dev_mismatched.tsv",
        dev_head + f"0\t75290\t75290c\tletters\t{parse}\tYour gift is appreciated.\tHardly anyone cares."
        "\tcontradiction\tcontradiction\tcontradiction\tcontradiction\tcontradiction\tentailment\n",
    )
    task = task_cfg("mnli", data_dir=str(tmp_path))
    assert set(expected_tsv_paths(task)) == {"train", "validation_matched", "validation_mismatched"}
    dd = load_task_data(task)
    assert list(dd) == ["train", "validation_matched", "validation_mismatched"]
    assert [r["label"] for r in dd["train"]] == [1, 0]
    assert dd["train"][1]["text_a"] == 'you know "during" the season'
    # gold_label is the last column (16 columns in dev files), not label1
    assert rows(dd["validation_matched"]) == [
        {"text_a": "The new rights are nice.", "text_b": "Everyone likes them.", "label": 2, "idx": 0}
    ]
    assert dd["validation_mismatched"][0]["label"] == 0


def test_qqp_and_wnli(tmp_path: Path) -> None:
    qqp = tmp_path / "qqp"
    head = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    write(qqp / "train.tsv", head + "133273\t213221\t213222\tHow is air traffic controlled?\tHow do you "
          "become an air traffic controller?\t0\n1\t3\t4\tWhat's \"AI\"?\tWhat is AI?\t1\n")
    write(qqp / "dev.tsv", head + "5\t6\t7\tWhy?\tWhy not?\t0\n")
    dd = load_task_data(task_cfg("qqp", data_dir=str(qqp)))
    assert [(r["text_a"], r["label"]) for r in dd["train"]] == [
        ("How is air traffic controlled?", 0),
        ('What\'s "AI"?', 1),
    ]
    assert dd["validation"][0]["text_b"] == "Why not?"

    wnli = tmp_path / "wnli"
    head = "index\tsentence1\tsentence2\tlabel\n"
    write(wnli / "train.tsv", head + "0\tI stuck a pin through a carrot.\tThe carrot had a hole.\t1\n")
    write(wnli / "dev.tsv", head + "0\tThe drain is clogged.\tThe hair is clogged.\t0\n")
    dd = load_task_data(task_cfg("wnli", data_dir=str(wnli)))
    assert rows(dd["train"]) == [
        {"text_a": "I stuck a pin through a carrot.", "text_b": "The carrot had a hole.", "label": 1, "idx": 0}
    ]
    assert dd["validation"][0]["label"] == 0


# ---------------------------------------------------------------------------------------------
# TSV errors


def _sst2_dir(tmp_path: Path, train: str) -> Any:
    write(tmp_path / "train.tsv", train)
    write(tmp_path / "dev.tsv", "sentence\tlabel\nfine .\t1\n")
    return task_cfg("sst2", data_dir=str(tmp_path))


def test_wrong_field_count_names_file_and_line(tmp_path: Path) -> None:
    task = _sst2_dir(tmp_path, "sentence\tlabel\ngood .\t1\nbad\t.\t0\nok\t1\n")
    with pytest.raises(DataError) as err:
        load_task_data(task)
    msg = str(err.value)
    assert f"{tmp_path / 'train.tsv'}:3" in msg
    assert "expected 2" in msg and "found 3" in msg


def test_headerless_too_few_fields(tmp_path: Path) -> None:
    write(tmp_path / "train.tsv", "gj04\t1\t\tFine.\ngj04\t1\n")
    write(tmp_path / "dev.tsv", "gj04\t1\t\tFine.\n")
    with pytest.raises(DataError, match=r"train\.tsv:2: expected at least 4"):
        load_task_data(task_cfg("cola", data_dir=str(tmp_path)))


def test_unknown_label_string(tmp_path: Path) -> None:
    write(tmp_path / "train.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\tc\td\tmaybe\n")
    write(tmp_path / "dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    with pytest.raises(DataError) as err:
        load_task_data(task_cfg("rte", data_dir=str(tmp_path)))
    msg = str(err.value)
    assert "train.tsv:3" in msg and "'maybe'" in msg
    assert "entailment" in msg and "not_entailment" in msg


def test_label_out_of_range_and_bad_float(tmp_path: Path) -> None:
    task = _sst2_dir(tmp_path, "sentence\tlabel\ngood .\t2\n")
    with pytest.raises(DataError, match=r"train\.tsv:2: label 2 is out of range"):
        load_task_data(task)
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    stsb = tmp_path / "stsb"
    write(stsb / "train.tsv", head + "0\tg\tf\ty\t0\tn\tn\tA.\tB.\t1.0\n1\tg\tf\ty\t0\tn\tn\tA.\tB.\tfive\n")
    write(stsb / "dev.tsv", head + "0\tg\tf\ty\t0\tn\tn\tA.\tB.\t1.0\n")
    with pytest.raises(DataError, match=r"train\.tsv:3: cannot parse label 'five' as a float"):
        load_task_data(task_cfg("stsb", data_dir=str(stsb)))


def test_empty_text(tmp_path: Path) -> None:
    task = _sst2_dir(tmp_path, "sentence\tlabel\ngood .\t1\n   \t0\n")
    with pytest.raises(DataError, match=r"train\.tsv:3: empty text"):
        load_task_data(task)


def test_missing_dir_lists_expected_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    task = task_cfg("mnli", data_dir=str(missing))
    for fn in (check_task_data, load_task_data):
        with pytest.raises(DataError) as err:
            fn(task)
        msg = str(err.value)
        for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
            assert str(missing / name) in msg
        assert "task.data_dir" in msg and "GLUE" in msg


def test_missing_split_file(tmp_path: Path) -> None:
    write(tmp_path / "train.tsv", "sentence\tlabel\ngood .\t1\n")
    task = task_cfg("sst2", data_dir=str(tmp_path))
    with pytest.raises(DataError) as err:
        check_task_data(task)
    assert str(tmp_path / "dev.tsv") in str(err.value) and str(tmp_path / "train.tsv") in str(err.value)
    write(tmp_path / "dev.tsv", "sentence\tlabel\nfine .\t1\n")
    check_task_data(task)  # now fine


def test_headerless_needs_index_specs(tmp_path: Path) -> None:
    write(tmp_path / "train.tsv", "gj04\t1\t\tFine.\n")
    write(tmp_path / "dev.tsv", "gj04\t1\t\tFine.\n")
    task = task_cfg("cola", data_dir=str(tmp_path), tsv={"columns": {"text_a": "sentence", "label": "1"}})
    with pytest.raises(DataError, match="0-based column index"):
        load_task_data(task)


def test_header_column_not_found(tmp_path: Path) -> None:
    task = _sst2_dir(tmp_path, "text\tlabel\ngood .\t1\n")
    with pytest.raises(DataError, match=r"train\.tsv:1: column 'sentence'"):
        load_task_data(task)


# ---------------------------------------------------------------------------------------------
# data_files (csv / json)


def test_csv_data_files_with_label_names(tmp_path: Path) -> None:
    train = write(
        tmp_path / "train.csv",
        'sentence1,sentence2,label,extra\n"He said ""hi"".",Hello.,entailment,x\nA cat.,NA,not_entailment,y\n',
    )
    dev = write(tmp_path / "dev.csv", "sentence1,sentence2,label\nA.,B.,entailment\n")
    task = task_cfg("rte", data_files={"train": str(train), "validation": str(dev)})
    check_task_data(task)
    dd = load_task_data(task)
    assert rows(dd["train"]) == [
        {"text_a": 'He said "hi".', "text_b": "Hello.", "label": 0, "idx": 0},
        {"text_a": "A cat.", "text_b": "NA", "label": 1, "idx": 1},
    ]
    assert rows(dd["validation"]) == [{"text_a": "A.", "text_b": "B.", "label": 0, "idx": 0}]


def test_json_data_files(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text(
        "\n".join(json.dumps({"sentence": s, "label": y}) for s, y in [('a "good" one', 1), ("bad", 0)]) + "\n"
    )
    dev = tmp_path / "dev.json"
    dev.write_text(json.dumps([{"sentence": "meh", "label": 0}]))
    dd = load_task_data(task_cfg("sst2", data_files={"train": str(train), "validation": str(dev)}))
    assert rows(dd["train"]) == [
        {"text_a": 'a "good" one', "label": 1, "idx": 0},
        {"text_a": "bad", "label": 0, "idx": 1},
    ]
    assert rows(dd["validation"]) == [{"text_a": "meh", "label": 0, "idx": 0}]


def test_tsv_data_file_keeps_quotes(tmp_path: Path) -> None:
    train = write(tmp_path / "train.tsv", 'sentence\tlabel\nhe said "hi\t1\n"odd\t0\n')
    dd = load_task_data(task_cfg("sst2", data_files={"train": str(train), "validation": str(train)}))
    assert dd["validation"]["text_a"] == ['he said "hi', '"odd']
    assert dd["validation"]["label"] == [1, 0]


def test_data_files_missing_column_and_missing_file(tmp_path: Path) -> None:
    train = write(tmp_path / "train.csv", "text,label\nhello,1\n")
    dev = write(tmp_path / "dev.csv", "sentence,label\nhello,1\n")
    task = task_cfg("sst2", data_files={"train": str(train), "validation": str(dev)})
    with pytest.raises(DataError) as err:
        load_task_data(task)
    msg = str(err.value)
    assert str(train) in msg and "'sentence'" in msg and "'label'" in msg

    task = task_cfg("sst2", data_files={"train": str(tmp_path / "nope.csv"), "validation": str(dev)})
    with pytest.raises(DataError, match="nope.csv"):
        check_task_data(task)


# ---------------------------------------------------------------------------------------------
# Hub (mocked: tests run offline)


def test_hub_renames_and_drops_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    feats = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
            "idx": datasets.Value("int32"),
        }
    )

    def fake_load(name: str, config: str | None = None, **kw: Any) -> datasets.DatasetDict:
        assert (name, config) == ("nyu-mll/glue", "mrpc")

        def mk(n: int) -> datasets.Dataset:
            return datasets.Dataset.from_dict(
                {"sentence1": [f"a{i}" for i in range(n)], "sentence2": [f"b{i}" for i in range(n)],
                 "label": [i % 2 for i in range(n)], "idx": [100 + i for i in range(n)]},
                features=feats,
            )

        return datasets.DatasetDict({"train": mk(3), "validation": mk(2), "test": mk(1)})

    monkeypatch.setattr(sources.datasets, "load_dataset", fake_load)
    dd = load_task_data(task_cfg("mrpc"))
    assert list(dd) == ["train", "validation"]
    assert dd["train"].column_names == ["text_a", "text_b", "label", "idx"]
    assert rows(dd["validation"]) == [
        {"text_a": "a0", "text_b": "b0", "label": 0, "idx": 0},
        {"text_a": "a1", "text_b": "b1", "label": 1, "idx": 1},
    ]


def test_hub_failure_suggests_local_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*a: Any, **kw: Any) -> None:
        raise ConnectionError("no network")

    monkeypatch.setattr(sources.datasets, "load_dataset", failing)
    with pytest.raises(DataError) as err:
        load_task_data(task_cfg("sst2"))
    msg = str(err.value)
    assert "could not be loaded from the hub" in msg
    assert "task.data_dir" in msg and "task.data_files" in msg and "task=toy" in msg


def test_hub_offline_does_not_hang(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        from kdrun.tasks.data.sources import DataError, load_task_data
        try:
            load_task_data({"name": "x", "hub_dataset": "kdrun-test/does-not-exist", "text_columns": ["s"]})
        except DataError as e:
            print("DATAERROR", "task=toy" in str(e))
        """
    )
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert "DATAERROR True" in out.stdout, out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Subsampling


def test_subsampling_deterministic_and_sized(tmp_path: Path) -> None:
    lines = "".join(f"sentence {i}\t{i % 2}\n" for i in range(30))
    write(tmp_path / "train.tsv", "sentence\tlabel\n" + lines)
    write(tmp_path / "dev.tsv", "sentence\tlabel\n" + lines[: lines.index("sentence 10")])
    task = task_cfg("sst2", data_dir=str(tmp_path), max_train_samples=7, max_eval_samples=4)
    a, b = load_task_data(task, seed=3), load_task_data(task, seed=3)
    assert len(a["train"]) == 7 and len(a["validation"]) == 4
    assert a["train"]["idx"] == list(range(7)) and a["validation"]["idx"] == list(range(4))
    assert rows(a["train"]) == rows(b["train"]) and rows(a["validation"]) == rows(b["validation"])
    for r in a["train"]:  # rows keep their own labels
        assert r["label"] == int(r["text_a"].split()[1]) % 2
    assert len(set(a["train"]["text_a"])) == 7
    c = load_task_data(task, seed=4)
    assert c["train"]["text_a"] != a["train"]["text_a"]
    # a limit at or above the split size keeps every row in file order
    big = load_task_data(task_cfg("sst2", data_dir=str(tmp_path), max_train_samples=100))
    assert big["train"]["text_a"] == [f"sentence {i}" for i in range(30)]


# ---------------------------------------------------------------------------------------------
# Toy task


def test_toy_label_rule() -> None:
    assert toy_label(["the", "movie", "was", "good"]) == 1
    assert toy_label(["the", "movie", "was", "not", "good"]) == 0
    assert toy_label(["never", "bad", "and", "fun"]) == 1
    # "terrible" -1, "not awful" +1, "great" +1 -> +1; "not great" instead flips the sum to -1
    assert toy_label(["a", "terrible", "day", "but", "not", "awful", "and", "great"]) == 1
    assert toy_label(["a", "terrible", "day", "but", "not", "awful", "and", "not", "great"]) == 0
    assert toy_label("not terrible") == 1 and toy_label("terrible") == 0
    # a negator only flips the word right after it
    assert toy_label("not the good") == 1


def _reference_label(text: str) -> int:
    pos, neg, negators = set(POSITIVE_WORDS), set(NEGATIVE_WORDS), set(NEGATORS)
    words = text.split()
    total = 0
    for i, w in enumerate(words):
        pol = 1 if w in pos else -1 if w in neg else 0
        if pol and i > 0 and words[i - 1] in negators:
            pol = -pol
        total += pol
    assert total != 0, f"tie generated: {text!r}"
    return int(total > 0)


def test_toy_determinism_sizes_balance_and_labels() -> None:
    cfg = ToyConfig(num_train=400, num_validation=150, min_words=3, max_words=12, seed=7)
    a = make_toy_splits(cfg, eval_splits=("validation_matched", "validation_mismatched"))
    b = make_toy_splits(OmegaConf.structured(cfg), eval_splits=("validation_matched", "validation_mismatched"))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert len(a["train"]["text_a"]) == 400
    assert len(a["validation_matched"]["label"]) == len(a["validation_mismatched"]["label"]) == 150
    assert a["validation_matched"]["text_a"] != a["validation_mismatched"]["text_a"]
    assert a["train"]["text_a"][:150] != a["validation_matched"]["text_a"]
    for split in a.values():
        assert 0.35 <= sum(split["label"]) / len(split["label"]) <= 0.65
        for text, label in zip(split["text_a"], split["label"]):
            n = len(text.split())
            assert 3 <= n <= 12 and text == text.lower()
            assert label == _reference_label(text) == toy_label(text)
    c = make_toy_splits(ToyConfig(num_train=400, num_validation=150, min_words=3, max_words=12, seed=8))
    assert c["train"]["text_a"] != a["train"]["text_a"]


def test_toy_task_via_load_task_data() -> None:
    task = task_cfg("toy", toy={"num_train": 64, "num_validation": 32})
    dd = load_task_data(task)
    assert len(dd["train"]) == 64 and len(dd["validation"]) == 32
    assert dd["train"].column_names == ["text_a", "label", "idx"]
    assert dd["train"]["idx"] == list(range(64))
    assert rows(load_task_data(task)["train"]) == rows(dd["train"])
    check_task_data(task)
    sub = load_task_data(task_cfg("toy", toy={"num_train": 64}, max_train_samples=10))
    assert len(sub["train"]) == 10 and sub["train"]["idx"] == list(range(10))


# ---------------------------------------------------------------------------------------------
# Real GLUE files ($KDRUN_DATA/glue), when present


@pytest.mark.parametrize(
    ("name", "folder", "n_train", "n_dev"),
    [("cola", "CoLA", 8551, 1043), ("sst2", "SST-2", 67349, 872), ("mrpc", "MRPC", 3668, 408),
     ("stsb", "STS-B", 5749, 1500)],
)
def test_real_glue_files(name: str, folder: str, n_train: int, n_dev: int) -> None:
    data_dir = GLUE / folder
    if not data_dir.is_dir():
        pytest.skip(f"real GLUE data not found at {data_dir}")
    task = task_cfg(name, data_dir=str(data_dir))
    check_task_data(task)
    dd = load_task_data(task)
    assert len(dd["train"]) == n_train and len(dd["validation"]) == n_dev
    for split in dd.values():
        labels = split["label"]
        if name == "stsb":
            assert all(0.0 <= y <= 5.0 for y in labels)
        else:
            assert set(labels) == {0, 1}
        assert split["idx"] == list(range(len(split)))
        assert all(t.strip() for t in split["text_a"])
