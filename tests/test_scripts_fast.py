"""The benchmark and helper scripts end to end, each as its own process in a tiny mode (tiny or
truncated models, a few steps, generated data written here instead of GLUE or Wikipedia), checked
on what they print or write, not only on their exit code. A few seconds to ~30 s each on a 2-core
CPU; the other scripts are run by the tests of what they measure (tests/test_fuzz.py,
tests/test_pipeline.py, tests/test_doctor.py, tests/test_teacher_store.py, tests/test_reproduce_glue.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdrun.runtime import forkrun
from tests.conftest import REPO, load_script, slow_test_seconds
from tests.test_dynabert import TINY_DYNABERT_RUN

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}


def run_script(name: str, *args: str, tmp_path: Path, timeout: float = 180, **env: str) -> str:
    """``python scripts/<name>.py ARGS`` from the repository root, offline, with its cache under
    ``tmp_path``, forked from a process that imported kdrun's libraries once (kdrun.runtime.forkrun;
    a new interpreter where the environment's import-time settings differ from that process's);
    returns its stdout after checking that it exited with 0."""
    full_env = {**os.environ, **OFFLINE, "KDRUN_CACHE_DIR": str(tmp_path / "cache"), **env}
    proc = forkrun.run(list(args), full_env, REPO, timeout, script=f"scripts/{name}.py")
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def toy_sentences(n: int, split: str = "train") -> tuple[list[str], list[int]]:
    """``n`` generated sentences with labels (kdrun's toy task), as stand-ins for real text."""
    from kdrun.tasks.data.toy import make_toy_splits

    rows = make_toy_splits({"num_train": n, "num_validation": n}, eval_splits=["dev"])[split]
    return rows["text_a"], rows["label"]


def number(text: str) -> float:
    return float(text.replace(",", ""))


# ------------------------------------------------------------------------------------- make_tiny_mlm

def test_make_tiny_mlm_writes_a_loadable_masked_lm(tmp_path: Path) -> None:
    """The written directory loads with plain transformers (model and tokenizer), predicts a word for
    every vocabulary entry at a [MASK], and is accepted as augmentation.mlm."""
    out = tmp_path / "mlm"
    stdout = run_script("setup/make_tiny_mlm", str(out), "--hidden", "32", "--layers", "1", "--heads", "2",
                        "--intermediate", "48", tmp_path=tmp_path)
    assert re.search(r"wrote a random BertForMaskedLM \(1 layers, hidden 32, \d+\.\dM parameters\)", stdout), stdout
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(model).__name__ == "BertForMaskedLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.intermediate_size) == (32, 1, 48)
    assert model.config.vocab_size == len(tok) > 30000  # all-MiniLM-L6-v2's WordPiece vocabulary
    enc = tok(f"the movie was {tok.mask_token} .", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(tok)) and torch.isfinite(logits).all()

    from kdrun.strategies.augment.mlm import load_mlm

    load_mlm(str(out), device="cpu", precision="fp32")  # raises on a model augmentation cannot use


# ------------------------------------------------------------------------------------ bench_optimizer

def test_bench_optimizer_prints_both_rows_and_the_ratio(tmp_path: Path) -> None:
    stdout = run_script("bench/optimizer", "--layers", "1", "--steps", "3", "--device", "cpu", tmp_path=tmp_path)
    assert re.search(r"AdamW step, \d+\.\d M parameters \(1-layer MiniLM student\), cpu, \d+ threads, 3 steps", stdout)
    loop = re.search(r"^\| per-tensor loop \(fused: false\) \| (\d+\.\d) \|$", stdout, re.M)
    fused = re.search(r"^\| fused \(default\) \| (\d+\.\d) \|$", stdout, re.M)
    assert loop and fused, stdout
    ratio = re.search(r"^ratio: fused is (\d+\.\d)x faster; largest weight difference (\S+)$", stdout, re.M)
    assert ratio, stdout
    if float(fused.group(1)) >= 1.0:  # the printed figures are rounded to 0.1 ms
        assert float(ratio.group(1)) == pytest.approx(float(loop.group(1)) / float(fused.group(1)), rel=0.1, abs=0.2)
    # the same update both ways: only float32 rounding apart after 3 + 3 steps
    assert float(ratio.group(2)) < 1e-5


# ----------------------------------------------------------------------------------------- count_ops

def test_count_ops_fast_prints_every_objective_with_its_ratio_to_logit(tmp_path: Path) -> None:
    """Tiny models: the table has a row per objective, logit's ratio is 1, each ratio is its count over
    logit's, and the JSON holds the same counts."""
    out = tmp_path / "ops.json"
    stdout = run_script("bench/count_ops", "--fast", "--objectives", "finetune,ckd,mgskd", "--json", str(out),
                        tmp_path=tmp_path)
    rows = {m[1]: (number(m[2]), float(m[3]))
            for m in re.finditer(r"^\| (\w+) \| ([\d,]+) \| (\d+\.\d\d) \|$", stdout, re.M)}
    assert list(rows) == ["logit", "finetune", "ckd", "mgskd"]
    logit = rows["logit"][0]
    assert rows["logit"][1] == 1.0 and rows["finetune"][0] < logit < rows["ckd"][0]
    for ops, ratio in rows.values():
        assert ratio == pytest.approx(ops / logit, abs=0.006)
    data = json.loads(out.read_text())
    assert data["fast"] is True and data["chunks"] == "cuda"
    assert {n: r["ops"] for n, r in data["rows"].items()} == {n: ops for n, (ops, _) in rows.items()}


# ----------------------------------------------------------------------------------- bench_relations

def test_bench_relations_kdrun_and_naive_losses_agree(tmp_path: Path) -> None:
    """Small sizes: each case in its own process, both ways on the same inputs, windowed and all
    angles; the loss values agree and the table has both ways and their ratios."""
    out = tmp_path / "rel.json"
    stdout = run_script("bench/relations", "--batch", "2", "--n", "16", "--layers", "2", "--teacher-dim", "32",
                        "--student-dims", "16", "--window", "3", "--small-batch", "1", "--threads", "1",
                        "--json", str(out), tmp_path=tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["d_student"], r["window"], r["batch"]) for r in rows] == [(16, 3, 2), (16, None, 2)]
    for r in rows:
        ours, naive = r["kdrun"], r["naive"]
        for case in (ours, naive):
            assert not case.get("oom") and not case.get("timeout"), r
            assert case["time_s"] > 0 and case["peak_mb"] >= 0 and case["value"] > 0
        assert ours["value"] == pytest.approx(naive["value"], rel=1e-5), r
    assert "VALUE MISMATCH" not in stdout
    table = stdout[stdout.index("student d window"):]
    lines = [x for x in table.splitlines() if re.match(r"\s+16\s+(3|full)\s+2 \|", x)]
    assert len(lines) == 2, table
    for line in lines:  # time x, mem x and rel diff columns filled in
        assert re.search(r"\|\s+\d+\.\d\s+\d+\.\d \|\s+\d\.\de[+-]\d\d$", line), line
    assert f"wrote {out}" in stdout


