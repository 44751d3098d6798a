"""What a cluster node meets: the hub behind HF_ENDPOINT or a proxy (kdrun.models.loading.hub_reachable),
wandb run ids across resumes and fresh starts (kdrun.runtime.tracking), and SQuAD's hub id.

Every server here listens on 127.0.0.1 and answers at once; requests time out after seconds.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from kdrun.models import loading as M
from kdrun.runtime.tracking import MAX_WANDB_ID, WANDB_ID_FILE, new_wandb_id, wandb_run_id

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
              "http_proxy", "https_proxy", "all_proxy", "no_proxy")


# --------------------------------------------------------------------------------- hub reachability

class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with ``status`` and records (method, path, headers)."""

    status = 200
    seen: list[tuple[str, str, dict[str, str]]]

    def _answer(self) -> None:
        self.seen.append((self.command, self.path, dict(self.headers)))
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = do_CONNECT = _answer

    def log_message(self, *args: Any) -> None:  # quiet
        pass


class LocalServer:
    """An HTTP server on 127.0.0.1 in a thread (a stand-in for the hub, or a forward proxy)."""

    def __init__(self, status: int = 200):
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        handler = type("Handler", (_Recorder,), {"status": status, "seen": self.seen})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[Any]:
    made: list[LocalServer] = []

    def make(status: int = 200) -> LocalServer:
        made.append(LocalServer(status))
        return made[-1]

    yield make
    for s in made:
        s.close()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Hub offline mode off, no proxies from the environment, an empty reachability cache, and a
    fresh huggingface_hub session (its client reads the proxy variables when it is created)."""
    import huggingface_hub
    from huggingface_hub import constants

    for var in (*PROXY_VARS, "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(M, "_REACHABLE", {})
    huggingface_hub.close_session()
    yield monkeypatch
    huggingface_hub.close_session()  # the next client must not inherit a test proxy


def timed_reachable() -> tuple[bool, float]:
    t = time.perf_counter()
    answer = M.hub_reachable()
    return answer, time.perf_counter() - t


def test_hub_endpoint_from_hf_endpoint_is_asked_through_huggingface_hub(online, server) -> None:
    hub = server()
    online.setenv("HF_ENDPOINT", hub.url + "/")
    assert timed_reachable()[0] is True
    ((method, path, headers),) = hub.seen
    assert (method, path) == ("HEAD", "/")
    assert "X-Amzn-Trace-Id" in headers  # set by huggingface_hub's request hook: its session was used
    assert M.hub_reachable() is True and len(hub.seen) == 1  # cached for the endpoint
    other = server()
    online.setenv("HF_ENDPOINT", other.url)
    assert M.hub_reachable() is True and len(other.seen) == 1  # another endpoint is asked itself


def test_a_hub_answering_with_an_error_page_is_still_reachable(online, server) -> None:
    hub = server(status=404)  # a mirror without a page at its root
    online.setenv("HF_ENDPOINT", hub.url)
    assert M.hub_reachable() is True


def test_unreachable_endpoint_fails_fast_with_the_clear_message(online) -> None:
    from kdrun.tasks.data.sources import DataError, check_task_data

    online.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    answer, seconds = timed_reachable()
    assert answer is False and seconds < 5
    with pytest.raises(M.ModelUnavailableError) as err:
        M.resolve_reference("kdrun-test/not-a-model", what="teacher.name_or_path")
    msg = str(err.value)
    assert "the Hugging Face hub is unreachable" in msg and "teacher=minilm_l6" in msg
    with pytest.raises(DataError, match="which is unreachable"):
        check_task_data({"name": "sst2", "hub_dataset": "nyu-mll/glue"})


def test_offline_mode_never_asks(online, server) -> None:
    hub = server()
    online.setenv("HF_ENDPOINT", hub.url)
    online.setenv("HF_HUB_OFFLINE", "1")
    assert M.hub_reachable() is False and hub.seen == []
    with pytest.raises(M.ModelUnavailableError, match="HF_HUB_OFFLINE=1 is set"):
        M.resolve_reference("kdrun-test/not-a-model")


def test_http_proxy_is_honoured(online, server) -> None:
    """A node whose only way out is the proxy: the endpoint itself refuses direct connections."""
    proxy = server()
    endpoint = f"http://127.0.0.1:{closed_port()}"
    online.setenv("HF_ENDPOINT", endpoint)
    online.setenv("HTTP_PROXY", proxy.url)
    assert M.hub_reachable() is True
    assert [(m, p) for m, p, _ in proxy.seen] == [("HEAD", f"{endpoint}/")]  # absolute form: a proxy request


def test_proxy_that_cannot_reach_the_hub_means_unreachable(online, server) -> None:
    proxy = server(status=502)
    online.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    online.setenv("HTTP_PROXY", proxy.url)
    assert M.hub_reachable() is False and len(proxy.seen) == 1


def test_https_proxy_is_honoured(online, server) -> None:
    proxy = server(status=502)  # refuses the tunnel: the TLS endpoint is never reached directly
    port = closed_port()
    online.setenv("HF_ENDPOINT", f"https://127.0.0.1:{port}")
    online.setenv("HTTPS_PROXY", proxy.url)
    assert M.hub_reachable() is False
    assert [(m, p) for m, p, _ in proxy.seen] == [("CONNECT", f"127.0.0.1:{port}")]


def test_no_proxy_bypasses_the_proxy(online, server) -> None:
    proxy, hub = server(status=502), server()
    online.setenv("HF_ENDPOINT", hub.url)
    online.setenv("HTTP_PROXY", proxy.url)
    online.setenv("NO_PROXY", "127.0.0.1")
    assert M.hub_reachable() is True and proxy.seen == [] and len(hub.seen) == 1


# ---------------------------------------------------------------------------------------- wandb ids

HASH = "0123456789abcdef"


def test_new_ids_are_sanitised_unique_and_keep_the_hash() -> None:
    name = "a:b;c,d#e?f/g'h"
    a, b = new_wandb_id(name, HASH), new_wandb_id(name, HASH)
    assert a != b
    for rid in (a, b):
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", rid) and rid.startswith("a_b_c_d_e_f_g_h-") and rid.endswith(HASH)
    long = new_wandb_id("x" * 500 + "/y", HASH)
    assert len(long) == MAX_WANDB_ID and long.endswith(f"-{HASH}") and long.startswith("xxx")
    assert new_wandb_id("::", HASH).startswith("run-")


def test_stored_id_is_reused_only_when_resuming(tmp_path: Path) -> None:
    first = wandb_run_id(tmp_path, "r", HASH, resuming=False)
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == first
    assert wandb_run_id(tmp_path, "r", HASH, resuming=True) == first
    fresh = wandb_run_id(tmp_path, "r", HASH, resuming=False)
    assert fresh != first and (tmp_path / WANDB_ID_FILE).read_text().strip() == fresh
    assert [p.name for p in tmp_path.iterdir()] == [WANDB_ID_FILE]  # no temporary file left behind


@pytest.fixture
def inits(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every wandb.init call (the real wandb runs, offline)."""
    import wandb

    calls: list[dict[str, Any]] = []
    real = wandb.init

    def init(**kwargs: Any):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    return calls


