"""The claims study's plan: its arms (an objective and overrides on ``experiment=glue_cpu``), the
claims of the papers as rows over those arms, the claims that cannot be tested offline, the order
in which the recipe runs them, and its CPU-time estimate. kdrun.report.claims reads the runs."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arm:
    """One setting of the study: ``objective`` with ``overrides``; its learning rate (and λ_CKD) is
    the one chosen on dev for ``lr_from`` (default: the objective itself)."""

    objective: str
    overrides: tuple[str, ...] = ()
    lr_from: str = ""

    @property
    def base(self) -> str:
        return self.lr_from or self.objective


@dataclass(frozen=True)
class Row:
    """``a`` against ``b`` (arms, or ``x-y`` differences of arms, paired by seed). ``expect``: ``>``,
    ``=`` or ``weights``; ``paper``: the paper's numbers; ``delta``: the paper's effect per task (the
    power reason of a verdict compares it with the MDE); ``tasks``: only these of the claim's tasks."""

    a: str
    b: str
    expect: str = ">"
    paper: str = ""
    delta: tuple[tuple[str, float], ...] = ()
    tasks: tuple[str, ...] = ()

    def delta_for(self, task: str) -> float | None:
        return dict(self.delta).get(task)

    def arms(self) -> list[str]:
        return [x for s in (self.a, self.b) for x in s.split("-")]


@dataclass(frozen=True)
class Claim:
    key: str
    paper: str
    text: str
    tasks: tuple[str, ...]
    rows: tuple[Row, ...]
    source: str = "recipe"  # "glue_cpu": answered by the GLUE study's runs (docs/data/glue_cpu_runs.csv)
    why: str = ""  # what the budget or teacher means for a difference not detected