# --------------------------------------------------------------------------------------- bench_train

def test_bench_train_on_a_generated_sst2(tmp_path: Path) -> None:
    """SST-2's layout (train.tsv / dev.tsv with a header) filled with generated sentences: both loops
    train one epoch and the table, the ratio and the JSON agree."""
    glue = tmp_path / "SST-2"
    glue.mkdir()
    for split, n in (("train", 64), ("dev", 32)):
        texts, labels = toy_sentences(n, split)
        (glue / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in zip(texts, labels)))
    out = tmp_path / "train.json"
    stdout = run_script("bench/train", "--data-dir", str(glue), "--examples", "64", "--batch-size", "16",
                        "--device", "cpu", "--json", str(out), tmp_path=tmp_path, TMPDIR=str(tmp_path))
    assert re.search(r"^64 SST-2 sentences, mean length \d+\.\d tokens \(padded: 128\), batch 16", stdout, re.M)
    res = json.loads(out.read_text())
    assert res["examples"] == 64 and res["batch_size"] == 16
    printed = {}
    for name in ("naive", "kdrun"):
        m = re.search(rf"^{name} \(.*\)\s+(\d+\.\d)\s+(\d+\.\d)$", stdout, re.M)
        assert m, stdout
        printed[name] = float(m.group(1))
        assert res[name]["device"] == "cpu" and res[name]["seconds"] > 0
        assert res[name]["examples_per_s"] == pytest.approx(64 / res[name]["seconds"])
        assert printed[name] == pytest.approx(res[name]["examples_per_s"], abs=0.051)
    assert res["ratio"] == pytest.approx(res["kdrun"]["examples_per_s"] / res["naive"]["examples_per_s"])
    m = re.search(r"throughput ratio kdrun / naive: (\d+\.\d\d)x", stdout)
    assert m and float(m.group(1)) == pytest.approx(res["ratio"], abs=0.006)