FAST = ["objective=finetune", "logger=wandb", "train.epochs=1", "train.checkpoint_every_steps=2"]


def test_resume_keeps_the_wandb_run_and_a_fresh_start_gets_a_new_one(run_cfg, tmp_path: Path, inits) -> None:
    from kdrun.app.run import run
    from kdrun.engine.trainer import SimulatedInterrupt

    rd = tmp_path / "run"
    with pytest.raises(SimulatedInterrupt):
        run(run_cfg(*FAST, "train.stop_after_steps=3"), rd)  # killed after step 3, checkpoint at 2
    first = (rd / WANDB_ID_FILE).read_text().strip()
    assert inits[-1]["id"] == first
    run(run_cfg(*FAST), rd)  # the rerun resumes the checkpoint: the same wandb run goes on
    assert inits[-1]["id"] == first and inits[-1]["resume"] == "allow"
    run(run_cfg(*FAST, "resume=false"), rd)  # starts over: steps from 0 again, in a new wandb run
    fresh = inits[-1]["id"]
    assert fresh != first and (rd / WANDB_ID_FILE).read_text().strip() == fresh
    # offline-run-<time>-<id>; resume=false moved the old run, its wandb directory included, aside
    ids = [p.name.split("-", 3)[3] for p in (rd / "wandb").glob("offline-run-*")]
    old = [p.name.split("-", 3)[3] for p in (rd / "previous").glob("*/wandb/offline-run-*")]
    assert set(ids) == {fresh} and set(old) == {first}