def _p(prefix: str, **kv: object) -> tuple[str, ...]:
    return tuple(f"{prefix}.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in kv.items())


def _ckd(**kv: object) -> Arm:
    return Arm("ckd", _p("objective.params", **kv))


def _mg(**kv: object) -> Arm:
    return Arm("mgskd", _p("objective.params", **kv))


def _tb(*extra: str, **kv: object) -> Arm:
    return Arm("tinybert", (*extra, *_p("objective.params", **kv)))


ONE = {"hierarchical": False}
HALF = "task.max_train_samples=1000"  # the TinyBERT study's "half the data" (of the recipe's 2,000 rows)
LEARN = ("mapping=learnable", "mapping.lr=1e-2")  # 189 steps: Adam moves θ by at most 1.9 (the inits are 2 apart)
ARMS: dict[str, Arm] = {
    "ckd": Arm("ckd"), "ckd_no_wr": _ckd(wr_pair=False, wr_angle=False),
    "ckd_no_ltr": _ckd(ltr_pair=False, ltr_angle=False), "ckd_no_both": _ckd(lambda_ckd=0),
    "ckd_no_pair": _ckd(wr_pair=False, ltr_pair=False), "ckd_no_angle": _ckd(wr_angle=False, ltr_angle=False),
    **{f"ckd_w{d}": _ckd(window_pair=d, window_angle=d) for d in (1, 5, 10, 21)},
    "ckd_wfull": _ckd(window_pair=None, window_angle=None),
    "alp": Arm("alp"), "alp_skip": Arm("alp", _p("objective.params", mapping="skip")), "pkd": Arm("pkd"),
    "alp_l2": Arm("alp", ("student.num_layers=2",)),
    "alp_skip_l2": Arm("alp", ("student.num_layers=2", "objective.params.mapping=skip")),
    "pkd_l2": Arm("pkd", ("student.num_layers=2",)),
    # PKD as Passban et al. (2021) run it: the first teacher layer of each bucket (6 → 3: layers 1 and 4)
    "pkd_first": Arm("pkd", ("mapping=first",)),
    "tb": _tb(), "tb_kl": _tb(attention_loss="kl"), "tb_half": _tb(HALF),
    "tb_kl_half": _tb(HALF, attention_loss="kl"),
    "tb_random": _tb("mapping=random"), "tb_mean": _tb("mapping=mean"),
    "tb_learn_u": _tb(*LEARN, "mapping.init=uniform"), "tb_learn_l": _tb(*LEARN, "mapping.init=last"),
    "tb_a0": _tb(a=0), "tb_a1": _tb(a=1),
    # TinyBERT's prediction stage alone: logit KD with α = 1 at T = 1 (KL = soft CE minus the teacher's entropy)
    "tb_pred": Arm("logit", ("objective.alpha=1.0", "objective.temperature=1.0"), lr_from="tinybert"),
    "mg": _mg(), "mg_no_sample": _mg(sample=False), "mg_no_token": _mg(token=False), "mg_no_span": _mg(span=False),
    "mg_tok_pair": _mg(**ONE, span=False, sample=False, token_angle=False),
    "mg_tok_angle": _mg(**ONE, span=False, sample=False, token_pair=False),
    "mg_tok_both": _mg(**ONE, span=False, sample=False),
    "mg_span_pair": _mg(**ONE, token=False, sample=False, span_angle=False),
    "mg_span_angle": _mg(**ONE, token=False, sample=False, span_pair=False),
    "mg_span_both": _mg(**ONE, token=False, sample=False),
    "mg_smp_pair": _mg(**ONE, token=False, span=False, sample_pair=True, sample_angle=False),
    "mg_smp_angle": _mg(**ONE, token=False, span=False),  # also the boundary M = 0: samples on every layer
    "mg_smp_both": _mg(**ONE, token=False, span=False, sample_pair=True),
    "mg_m1": _mg(boundary=1), "mg_m3": _mg(boundary=3),
    "mg_m4": _mg(**ONE, sample=False),  # M = 4 of the paper: tokens and spans on every layer
    "mg_all": _mg(**ONE), "mg_h1": _mg(heads=1), "mg_h8": _mg(heads=8),
    "mg_tok_angle_k5": _mg(**ONE, span=False, sample=False, token_pair=False, k1=5, k2=5),
}

L2 = ("student.num_layers=2",)
SHARES = "logger.grad_shares=true"  # per-term gradient shares in metrics.jsonl (the probes' seed-1 runs)
# Controls and probes: runs that explain an arm's result rather than test a claim (docs/claims.md,
# "Collapsed arms"). The same student fine-tuned on the labels, or under logit KD; the collapsed
# arms at other learning rates and three times the budget; one run each logging gradient shares.
ARMS.update({
    "finetune": Arm("finetune"), "finetune_l2": Arm("finetune", L2), "logit_l2": Arm("logit", L2),
    "finetune_half": Arm("finetune", (HALF,)),
    "pkd_l2_lr1e-4": Arm("pkd", (*L2, "train.lr=1e-4")), "pkd_l2_lr1e-3": Arm("pkd", (*L2, "train.lr=1e-3")),
    "pkd_l2_e9": Arm("pkd", (*L2, "train.epochs=9")), "pkd_l2_shares": Arm("pkd", (*L2, SHARES)),
    "finetune_l2_e9": Arm("finetune", (*L2, "train.epochs=9")),
    "tb_lr1e-4": _tb("train.lr=1e-4"), "tb_e9": _tb("train.epochs=9"), "tb_shares": _tb(SHARES),
    "tb_a1_shares": _tb(SHARES, a=1),
    "mg_span_angle_lr1e-4": Arm("mgskd", (*ARMS["mg_span_angle"].overrides, "train.lr=1e-4")),
    "mg_span_angle_shares": Arm("mgskd", (*ARMS["mg_span_angle"].overrides, SHARES)),
    "mg_smp_pair_lr1e-4": Arm("mgskd", (*ARMS["mg_smp_pair"].overrides, "train.lr=1e-4")),
    "mg_smp_pair_shares": Arm("mgskd", (*ARMS["mg_smp_pair"].overrides, SHARES)),
    # ALP with the dot products divided by sqrt(d): weights that spread over the teacher layers
    "alp_sqrtd": Arm("alp", ("+mapping.params.temperature=sqrt_d",)),
    "alp_sqrtd_l2": Arm("alp", (*L2, "+mapping.params.temperature=sqrt_d")),
})


@dataclass(frozen=True)
class Probe:
    """Arms run beside the claims to explain a result, not to test a statement: ``seeds`` of each
    (the first of the recipe's seeds) on each of ``tasks``."""

    key: str
    text: str
    tasks: tuple[str, ...]
    arms: tuple[str, ...]
    seeds: int = 6


PROBES: tuple[Probe, ...] = (
    Probe("Controls: fine-tuned students", "each student fine-tuned on the labels: the bar a collapsed arm is "
          "measured against", ("cola", "sst2", "stsb"), ("finetune",)),
    Probe("Controls: half the data", "the student fine-tuned on the 1,000 rows the half-data arms train on",
          ("cola",), ("finetune_half",)),
    Probe("Controls: 2-layer students", "2-layer students fine-tuned and under logit KD", ("sst2", "stsb"),
          ("finetune_l2", "logit_l2")),
    Probe("Collapse: 2-layer STS-B", "pkd_l2 at other learning rates and three times the budget",
          ("stsb",), ("pkd_l2_lr1e-4", "pkd_l2_lr1e-3", "pkd_l2_e9", "finetune_l2_e9"), seeds=3),
    Probe("Collapse: TinyBERT", "tinybert at a lower learning rate and three times the budget", ("stsb",),
          ("tb_lr1e-4", "tb_e9"), seeds=3),
    Probe("Collapse: MGSKD relation forms", "span angles and sample pairs at a lower learning rate", ("stsb",),
          ("mg_span_angle_lr1e-4", "mg_smp_pair_lr1e-4"), seeds=3),
    Probe("Collapse: gradient shares", "one run of each collapsed arm logging its terms' gradient shares",
          ("stsb",), ("pkd_l2_shares", "tb_shares", "tb_a1_shares", "mg_span_angle_shares", "mg_smp_pair_shares"),
          seeds=1),
    Probe("ALP: spread weights", "ALP's attention over teacher layers at temperature sqrt(d)", ("sst2", "stsb"),
          ("alp_sqrtd", "alp_sqrtd_l2")),
)

PARK, LIU, PASSBAN, JASSANI = ("Park, Kim & Yang (2021)", "Liu, Tao, Feng & Zhao (2022)",
                               "Passban, Wu, Rezagholizadeh & Liu (2021)", "Jassani, Dankar & Kumar")
T4 = "EMNLP Table 4, 4/512 student:"
TB_BUDGET = "budget: TinyBERT's intermediate stage gets 189 steps here (the authors': 20–30 epochs)"
S = ("sst2", "stsb")
HEADROOM = ("teacher: on SST-2 the nine objectives of the GLUE study land within 0.9 of each other, 5 points "
            "under the 6/384 teacher")
CLAIMS: tuple[Claim, ...] = (
    Claim("CKD: components", PARK, "removing WR, LTR or both costs accuracy; both the most", S, (
        Row("ckd", "ckd_no_wr", paper=f"{T4} SST-2 91.4 vs 90.6, STS-B 87.9 vs 87.5",
            delta=(("sst2", .8), ("stsb", .4))),
        Row("ckd", "ckd_no_ltr", paper=f"{T4} 91.4 vs 91.1, 87.9 vs 87.6", delta=(("sst2", .3), ("stsb", .3))),
        Row("ckd", "ckd_no_both", paper=f"{T4} 91.4 vs 89.1, 87.9 vs 86.8", delta=(("sst2", 2.3), ("stsb", 1.1))),
        Row("ckd_no_wr", "ckd_no_both", paper=f"{T4} 90.6 vs 89.1, 87.5 vs 86.8", delta=(("sst2", 1.5), ("stsb", .7))),
        Row("ckd_no_ltr", "ckd_no_both", paper=f"{T4} 91.1 vs 89.1, 87.6 vs 86.8", delta=(("sst2", 2.0), ("stsb", .8))),
    )),
    Claim("CKD: pair and angle", PARK, "pair-wise and triple-wise relations both help (ICLR-submission Table 5)", S, (
        Row("ckd", "ckd_no_pair", paper="Table 5 (values not legible in the text)"),
        Row("ckd", "ckd_no_angle", paper="Table 5 (values not legible in the text)"),
    )),
    Claim("CKD: window", PARK, "accuracy rises with the window δ (EMNLP Figure 4, SST-2 and QNLI); past some "
          "size it falls (EMNLP) or saturates (ICLR submission)", ("sst2",), (
        Row("ckd_w10", "ckd_w1", paper="EMNLP Figure 4 (SST-2, QNLI)"), Row("ckd_w10", "ckd_w5", paper="Figure 4"),
        Row("ckd_w10", "ckd_wfull", paper="EMNLP Figure 4: falls after some point (the ICLR version: saturates)"),
    )),
    Claim("CKD: beats KD and layer matching", PARK, "CKD beats pretrained distillation (logit KD), PKD and "
          "TinyBERT with 6/768 students (EMNLP Table 2)", S, (
        Row("ckd", "logit", paper="EMNLP Table 2: SST-2 93.0 vs 91.1 (PD, Turc et al.; no STS-B score)",
            delta=(("sst2", 1.9),), tasks=("sst2",)),
        Row("ckd", "pkd", paper="EMNLP Table 2: SST-2 93.0 vs 91.3, STS-B (Spearman) 89.0 vs 86.2",
            delta=(("sst2", 1.7), ("stsb", 2.8))),
        Row("ckd", "tinybert", paper="EMNLP Table 2: SST-2 93.0 vs 92.3, STS-B 89.0 vs 88.3",
            delta=(("sst2", .7), ("stsb", .7))),
    ), source="glue_cpu", why=HEADROOM),
    Claim("MGSKD: beats CKD", LIU, "MGSKD beats CKD in the same distillation setting (7 of 8 tasks)", S, (
        Row("mgskd", "ckd", paper="Table 1, 4/312 students, ELECTRA-base teacher, augmented data"),
    ), source="glue_cpu", why=HEADROOM),
    Claim("ALP: beats PKD, 3 layers", PASSBAN, "attention over the teacher layers beats PKD (here PKD-skip; "
          "the paper's PKD takes the first layer of each bucket: `pkd_first` under ALP: smaller students)", S, (
        Row("alp", "pkd", paper="Table 1, 4 layers: SST-2 90.37 vs 90.14, STS-B 87.62 vs 87.26",
            delta=(("sst2", .23), ("stsb", .36))),
    ), source="glue_cpu"),
    Claim("ALP: smaller students", PASSBAN, "ALP beats PKD at 4 and at 2 layers; at 2 layers the gap is larger "
          "(\"even more visible\", Table 3; on STS-B and on average, not on SST-2)", S, (
        Row("alp", "pkd_first", paper="Table 1, 4 layers, PKD on the first layer of each bucket: SST-2 90.37 vs "
            "90.14, STS-B 87.62 vs 87.26", delta=(("sst2", .23), ("stsb", .36))),
        Row("alp", "alp_skip", paper="(ALP's loss on the skip map: isolates the map; no number in the paper)"),
        Row("alp_l2", "pkd_l2", paper="Table 3, 2 layers, PKD-6 (the middle teacher layer, as kdrun's 2-layer "
            "skip map takes): SST-2 88.88 vs 88.65, STS-B 46.04 vs 42.92", delta=(("sst2", .23), ("stsb", 3.12))),
        Row("alp_l2", "alp_skip_l2", paper="(no number in the paper)"),
        Row("alp_l2-pkd_l2", "alp-pkd_first", paper="STS-B gap 0.36 (4 layers) → 3.12 (2 layers, vs PKD-6); "
            "SST-2 0.23 → 0.23 (vs PKD-6), 0.12 (vs PKD-12): no widening stated there",
            delta=(("stsb", 2.76),), tasks=("stsb",)),
    )),
    Claim("TinyBERT study: KL attention loss", JASSANI, "KL attention loss beats MSE on CoLA, more with half the "
          "data; no gain on STS-B", ("cola", "stsb"), (
        Row("tb_kl", "tb", paper="CoLA MCC 36.3 vs 34.3", delta=(("cola", 2.0),), tasks=("cola",)),
        Row("tb_kl_half", "tb_half", paper="half the data: 31.2 vs 27.8", delta=(("cola", 3.4),), tasks=("cola",)),
        Row("tb_kl", "tb", "=", paper="STS-B 87.4 vs 86.8 (not significant)", tasks=("stsb",)),
    ), why=TB_BUDGET),
    Claim("TinyBERT study: layer map", JASSANI, "the map matters on CoLA (random worse); learnable no better than "
          "the base map; on STS-B every map performs alike", ("cola", "stsb"), (
        Row("tb", "tb_random", paper="CoLA 34.4 vs 26.7", delta=(("cola", 7.7),), tasks=("cola",)),
        Row("tb", "tb_mean", paper="CoLA 34.4 vs 31.9 (Table 3)", delta=(("cola", 2.5),), tasks=("cola",)),
        Row("tb_learn_u", "tb", "=", paper="CoLA 34.5 vs 34.4; STS-B 87.1 vs 87.1"),
        Row("tb_learn_l", "tb", "=", paper="(the other initialisation)"),
        Row("tb_random", "tb", "=", paper="STS-B 86.7 vs 87.1", tasks=("stsb",)),
        Row("tb_mean", "tb", "=", paper="STS-B 86.4 vs 87.1", tasks=("stsb",)),
    ), why=TB_BUDGET),
    Claim("TinyBERT study: learnt weights", JASSANI, "a learnable map's weights converge to the same values "
          "whatever the initialisation", ("cola", "stsb"), (
        Row("tb_learn_u", "tb_learn_l", "weights", paper="Figure 3 (appendix A.1); start gap 0.381",
            delta=(("cola", .381), ("stsb", .381))),
    )),
    Claim("TinyBERT study: loss weights", JASSANI, "without the attention loss (α = 1) CoLA is worse; other α "
          "alike; on STS-B every α alike", ("cola", "stsb"), (
        Row("tb", "tb_a1", paper="CoLA 34.8 vs 25.0", delta=(("cola", 9.8),), tasks=("cola",)),
        Row("tb_a0", "tb", "=", paper="CoLA 34.4 vs 34.8", tasks=("cola",)),
        Row("tb_a1", "tb", "=", paper="STS-B 87.0 vs 86.9", tasks=("stsb",)),
    ), why=TB_BUDGET),
    Claim("TinyBERT study: no layer stage", JASSANI, "on STS-B the transformer-layer stage can be skipped", ("stsb",), (
        Row("tb_pred", "tb", "=", paper="STS-B 87.2 vs 86.8 (appendix A.3)"),
    ), why=TB_BUDGET),
    Claim("MGSKD: granularity", LIU, "sample-level knowledge matters most, then token, then span", S, (
        Row("mg", "mg_no_sample", paper="Table 3"), Row("mg", "mg_no_token", paper="Table 3"),
        Row("mg", "mg_no_span", paper="Table 3"), Row("mg_no_span", "mg_no_token", paper="token > span"),
        Row("mg_no_token", "mg_no_sample", paper="sample > token"),
    )),
    Claim("MGSKD: pair vs triplet", LIU, "pair-wise beats triplet-wise for tokens and spans, both together best; "
          "the reverse for samples, where both add nothing", S, (
        Row("mg_tok_pair", "mg_tok_angle", paper="Table 3"), Row("mg_span_pair", "mg_span_angle", paper="Table 3"),
        Row("mg_smp_angle", "mg_smp_pair", paper="Table 3: by a large margin"),
        Row("mg_tok_both", "mg_tok_pair", paper="Table 3"), Row("mg_span_both", "mg_span_pair", paper="Table 3"),
        Row("mg_smp_both", "mg_smp_angle", "=", paper="Table 3: no further gain"),
    )),
    Claim("MGSKD: hierarchy", LIU, "the boundary in the middle (M = 2) beats every other M and all levels on all "
          "layers", S, (
        Row("mg", "mg_all", paper="Figure 3 (SST-2, MNLI)"), Row("mg", "mg_m1", paper="Figure 3"),
        Row("mg", "mg_m3", paper="Figure 3"), Row("mg", "mg_smp_angle", paper="Figure 3: M = 0"),
        Row("mg", "mg_m4", paper="Figure 3: M = 4 (tokens and spans everywhere)"),
    )),
    Claim("MGSKD: relation heads", LIU, "more relation heads are better, up to 64", S, (
        Row("mg", "mg_h1", paper="Table 2: SST-2 93.7 at m = 64, 92.5 at the table's smallest m",
            delta=(("sst2", 1.2),)),
        Row("mg", "mg_h8", paper="Table 2"),
    )),
    Claim("MGSKD: angle vertices", LIU, "token angles improve with k1 = k2 up to 20", ("sst2",), (
        Row("mg_tok_angle", "mg_tok_angle_k5", paper="Figure 2"),
    )),
)

NOT_TESTABLE: tuple[tuple[str, str, str], ...] = (
    (PARK, "CKD's GLUE and SQuAD scores; with augmentation the student passes its teacher",
     "BERT-base teachers and 4–6-layer pretrained students (Turc et al., 2019) from the hub; offline kdrun "
     "has one pretrained BERT, the 6/384 all-MiniLM-L6-v2, and TinyBERT's augmentation needs a BERT "
     "masked LM and GloVe vectors"),
    (PARK, "the gap to the baselines grows with the student's depth and width (Figure 2)",
     "students of 2–10 layers and 128–768 width pretrained by Turc et al. (2019): only truncations of the "
     "6/384 teacher load offline"),
    (PARK, "CKD improves MobileBERT and DynaBERT", "MobileBERT and a BERT-base DynaBERT from the hub"),
    (LIU, "a 14M student matches BERT-base", "an ELECTRA-base teacher, TinyBERT-4 general weights and the "
     "augmented training sets"),
    (LIU, "sample-level angles improve monotonically with k1 = k2 (Figure 2)",
     "kdrun's sample angles always use the whole batch (the paper's final choice); there is no k to vary"),
    (PASSBAN, "6-layer students narrow the ALP–PKD gap (Table 2)", "a 12-layer teacher; the 6-layer teacher "
     "cannot have a 6-layer student to compare with (3 against 2 layers is tested instead)"),
    (JASSANI, "the scores themselves (CoLA MCC about 34)", "General TinyBERT-4 students and BERT-base teachers "
     "from the hub"),
    (JASSANI, "a learnable map's weights converge to the same values whatever the initialisation (Figure 3)",
     "a statement about weights trained to convergence: at this budget (189 steps of the intermediate stage) "
     "Adam moves θ by at most 1.9 at mapping.lr=1e-2, and the inits are 2 apart; the measured weights are "
     "shown in the table, with the verdict \"not testable at this budget\""),
)

# Rows an earlier version of this table held that the papers do not state; dropped, with why.
DROPPED: tuple[tuple[str, str, str], ...] = (
    (PARK, "CKD beats MiniLM", "MiniLM appears in neither EMNLP Table 2 nor ICLR Table 1; an inference"),
    (PARK, "CKD beats logit KD on STS-B", "EMNLP Table 2's pretrained-distillation row (PD) has no STS-B score"),
    (PARK, "window 21 performs as window 10", "an inference from the chosen range (10–21), not a statement"),
    (PASSBAN, "the ALP–PKD gap widens on SST-2", "Table 1 → Table 3 on SST-2: 0.23 → 0.23 against PKD-6, "
     "0.12 against PKD-12; the paper states the wider gap on average and it shows on STS-B"),
)


# ------------------------------------------------------------------------------------------ order

def selected(claim: Claim, prefixes: list[str] | None) -> bool:
    """Whether ``claim`` is one the recipe runs and its key starts with one of ``prefixes`` (any case;
    None: every claim)."""
    return claim.source == "recipe" and (
        prefixes is None or any(claim.key.lower().startswith(x.strip().lower()) for x in prefixes))


def names() -> list[str]:
    """The names ``--claims`` chooses from: the recipe's claims, then its probes."""
    return [c.key for c in CLAIMS if c.source == "recipe"] + [pr.key for pr in PROBES]


def steps(tasks: list[str], claims: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(claim, task, arm) in the order the recipe runs them: one claim at a time, every arm of its rows
    on each of its tasks, so each finished claim fills whole rows; an arm that an earlier claim ran
    is not repeated. ``claims``: only the claims whose keys start with these."""
    seen: set[tuple[str, str]] = set()
    out = []
    for c in CLAIMS:
        if not selected(c, claims):
            continue
        for task in (t for t in c.tasks if t in tasks):
            for r in (r for r in c.rows if not r.tasks or task in r.tasks):
                for arm in r.arms():
                    if (task, arm) not in seen:
                        seen.add((task, arm))
                        out.append((c.key, task, arm))
    for pr in PROBES:
        if claims is None or any(pr.key.lower().startswith(x.strip().lower()) for x in claims):
            out += [(pr.key, t, a) for t in pr.tasks if t in tasks for a in pr.arms if (t, a) not in seen]
            seen.update((t, a) for t in pr.tasks for a in pr.arms)
    return out


def seeds_of(arm: str, seeds: list[int]) -> list[int]:
    """The seeds the recipe runs for ``arm``: all of ``seeds``, or a probe's first few."""
    n = next((pr.seeds for pr in PROBES if arm in pr.arms), len(seeds))
    return seeds[:n]


def glue_cpu_seed_rows(csv_path: Path) -> list[dict[str, str]]:
    """The seed runs of the GLUE study's runs.csv (docs/data/glue_cpu_runs.csv); none if it is absent."""
    if not csv_path.exists():
        return []
    with open(csv_path, newline="") as f:
        return [r for r in csv.DictReader(f) if r["phase"] == "seeds"]


def chosen_settings(csv_path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """{(task, objective): {key: value}}: the settings the GLUE study chose on dev (its seed runs')."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for r in glue_cpu_seed_rows(csv_path):
        setting = {"train.lr": r["lr"]}
        if r["lambda_ckd"]:
            setting["objective.params.lambda_ckd"] = r["lambda_ckd"]
        out[(r["task"], r["objective"])] = setting
    return out


def merge_overrides(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """Overrides in order, a later value of the same key replacing an earlier one in place."""
    merged: dict[str, str] = {}
    for group in groups:
        for o in group:
            merged[o.split("=", 1)[0]] = o
    return list(merged.values())


# ------------------------------------------------------------------------------------ CPU estimate

# Measured (docs/results.md, GLUE on a CPU): an MRPC step of the glue_cpu recipe costs about 0.9
# CPU-seconds, evaluations and start-up included; a step costs in proportion to the tokens in a row
# (SST-2 a quarter of MRPC's, STS-B a half, CoLA a fifth); a relation objective's step costs more
# than a logit-KD step (The training step: ckd 1.47x, mgskd 1.72x, tinybert 1.43x, minilm 1.30x).
STEP_CPU_S = 0.9
TASK_WEIGHT = {"mrpc": 1.0, "stsb": 0.5, "sst2": 0.25, "cola": 0.2}
STAGE_FACTORS = {"ckd": (1.47,), "mgskd": (1.72, 1.0), "tinybert": (1.43, 1.0), "minilm": (1.30, 1.0)}


def run_cpu_seconds(task: str, arm: Arm, rows: int = 2000, epochs: int = 3, batch: int = 32) -> float:
    """One run's estimated CPU seconds: its stages' steps x the step cost of the task and objective."""
    for o in arm.overrides:
        if o.startswith("task.max_train_samples="):
            rows = int(o.split("=", 1)[1])
    step_count = epochs * math.ceil(rows / batch)
    return sum(step_count * STEP_CPU_S * TASK_WEIGHT[task] * f for f in STAGE_FACTORS.get(arm.objective, (1.0,)))


def estimate(tasks: list[str], seeds: int, grids: dict[tuple[str, str], int],
             claims: list[str] | None = None) -> dict[str, float]:
    """CPU hours of the recipe: the seed runs of every step, and ``grids`` {(task, objective): grid points}
    (the grid runs of objectives the GLUE study did not choose a setting for)."""
    todo = steps(tasks, claims)
    seed_s = sum(seeds * run_cpu_seconds(t, ARMS[a]) for _, t, a in todo)
    grid_s = sum(n * run_cpu_seconds(t, Arm(o)) for (t, o), n in grids.items())
    return {"runs": len(todo) * seeds + sum(grids.values()), "seed_hours": seed_s / 3600,
            "grid_hours": grid_s / 3600, "cpu_hours": (seed_s + grid_s) / 3600}


def cost_line(tasks: list[str], seeds: int, grids: dict[tuple[str, str], int], claims: list[str] | None = None) -> str:
    cost = estimate(tasks, seeds, grids, claims)
    return (f"[reproduce_glue] claims: {cost['runs']} runs, about {cost['cpu_hours']:.1f} CPU hours at the "
            "glue_cpu study's measured step costs (teachers not included)")
