"""Loss terms that declare themselves: typed parameters checked at preflight, and plug-ins that live
outside kdrun (``objective.imports`` and the ``kdrun.losses`` entry-point group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, TINY, TOY, compose

from kdrun.losses import LOSSES, ParamError, get_loss
from kdrun.losses import registry as R

PLUGIN = '''
from dataclasses import dataclass

from kdrun.losses import Params, param, register_loss


@dataclass(frozen=True)
class Offset(Params):
    offset: float = param(0.0)
    scale: float = param(1.0, check=lambda v: None if v >= 0 else "must be >= 0")


@register_loss("{name}", params=Offset, uses_teacher=False)
def shifted_logit_square(s, t, batch, ctx, p: Offset):
    """offset + scale * mean(z^2): a term whose logged value shows the parameters reached it."""
    return p.offset + p.scale * s.logits.float().pow(2).mean()
'''


def write_plugin(root: Path, package: str, name: str) -> None:
    pkg = root / package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "losses.py").write_text(PLUGIN.format(name=name))


def test_every_builtin_term_declares_typed_params() -> None:
    get_loss("ce")  # discovery through kdrun's own entry points
    assert {"ce", "logit_kd", "ckd_wr_pair", "tinybert_attention", "mgskd_span", "alp", "minilmv2_qq"} <= set(LOSSES)
    spec = get_loss("ckd_wr_angle")
    assert spec.param_names == {"loss", "window", "huber_beta", "reduction"}
    p = spec.make_params({"window": 3})
    assert (p.loss, p.window, p.huber_beta, p.reduction) == ("mse", 3, 1.0, "mean")  # one source of defaults
    assert isinstance(spec.make_params({"huber_beta": 2}).huber_beta, float)
    assert get_loss("pkd_patience").map_kinds == {"pairs", "weights", "sample"}
    assert get_loss("comb").map_kinds == {"pairs", "weights", "sample", "concat"}
    assert get_loss("minilm_attention").map_kinds == frozenset() and get_loss("ce").map_kinds == frozenset()
    assert get_loss("hidden_mse").map_kinds == {"pairs"}  # layer-reading terms default to one-to-one


@pytest.mark.parametrize("name,params,match", [
    ("ckd_wr_pair", {"loss": "kld"},
     r"params.loss='kld' must be one of mse, l1, huber, kl .*objective.params.pair_loss"),
    ("ckd_wr_angle", {"window": True}, r"params.window=True must be int or null"),
    ("logit_kd", {"temperature": "hot"}, r"params.temperature='hot' must be float"),
    ("logit_kd", {"temperature": 0}, r"params.temperature=0.* must be > 0"),
    ("tinybert_hidden", {"projection": "wide"}, r"must be one of none, shared, per_layer"),
])
def test_bad_parameter_values_name_key_and_choices(name, params, match) -> None:
    with pytest.raises(ParamError, match=match):
        get_loss(name).make_params(params, "objective.stages[0].losses[1]")


def test_bad_objective_param_fails_before_data_or_models_load(tmp_path: Path, monkeypatch) -> None:
    import kdrun.models.loading as models
    import kdrun.tasks.data.sources as sources
    from kdrun.app.run import run

    def loaded(*_a, **_k):
        raise AssertionError("data or a model was loaded before the parameters were checked")

    for mod, fn in ((sources, "load_task_data"), (models, "load_tokenizer"), (models, "load_classifier")):
        monkeypatch.setattr(mod, fn, loaded)
    cfg = compose([*TINY, *TOY, "objective=ckd", "objective.params.pair_loss=kld"])
    with pytest.raises(ValueError) as err:
        run(cfg, tmp_path / "run")
    msg = str(err.value)
    assert "objective.stages[0].losses[2]" in msg and "objective.params.pair_loss" in msg
    assert "must be one of mse, l1, huber, kl" in msg
    # the run directory holds the record of the failure only (cli.log with its header, error.json)
    assert {p.name for p in (tmp_path / "run").iterdir()} == {".kdrun.lock", "cli.log", "error.json"}
    assert (tmp_path / "run" / "cli.log").read_text().startswith("=== ")


def test_objective_imports_load_a_plugin_module(tmp_path: Path, monkeypatch) -> None:
    from kdrun.engine.objective import plan_stages

    write_plugin(tmp_path, "kd_plug_a", "plug_a_square")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose([*TINY, *TOY, "objective=finetune", "objective.imports=[kd_plug_a.losses]",
                   "objective.stages.0.losses=[{name: plug_a_square, weight: 1.0, params: {offset: 2.5}}]"])
    (plan,) = plan_stages(cfg.objective)
    (term,) = plan.terms
    assert term.params.offset == 2.5 and term.params.scale == 1.0
    bad = compose([*TINY, *TOY, "objective=finetune", "objective.imports=[kd_plug_missing.losses]"])
    with pytest.raises(ValueError, match=r"objective.imports\[0\]: cannot import 'kd_plug_missing.losses'"):
        plan_stages(bad.objective)


def test_entry_point_group_discovers_installed_plugins(tmp_path: Path, monkeypatch) -> None:
    write_plugin(tmp_path, "kd_plug_ep", "plug_ep_square")
    dist = tmp_path / "kd_plug_ep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kd-plug-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kdrun.losses]\nsquare = kd_plug_ep.losses\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(R, "_discovered", False)
    spec = get_loss("plug_ep_square")
    assert spec.make_params({"scale": 3}).scale == 3.0
    with pytest.raises(ParamError, match="params.scale=-1.0 must be >= 0"):
        spec.make_params({"scale": -1})


@pytest.mark.slow
def test_out_of_tree_plugin_runs_through_kdrun(tmp_path: Path) -> None:
    """README's "Extending kdrun": one module + one YAML outside kdrun, used by `kdrun objective=...`."""
    write_plugin(tmp_path / "src", "kd_plug_cli", "plug_cli_square")
    conf = tmp_path / "conf" / "objective"
    conf.mkdir(parents=True)
    (conf / "plug_obj.yaml").write_text(textwrap.dedent("""\
        name: plug_obj
        imports: [kd_plug_cli.losses]
        stages:
          - name: only
            epochs: 1
            lr: 5e-4
            batch_size: 32
            losses:
              - {name: ce, weight: 1.0}
              - {name: plug_cli_square, weight: 0.5, params: {offset: 7.0, scale: 0.0}}
        """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "kdrun", "--config-dir", str(tmp_path / "conf"), "objective=plug_obj", *TINY, *TOY,
           f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}", "logger.log_every_steps=1"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["objective"] == "plug_obj"
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r["train/plug_cli_square"] for r in logged if "train/plug_cli_square" in r]
    assert values and all(v == pytest.approx(7.0) for v in values)  # offset 7, scale 0: its params arrived