def test_odd_run_name_works_and_config_has_no_private_keys(run_cfg, tmp_path: Path, inits) -> None:
    from kdrun.app.run import run, run_config_hash

    name = "a:b;c,d#e?f/g'h"
    cfg = run_cfg(*FAST, f"run_name=\"{name}\"")
    assert cfg.run_name == name
    rd = tmp_path / "run"
    run(cfg, rd)
    (kw,) = inits
    config_hash = run_config_hash(OmegaConf.to_container(cfg, resolve=True))
    assert kw["name"] == name  # the display name as given
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", kw["id"]) and kw["id"].endswith(f"-{config_hash}")
    assert not [k for k in kw["config"] if str(k).startswith("_")]
    assert kw["config"]["run_name"] == name
    (offline,) = (rd / "wandb").glob("offline-run-*")
    assert offline.name.endswith(kw["id"])
    (blob,) = offline.glob("run-*.wandb")
    assert b"_run_id" not in blob.read_bytes()
    assert json.loads((rd / "results.json").read_text())["student"]["metrics"]


def test_wandb_pin_admits_the_reinit_mode_the_tracker_uses() -> None:
    """Tracker calls wandb.init(reinit="finish_previous"), which wandb has accepted since 0.19.9."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.version import Version

    from tests.conftest import REPO

    (line,) = re.findall(r'^\s*"(wandb\b[^"]*)",?\s*$', (REPO / "pyproject.toml").read_text(), flags=re.M)
    req = Requirement(line)
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert lows and min(lows) >= Version("0.19.9")
    assert Version(md.version("wandb")) in req.specifier
    assert 'reinit="finish_previous"' in (REPO / "kdrun" / "runtime" / "tracking.py").read_text()


# ---------------------------------------------------------------------------------------- SQuAD id

def test_squad_defaults_to_the_current_hub_id() -> None:
    from kdrun.tasks.qa.squad import HUB_DATASET
    from tests.conftest import compose

    assert HUB_DATASET == "rajpurkar/squad"
    assert compose(["task=squad"]).task.hub_dataset == "rajpurkar/squad"


@pytest.mark.parametrize(("given", "works", "asked"), [
    ("rajpurkar/squad", {"rajpurkar/squad"}, ["rajpurkar/squad"]),
    ("squad", {"rajpurkar/squad"}, ["rajpurkar/squad"]),  # the legacy id reads the current one
    ("squad", {"squad"}, ["rajpurkar/squad", "squad"]),  # ... or, failing that, the old id (an old cache)
])
def test_legacy_squad_id_is_accepted(monkeypatch: pytest.MonkeyPatch, given: str, works: set, asked: list) -> None:
    import datasets

    from kdrun.tasks.data import sources
    from kdrun.tasks.qa.squad import load_qa_data

    rows = [{"id": f"q{i}", "title": f"t{i}", "context": "The cat sat.", "question": "Who sat?",
             "answers": {"text": ["The cat"], "answer_start": [0]}} for i in range(4)]
    calls = []

    def load_dataset(name, config=None):
        calls.append(name)
        if name not in works:
            raise FileNotFoundError(name)
        return datasets.DatasetDict({s: datasets.Dataset.from_list(rows) for s in ("train", "validation")})

    monkeypatch.setattr(sources.datasets, "load_dataset", load_dataset)
    task = {"name": "squad", "kind": "qa", "hub_dataset": given, "train_split": "train", "eval_splits": ["validation"]}
    dsd = load_qa_data(task)
    assert calls == asked and len(dsd["train"]) == 4


def test_legacy_squad_id_failing_names_both_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdrun.tasks.data import sources
    from kdrun.tasks.data.sources import DataError
    from kdrun.tasks.qa.squad import load_qa_data

    def load_dataset(name, config=None):
        raise FileNotFoundError(f"no {name}")

    monkeypatch.setattr(sources.datasets, "load_dataset", load_dataset)
    task = {"name": "squad", "kind": "qa", "hub_dataset": "squad", "train_split": "train",
            "eval_splits": ["validation"]}
    with pytest.raises(DataError, match=r"'rajpurkar/squad' or 'squad'.*no rajpurkar/squad"):
        load_qa_data(task)