# -------------------------------------------------------------------------------------- bench_corpus

def test_bench_corpus_fast_on_a_generated_corpus(tmp_path: Path) -> None:
    """A WikiExtractor-layout corpus of generated sentences: the shards are built, then the cached
    data path, the naive one and the training step are timed and compared."""
    corpus = tmp_path / "wiki" / "AA"
    corpus.mkdir(parents=True)
    texts, _ = toy_sentences(360)
    with open(corpus / "wiki_00", "w") as f:
        for d in range(120):
            f.write(f'<doc id="{d}" url="u{d}" title="Doc {d}">\nDoc {d}\n\n' + "\n".join(texts[3 * d:3 * d + 3])
                    + "\n</doc>\n")
    stdout = run_script("bench/corpus", "--data", str(tmp_path / "wiki"), "--fast", f"cache_dir={tmp_path / 'cache'}",
                        tmp_path=tmp_path)
    assert "3 batches of 8 segments (max 32 tokens), objective ckd_general" in stdout, stdout
    rate = {}
    for key, label in (("data", r"data loading \(cached segments \+ collator\)"),
                       ("naive", r"naive data path \(read \+ tokenise per batch\)"),
                       ("train", r"training step \(teacher fwd \+ student fwd/bwd \+ update\)")):
        m = re.search(rf"^{label}:\s+([\d,]+) tokens/s$", stdout, re.M)
        assert m, (key, stdout)
        rate[key] = number(m.group(1))
        assert rate[key] > 0
    m = re.search(r"^ratio data loading / training step: ([\d,.]+)x \(cached vs naive data path: ([\d,.]+)x\)$",
                  stdout, re.M)
    assert m, stdout
    assert number(m.group(1)) == pytest.approx(rate["data"] / rate["train"], rel=0.02, abs=0.06)
    assert number(m.group(2)) == pytest.approx(rate["data"] / rate["naive"], rel=0.02, abs=0.06)
    assert list((tmp_path / "cache" / "corpus").iterdir()), "no corpus shards in the cache"


# --------------------------------------------------------------------------------- bench_concurrency

