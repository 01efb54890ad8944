"""The gpt workload on the user's own data: params, paths under the storage root, token
files, the held-out split, `elastrain prepare-text`, and the exact-data-position guarantee
(same batches and losses at any world size, after a resume) on a token file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from elastrain.api.cli import app
from elastrain.contracts.datasets import data_path_problems
from elastrain.contracts.spec import JobSpec, WorkloadSpec
from elastrain.contracts.workload_params import GptParams
from elastrain.workers.workloads import WorkloadError, load_workload
from elastrain.workers.workloads.gpt import load_corpus
from tests.unit.dist_utils import run_distributed
from tests.unit.test_workers_train import RTOL, run_jobs

# -- params ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"token_dtype": "uint16", "vocab_size": 10}, "workload.params.token_dtype: only with"),
        ({"data_path": "d.bin", "token_dtype": "uint16"}, "workload.params.vocab_size: required"),
        ({"data_path": "d.txt", "vocab_size": 10}, "workload.params.vocab_size: only with"),
        (
            {"data_path": "d.bin", "token_dtype": "uint16", "vocab_size": 70_000},
            "does not fit uint16 ids",
        ),
        ({"data_path": "d.bin", "token_dtype": "int8", "vocab_size": 9}, "token_dtype"),
        (
            {"data_path": "d.txt", "eval_path": "v.txt", "eval_fraction": 0.2},
            "workload.params.eval_fraction: give eval_path or eval_fraction, not both",
        ),
        ({"data_path": "d.txt", "eval_fraction": 1.0}, "workload.params.eval_fraction"),
        ({"data_path": ""}, "workload.params.data_path"),
    ],
)
def test_bad_data_params_name_the_field(params: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError) as caught:
        WorkloadSpec.model_validate({"name": "gpt", "params": params})
    assert message in str(caught.value)


# -- paths under the storage root -----------------------------------------------------------


#: The tenant whose data area the tests use: `<storage>/data/t/`.
TENANT = "t"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A tenant's data area: its `data/` folder holds the files the tests name."""
    area = tmp_path / "storage" / "data" / TENANT
    (area / "data").mkdir(parents=True)
    np.arange(200, dtype="<u2").tofile(area / "data" / "ok.bin")
    (area / "data" / "odd.bin").write_bytes(b"\0" * 201)
    np.arange(40, dtype="<u2").tofile(area / "data" / "short.bin")
    (area / "data" / "folder.bin").mkdir()
    (tmp_path / "outside.bin").write_bytes(b"\0" * 400)
    (area / "data" / "link.bin").symlink_to(tmp_path / "outside.bin")
    return area


def _problems(root: Path, **params: Any) -> list[str]:
    base = {"seq_len": 16, "token_dtype": "uint16", "vocab_size": 200}
    storage = root.parent.parent
    return data_path_problems(GptParams.model_validate({**base, **params}), storage, TENANT)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"data_path": "../outside.bin"}, "data_path: '../outside.bin': '..' is not allowed"),
        ({"data_path": "ROOT/../outside.bin"}, "'..' is not allowed"),
        ({"data_path": "/etc/passwd"}, "is outside your data area"),
        ({"data_path": "data/link.bin"}, "is outside your data area"),
        ({"data_path": "data/missing.bin"}, "data_path: 'data/missing.bin' does not exist"),
        ({"data_path": "data/folder.bin"}, "is not a regular file"),
        ({"data_path": "data/odd.bin"}, "201 bytes is not a whole number of uint16 token ids"),
        ({"data_path": "data/short.bin"}, "fewer than one window of seq_len + 1 = 17"),
        ({"data_path": "data/ok.bin", "eval_fraction": 0.05}, "10 held-out tokens, fewer than"),
        ({"data_path": "data/ok.bin", "eval_path": "data/short.bin", "seq_len": 64}, "eval_path"),
    ],
)
def test_data_path_problems(root: Path, params: dict, message: str) -> None:  # type: ignore[type-arg]
    params = {
        k: v.replace("ROOT", str(root)) if isinstance(v, str) else v for k, v in params.items()
    }
    problems = _problems(root, **params)
    assert any(message in p for p in problems), problems
    assert all(p.startswith("workload.params.") for p in problems)


def test_good_data_paths(root: Path) -> None:
    assert _problems(root, data_path="data/ok.bin") == []
    assert _problems(root, data_path=str(root / "data" / "ok.bin")) == []  # absolute inside
    assert _problems(root, data_path="data/ok.bin", eval_path="data/short.bin") == []


# -- the datasets ---------------------------------------------------------------------------