def test_bench_concurrency_fast(tmp_path: Path) -> None:
    """Warm-up, one run alone, two with all cores each, two with kdrun's thread choice: every run
    finishes, the table has all three timings and the ratio, and the runs took the threads the
    comparison is about."""
    work = tmp_path / "work"
    # SLURM_JOB_ID emptied: inside a SLURM job a run takes SLURM's CPU count instead of dividing the cores
    stdout = run_script("bench/concurrency", "--fast", "--workdir", str(work), tmp_path=tmp_path, timeout=240,
                        SLURM_JOB_ID="")
    secs = {}
    for key, label in (("alone", r"one run alone:"), ("naive", r"two at once, each with all \d+ threads \(naive\):"),
                       ("default", r"two at once, kdrun's default threads:")):
        m = re.search(rf"^{label}\s+(\d+\.\d) s", stdout, re.M)
        assert m, (key, stdout)
        secs[key] = float(m.group(1))
        assert secs[key] > 0
    m = re.search(r"^ratio naive / default: (\d+\.\d\d)x$", stdout, re.M)
    assert m and float(m.group(1)) == pytest.approx(secs["naive"] / secs["default"], rel=0.05), stdout
    for tag in ("warmup", "alone", "naive1", "naive2", "default1", "default2"):
        res = json.loads((work / tag / "results.json").read_text())
        assert res["teacher"]["name"] == "tiny_random" and res["student"]["metrics"]["validation"]["accuracy"] >= 0
        assert res["teacher"]["cached"] == (tag != "warmup"), tag  # the warm-up fine-tunes it, the timed runs read it
    cores = len(os.sched_getaffinity(0))
    for tag in ("naive1", "naive2"):
        log = (work / tag / "cli.log").read_text()
        assert f"] {cores} compute thread{'s' if cores > 1 else ''} (train.num_threads;" in log, log
    for tag in ("default1", "default2"):
        log = (work / tag / "cli.log").read_text()
        m = re.search(r"\] (\d+) compute threads? \((\d+) cores / (\d+) kdrun runs on the host", log)
        assert m, log
        threads, runs = int(m.group(1)), int(m.group(3))
        assert runs >= 2 and threads <= max(1, cores // 2), log


# -------------------------------------------------------------------------------------- check_export

def test_check_export_on_a_tiny_dynabert_run(tmp_path: Path) -> None:
    """A finished DynaBERT run (tiny models, two widths and depths, as tests/test_dynabert.py makes
    one), then the export round trip: the exported sub-network loads with from_pretrained and gives
    the in-run sub-network's logits and metrics."""
    run_dir = tmp_path / "run"
    proc = forkrun.run([*TINY_DYNABERT_RUN, f"cache_dir={tmp_path}/cache", f"hydra.run.dir={run_dir}"],
                       {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}, REPO, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "exported"
    stdout = run_script("checks/export", str(run_dir), "width=0.5", "depth=0.5", str(out), tmp_path=tmp_path)
    assert f"wrote {out}" in stdout
    res = json.loads(stdout[stdout.index("{\n"):])
    assert (res["width"], res["depth"], res["rows"]) == (0.5, 0.5, 24)
    assert res["max_abs_logit_diff"] < 1e-5
    assert set(res["exported"]) == {"accuracy", "f1"}
    for key in ("in_run_now", "results_json"):
        assert res[key] == pytest.approx(res["exported"]), res
    # half of the student's 2 heads and 64 FFN units, half of its 4 layers
    assert res["config"] == {"num_attention_heads": 1, "intermediate_size": 32, "num_hidden_layers": 2,
                             "hidden_size": 32}

    from transformers import AutoModelForSequenceClassification

    small = AutoModelForSequenceClassification.from_pretrained(out)
    full = AutoModelForSequenceClassification.from_pretrained(run_dir / "student")
    assert sum(p.numel() for p in small.parameters()) == res["exported_params"]
    assert res["exported_params"] < sum(p.numel() for p in full.parameters())


def test_bench_precision_fast_runs_the_quickstart_in_three_precisions(tmp_path: Path) -> None:
    out = run_script("bench/precision", "--fast", "--seeds", "0", "--out", str(tmp_path), tmp_path=tmp_path,
                     timeout=300)
    lines = [line for line in out.splitlines() if line.split()[:1] and line.split()[0] in ("fp32", "bf16", "fp16")]
    assert [line.split()[0] for line in lines] == ["fp32", "bf16", "fp16"], out
    assert "+0.0000" in lines[0]  # fp32 against itself
    report = json.loads((tmp_path / "bench_precision.json").read_text())
    assert {r["precision"] for r in report["rows"]} == {"fp32", "bf16", "fp16"}
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in report["rows"])


# ----------------------------------------------------------------------------------- bench_mgskd_pair

def test_bench_mgskd_pair_times_both_forms_and_picks_the_direct_one_below_a_plus_b(tmp_path: Path) -> None:
    """Two lengths x two head counts: a row each; ``auto`` takes the n x n form exactly where n < a + b
    (the script exits non-zero if the two forms disagree)."""
    stdout = run_script("bench/mgskd_pair", "--fast", "--threads", "1", tmp_path=tmp_path)
    row = r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+\.\d) \| (\d+\.\d) \| (\w+) \| (\d+\.\d\d) \|$"
    rows = re.findall(row, stdout, re.M)
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "8", "64"), ("16", "8", "4"), ("1", "40", "64"),
                                                  ("16", "40", "4")], stdout
    assert [r[5] for r in rows] == ["direct", "kernel", "direct", "kernel"]


SCRIPTS = sorted(p.relative_to(REPO / "scripts") for p in (REPO / "scripts").rglob("*") if p.suffix in (".py", ".sh"))