def _gpt(root: Path, **params: Any) -> Any:
    spec = WorkloadSpec.model_validate(
        {"name": "gpt", "params": {"n_layer": 1, "n_embd": 16, "n_head": 2, **params}}
    )
    return load_workload(spec, storage_root=root)


def test_token_file_windows_and_the_held_out_split(root: Path) -> None:
    w = _gpt(root, seq_len=16, data_path="data/ok.bin", token_dtype="uint16", vocab_size=200)
    # 200 ids, the last 10% (20) held out: 180 for training, windows of 17 -> 10 of them.
    assert len(w.dataset) == 10 and len(w.eval_dataset) == 1
    x, y = w.dataset[3]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == list(range(51, 67)) and y.tolist() == list(range(52, 68))
    trained = {int(t) for i in range(len(w.dataset)) for t in torch.cat(w.dataset[i])}
    held = {int(t) for t in torch.cat(w.eval_dataset[0])}
    assert max(trained) < 180 <= min(held)  # no training window touches the held-out end
    assert w.model.tok_emb.num_embeddings == 200


def test_an_id_beyond_the_vocabulary_is_a_configuration_error(root: Path) -> None:
    with pytest.raises(WorkloadError, match=r"workload.params.vocab_size: .* token id 199"):
        _gpt(root, seq_len=16, data_path="data/ok.bin", token_dtype="uint16", vocab_size=150)


def test_text_files_are_characters_and_must_be_utf8(root: Path) -> None:
    (root / "data" / "t.txt").write_text("abcabcabc" * 10)
    w = _gpt(root, seq_len=8, data_path="data/t.txt", eval_fraction=0.2)
    assert w.model.tok_emb.num_embeddings == 3 and w.dataset[0][0].tolist()[:3] == [0, 1, 2]
    (root / "data" / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    with pytest.raises(WorkloadError, match=r"data_path: .* is not UTF-8 text"):
        _gpt(root, seq_len=8, data_path="data/latin1.txt")


# -- prepare-text ----------------------------------------------------------------------------


def test_prepare_text_gives_the_bundled_corpus_ids(tmp_path: Path) -> None:
    from importlib import resources

    corpus = resources.files("elastrain.workers.workloads").joinpath("data", "tinyshakespeare.txt")
    source = tmp_path / "shakespeare.txt"
    source.write_text(corpus.read_text("utf-8"))
    out = tmp_path / "storage" / "data" / "default" / "shakespeare"  # the tenant's area
    env = {"ELASTRAIN_STORAGE_PATH": str(tmp_path / "storage")}
    result = CliRunner().invoke(app, ["prepare-text", str(source), str(out)], env=env)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)["workload"]["params"]
    assert printed == {
        "data_path": "shakespeare/train.bin",
        "token_dtype": "uint16",
        "vocab_size": 65,
        "eval_path": "shakespeare/val.bin",
    }
    tokens, _ = load_corpus()
    train = np.fromfile(out / "train.bin", dtype="<u2")
    val = np.fromfile(out / "val.bin", dtype="<u2")
    assert np.array_equal(np.concatenate([train, val]), tokens.numpy())
    assert len(val) == -(-len(tokens) // 10)  # the last tenth, rounded up
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 65 and len(meta["vocab"]) == 65
    # The prepared files train: the workload built from them has the bundled ids.
    w = _gpt(tmp_path / "storage" / "data" / "default", seq_len=32, **printed)
    assert w.dataset[0][0].tolist() == tokens[:32].tolist()


def test_prepare_text_errors_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(app, ["prepare-text", str(tmp_path / "nope.txt"), str(tmp_path / "o")])
    assert missing.exit_code == 2 and "cannot read" in missing.stderr
    (tmp_path / "empty.txt").write_text("")
    empty = runner.invoke(app, ["prepare-text", str(tmp_path / "empty.txt"), str(tmp_path / "o")])
    assert empty.exit_code == 2 and "is empty" in empty.stderr
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    binary = runner.invoke(app, ["prepare-text", str(tmp_path / "bin.txt"), str(tmp_path / "o")])
    assert binary.exit_code == 2 and "not UTF-8" in binary.stderr


# -- the exact-data-position guarantee on a token file -------------------------------------

STEPS = 6


def token_spec(kind: str, data: Path, *, every: int = 100) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": f"tokens-{kind}",
            "workload": {
                "name": "gpt",
                "params": {
                    "n_layer": 2,
                    "n_embd": 16,
                    "n_head": 2,
                    "seq_len": 16,
                    "data_path": str(data),
                    "token_dtype": "uint32",
                    "vocab_size": 97,
                },
            },
            "strategy": {"kind": kind, **({"pipeline_stages": 2} if kind == "pipeline" else {})},
            "scaling": {"min_workers": 1, "max_workers": 2},
            "training": {
                "global_batch_size": 8,
                "micro_batch_size": 2,
                "max_steps": STEPS,
                "learning_rate": 3e-3,
                "eval_every": 3,  # and at the end: steps 3 and 6
                "eval_samples": 50,
                "seed": 11,
            },
            "checkpoint": {"every_steps": every, "async_save": False},
        }
    )


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    data = root / "train.bin"
    rng.integers(0, 97, size=20_000, dtype=np.uint32).astype("<u4").tofile(data)
    ws2 = [
        ("ddp2", str(root / "ddp2"), token_spec("ddp", data), []),
        ("fsdp2", str(root / "fsdp2"), token_spec("fsdp", data), []),
        ("pipeline2", str(root / "pipeline2"), token_spec("pipeline", data), []),
        # STOP with the third poll: checkpoint after step 3 at world size 2.
        ("stop2", str(root / "stop"), token_spec("fsdp", data), ["none", "none", "stop"]),
    ]
    ws1 = [
        ("ddp1", str(root / "ddp1"), token_spec("ddp", data), []),
        ("resume1", str(root / "stop"), token_spec("fsdp", data), []),
    ]
    out: dict[str, Any] = run_distributed(run_jobs, 2, ws2, timeout_s=600)[0]
    out.update(run_distributed(run_jobs, 1, ws1, timeout_s=600)[0])
    return out