def test_every_script_lives_in_a_folder_by_kind_and_answers_help(capsys) -> None:
    """scripts/ holds folders by kind (README.md says which), and every script prints its use with
    --help and exits 0: the Python ones through their main(argv), the shell ones as a user runs them."""
    assert {p.parts[0] for p in SCRIPTS} == {"study", "bench", "fuzz", "plots", "checks", "setup"}
    assert all(len(p.parts) == 2 for p in SCRIPTS)
    readme = (REPO / "scripts" / "README.md").read_text()
    for p in SCRIPTS:
        assert p.stem in readme, f"scripts/README.md does not name {p}"
        if p.suffix == ".sh":
            out = subprocess.run(["bash", str(REPO / "scripts" / p), "--help"], capture_output=True, text=True)
            assert out.returncode == 0 and len(out.stdout.splitlines()) >= 3, (p, out.stderr)
            continue
        mod = load_script(str(p.with_suffix("")))
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        text = capsys.readouterr().out
        assert e.value.code == 0 and text.startswith("usage:"), p
        first = (mod.__doc__ or "").strip().splitlines()[0]
        assert first and first in text, f"{p}: --help lacks the docstring's first line"


def test_versions_script_tabulates_a_stack(tmp_path: Path) -> None:
    """scripts/checks/versions.sh on the Python running the tests (a stack named ``here`` whose
    environment is given, so nothing is installed): its table row holds the versions, the test
    loop's count and each tiny run's exit status."""
    # the stack is the running Python's own prefix (a virtual environment's, where the tests run in one)
    (tmp_path / "here").symlink_to(sys.prefix)
    assert (tmp_path / "here" / "bin" / "kdrun").exists()
    env = {**os.environ, **OFFLINE, "KDRUN_VERSIONS_DIR": str(tmp_path), "FAST": "1", "KINDS": "classification"}
    out = subprocess.run(["bash", str(REPO / "scripts" / "checks" / "versions.sh"), "here"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| here |"))
    from importlib.metadata import version

    assert f"torch {version('torch')}" in row and re.search(r"\| \d+ passed in ", row), row
    assert row.rstrip(" |").endswith("classification:0"), row
    assert (tmp_path / "versions.md").read_text() == out.stdout


def test_slow_tests_script_lists_tests_by_their_summed_durations(tmp_path: Path, capsys) -> None:
    """scripts/checks/slow_tests.py on a hand-written JUnit report: a test is slow when its
    parametrizations together take the threshold or more (conftest marks them all by one id), a test
    of a class keeps its class in the id, cases outside tests/ are ignored, each id carries its
    seconds (conftest reads them back); --check compares."""
    junit = tmp_path / "report.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_one[x]" time="1.2"/>'
        '<testcase classname="tests.test_a" name="test_one[y]" time="0.9"/>'
        '<testcase classname="tests.test_a" name="test_two" time="1.99"/>'
        '<testcase classname="tests.test_b.TestK" name="test_three" time="5"/>'
        '<testcase classname="other.test_c" name="test_four" time="9"/>'
        '</testsuite></testsuites>')
    mod = load_script("checks/slow_tests")
    assert mod.durations(junit) == pytest.approx({"tests/test_a.py::test_one": 2.1, "tests/test_a.py::test_two": 1.99,
                                                  "tests/test_b.py::TestK::test_three": 5.0})
    out = tmp_path / "slow.txt"
    assert mod.main(["--junit", str(junit), "--out", str(out)]) == 0
    ids = [line for line in out.read_text().splitlines() if line and not line.startswith("#")]
    assert ids == ["tests/test_a.py::test_one  # 2 s", "tests/test_b.py::TestK::test_three  # 5 s"]
    assert slow_test_seconds(out) == pytest.approx({"tests/test_a.py::test_one": 2.0,
                                                    "tests/test_b.py::TestK::test_three": 5.0})
    assert mod.main(["--junit", str(junit), "--out", str(out), "--check"]) == 0
    assert mod.main(["--junit", str(junit), "--out", str(out), "--check", "--threshold", "1.5"]) == 1
    with pytest.raises(SystemExit) as missing:
        mod.main(["--junit", str(tmp_path / "none.xml"), "--out", str(out)])
    assert missing.value.code == 2 and "none.xml" in capsys.readouterr().err