def _values(run: dict[str, Any], key: str) -> list[Any]:
    return [getattr(m, key) for m in run["metrics"]]


def test_a_token_file_gives_the_same_batches_and_losses_at_any_world_size(
    token_runs: dict[str, Any],
) -> None:
    one, two = token_runs["ddp1"], token_runs["ddp2"]
    assert len(_values(one, "batch_crc")) == STEPS
    assert _values(one, "batch_crc") == _values(two, "batch_crc")
    assert _values(two, "loss") == pytest.approx(_values(one, "loss"), rel=RTOL)


def test_an_fsdp_resume_at_another_size_continues_them(token_runs: dict[str, Any]) -> None:
    stopped, resumed, whole = token_runs["stop2"], token_runs["resume1"], token_runs["fsdp2"]
    assert resumed["result"].resumed_from_step == 3
    assert _values(stopped, "batch_crc") + _values(resumed, "batch_crc") == _values(
        whole, "batch_crc"
    )
    assert _values(stopped, "loss") + _values(resumed, "loss") == pytest.approx(
        _values(whole, "loss"), rel=RTOL
    )


def test_relative_paths_resolve_under_the_storage_root(root: Path) -> None:
    here = Path.cwd()
    os.chdir(root.parent)  # a relative path must not be read from the current directory
    try:
        w = _gpt(root, seq_len=16, data_path="data/ok.bin", token_dtype="uint16", vocab_size=200)
    finally:
        os.chdir(here)
    assert len(w.dataset) == 10


def _evals(run: dict[str, Any]) -> dict[int, float]:
    return {m.step: m.eval_loss for m in run["metrics"] if m.eval_loss is not None}


def test_the_held_out_loss_is_the_same_at_any_world_size_and_strategy(
    token_runs: dict[str, Any],
) -> None:
    """eval_every: 3 gives eval_loss at steps 3 and 6, on the held-out end of the file
    (10%), over the same 50 samples whoever computes them."""
    reference = _evals(token_runs["ddp1"])
    assert sorted(reference) == [3, 6]
    # Uniformly random ids: nothing to learn, so the held-out loss stays near ln 97.
    assert all(abs(v - math.log(97)) < 0.1 for v in reference.values()), reference
    for label in ("ddp2", "fsdp2", "pipeline2"):
        assert _evals(token_runs[label]) == pytest.approx(reference, rel=1e-4), label
    resumed = {**_evals(token_runs["stop2"]), **_evals(token_runs["resume1"])}
    assert resumed == pytest.approx(_evals(token_runs["fsdp2"]), rel=RTOL)


def test_eval_every_needs_a_held_out_split() -> None:
    from tests.factories import spec_dict

    for workload, words in [
        ({"name": "synthetic"}, "the synthetic workload has no held-out split"),
        ({"name": "gpt"}, "set workload.params.eval_fraction"),
    ]:
        with pytest.raises(ValidationError, match=words):
            JobSpec.model_validate(spec_dict(workload=workload, training={"eval_every": 5}))
    bundled = {"name": "gpt", "params": {"eval_fraction": 0.05}}
    JobSpec.model_validate(spec_dict(workload=bundled, training={"eval_every": 5}))
