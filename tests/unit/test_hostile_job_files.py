"""What a job's code can write into its folder, read by the control plane (issue 45).

Real files and links on disk: a link planted in a checkpoints folder is neither listed,
exported nor deleted through; control files are read through no link and within a size;
a folder planted under a future job id is set aside at the job's first launch; a planted
DCP `.metadata` pickle is refused by the export child and never runs; what an export task
wrote is packed by the API only as plain JSON and safetensors files, through no link.
"""

from __future__ import annotations

import os
import pickle
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastrain.checkpoints.catalog import list_committed
from elastrain.checkpoints.dcp.untrusted import UntrustedCheckpoint, load_metadata
from elastrain.checkpoints.export import (
    ExportError,
    child_env,
    export_in_child,
    pack_export,
    remove_export,
)
from elastrain.checkpoints.fence import FenceUnreadable, claim_job_folder, read_fence
from elastrain.checkpoints.layout import step_dir_name
from elastrain.checkpoints.manifest import MAX_MANIFEST_BYTES, ManifestError, read_manifest
from elastrain.checkpoints.retention import delete_checkpoints, retention_plan
from elastrain.contracts.files import ConfinedFileError, read_bounded
from elastrain.contracts.runtime import ExportRequest
from elastrain.workers.export_task import run_export
from tests.unit.test_checkpoints_pure import make_checkpoint


def two_tenants(tmp_path: Path) -> tuple[Path, Path, Path]:
    """storage root, job 1's checkpoints folder, tenant b's data file (must survive)."""
    storage = tmp_path / "storage"
    ckpts = storage / "jobs" / "1" / "checkpoints"
    ckpts.mkdir(parents=True)
    data = storage / "data" / "b" / "corpus.txt"
    data.parent.mkdir(parents=True)
    data.write_text("tenant b's data")
    return storage, ckpts, data


def test_links_in_a_checkpoints_folder_are_never_listed_nor_deleted_through(
    tmp_path: Path,
) -> None:
    storage, ckpts, data = two_tenants(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the storage's")
    for step in (1, 2, 3):
        make_checkpoint(ckpts, step)
    # Another job's committed checkpoint, linked in as an older step of this job.
    other = make_checkpoint(storage / "jobs" / "2" / "checkpoints", 0)
    (ckpts / step_dir_name(0, 0)).symlink_to(other)
    (ckpts / step_dir_name(0, 1)).symlink_to(data.parent)  # b's data area, as a step folder name
    (ckpts / step_dir_name(0, 2)).symlink_to(outside)

    assert {i.step for i in list_committed(ckpts)} == {1, 2, 3}  # no linked "step 0"
    doomed = retention_plan(ckpts, keep_last=2)
    assert [p.name for p in doomed] == [step_dir_name(1, 0)]
    # Even when asked to delete the links by name, only the links go.
    delete_checkpoints(ckpts, [*doomed, ckpts / step_dir_name(0, 0), ckpts / step_dir_name(0, 1)])
    delete_checkpoints(ckpts, [ckpts / step_dir_name(0, 2)])
    assert data.read_text() == "tenant b's data"
    assert (other / "manifest.json").is_file() and (outside / "keep").is_file()
    assert not (ckpts / step_dir_name(0, 0)).exists() and not os.path.lexists(
        ckpts / step_dir_name(0, 1)
    )


def test_a_checkpoints_folder_that_is_a_link_lists_nothing_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    storage, ckpts, _ = two_tenants(tmp_path)
    victim = storage / "jobs" / "2" / "checkpoints"
    for step in (1, 2, 3):
        make_checkpoint(victim, step)
    ckpts.rmdir()
    ckpts.symlink_to(victim)
    assert list_committed(ckpts) == [] and retention_plan(ckpts, 2) == []
    delete_checkpoints(ckpts, [ckpts / step_dir_name(1, 0)])
    assert len(list_committed(victim)) == 3


def test_a_step_folder_elsewhere_is_not_deleted(tmp_path: Path) -> None:
    _, ckpts, data = two_tenants(tmp_path)
    with pytest.raises(ValueError, match="not a step folder"):
        delete_checkpoints(ckpts, [data.parent])
    assert data.is_file()


@pytest.mark.parametrize(
    "plant, match",
    [
        ("link", "link is never followed"),
        ("fifo", "not a regular file"),
        ("sparse", "more than"),
    ],
)
def test_control_files_are_read_through_no_link_and_within_a_size(
    tmp_path: Path, plant: str, match: str
) -> None:
    step = make_checkpoint(tmp_path / "ckpts", 5)
    manifest = step / "manifest.json"
    secret = tmp_path / "secret.json"
    secret.write_text(manifest.read_text())
    manifest.unlink()
    if plant == "link":
        manifest.symlink_to(secret)
    elif plant == "fifo":
        os.mkfifo(manifest)
    else:
        with open(manifest, "wb") as f:
            f.truncate(MAX_MANIFEST_BYTES + 1)  # a sparse 16 MiB: never read whole
    with pytest.raises(ManifestError, match=match):
        read_manifest(step)
    # The fence the same way.
    job = tmp_path / "job"
    job.mkdir()
    (job / "fence.json").symlink_to(secret)
    with pytest.raises(FenceUnreadable, match="link"):
        read_fence(job)


def test_read_bounded_reads_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read_bounded(str(tmp_path / "f"), 10) == b"x" * 10
    with pytest.raises(ConfinedFileError, match="10 bytes, more than the 9"):
        read_bounded(str(tmp_path / "f"), 9)


def test_a_folder_planted_under_a_future_job_id_is_set_aside(tmp_path: Path) -> None:
    storage, _, _ = two_tenants(tmp_path)
    planted = storage / "jobs" / "7"
    make_checkpoint(planted / "checkpoints", 900)
    moved = claim_job_folder(planted, "db", first_attempt=True)
    assert moved is not None and moved.name.startswith("7.set-aside")
    assert list_committed(moved / "checkpoints")  # kept, not deleted: someone's data
    assert planted.is_dir() and list(planted.iterdir()) == []  # a fresh, empty folder
    # A link (to another job's folder) in place of the folder is set aside too, even later.
    planted.rmdir()
    planted.symlink_to(storage / "jobs" / "1")
    moved = claim_job_folder(planted, "db", first_attempt=False)
    assert moved is not None and moved.is_symlink() and planted.is_dir()
    assert not planted.is_symlink() and (storage / "jobs" / "1" / "checkpoints").is_dir()
    # The job's own folder at a later attempt is kept.
    (planted / "mine").write_text("ok")
    assert claim_job_folder(planted, "db", first_attempt=False) is None
    assert (planted / "mine").is_file()


# -- the export child ----------------------------------------------------------------------


class _Planted:
    """A pickle that, unpickled, writes a file: what a job's code would put in `.metadata`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def a_checkpoint(root: Path) -> Path:
    """A real committed DCP checkpoint of a gpt-shaped model, under root/jobs/1/checkpoints."""
    from elastrain.checkpoints.integrity import describe_files
    from elastrain.checkpoints.manifest import Manifest, write_manifest

    step = root / "jobs" / "1" / "checkpoints" / "step_1-a1"
    state = {"model": {"w": torch.randn(4, 4)}}
    dcp.save(state, checkpoint_id=step, no_dist=True)
    files = describe_files(step)
    total = sum(f["size"] for f in files.values())
    write_manifest(step, Manifest(step=1, attempt=1, world_size=1, files=files, total_bytes=total))
    return step


def test_a_real_metadata_loads_and_a_planted_pickle_is_refused_unrun(tmp_path: Path) -> None:
    step = a_checkpoint(tmp_path)
    meta = load_metadata((step / ".metadata").read_bytes())
    assert "model.w" in meta.state_dict_metadata
    marker = tmp_path / "pwned"
    for payload in (
        pickle.dumps(_Planted(marker)),
        pickle.dumps({"x": __import__("builtins").eval}),
        b"cbuiltins\nopen\n(S'/tmp/x'\nS'w'\ntR.",
    ):
        with pytest.raises(UntrustedCheckpoint, match="refused, nothing of it was run"):
            load_metadata(payload)
    assert not marker.exists()


def test_metadata_naming_files_out_of_its_folder_is_refused(tmp_path: Path) -> None:
    step = a_checkpoint(tmp_path)
    meta = load_metadata((step / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "../../../2/checkpoints/step_1-a1/__0_0.distcp"
    with pytest.raises(UntrustedCheckpoint, match="not a file of the checkpoint's own folder"):
        load_metadata(pickle.dumps(meta))


def test_the_export_child_refuses_a_planted_metadata_and_runs_none_of_it(tmp_path: Path) -> None:
    step = a_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ExportError, match=r"^step_1-a1: .*posix.system.*refused"):
        export_in_child(step, "gpt", {}, tmp_path / "out", trusted_root=tmp_path)
    assert not marker.exists()


def test_the_export_child_enters_no_linked_step_folder(tmp_path: Path) -> None:
    step = a_checkpoint(tmp_path / "b")  # another tenant's job
    mine = tmp_path / "a" / "jobs" / "1" / "checkpoints"
    mine.mkdir(parents=True)
    (mine / "step_1-a1").symlink_to(step)
    with pytest.raises(ExportError, match="link or not a folder"):
        export_in_child(mine / "step_1-a1", "gpt", {}, tmp_path / "out", trusted_root=tmp_path)


def test_the_export_child_gets_none_of_the_services_secrets() -> None:
    env = child_env(
        {
            "PATH": "/usr/bin",
            "ELASTRAIN_API_TOKEN": "t",
            "ELASTRAIN_DATABASE_URL": "postgresql://u:p@h/db",
            "MLFLOW_TRACKING_TOKEN": "m",
            "PGPASSWORD": "p",
            "AWS_SECRET_ACCESS_KEY": "s",
        }
    )
    assert env["PATH"] == "/usr/bin" and env["HF_HUB_OFFLINE"] == "1"
    assert not {"ELASTRAIN_API_TOKEN", "ELASTRAIN_DATABASE_URL", "MLFLOW_TRACKING_TOKEN"} & set(env)
    assert not {"PGPASSWORD", "AWS_SECRET_ACCESS_KEY"} & set(env)


def test_a_model_config_with_code_of_its_own_is_a_reason_not_a_crash() -> None:
    from elastrain.checkpoints.dcp.export import _config_for

    with pytest.raises(ExportError, match=r"workload.params.model: .*no model_type \(auto_map"):
        _config_for({"auto_map": {"AutoConfig": "x.Config"}}, {"model": "mine/"})
    with pytest.raises(ExportError, match="model_type 'nonesuch'"):
        _config_for({"model_type": "nonesuch"}, {"config": {}})
    assert _config_for({"model_type": "gpt2", "n_layer": 1}, {"config": {}}).n_layer == 1


def test_exports_at_once_are_bounded_in_all_and_per_tenant() -> None:
    from elastrain.api.errors import TooMany
    from elastrain.api.export_slots import ExportSlots

    slots = ExportSlots(total=2, per_tenant=1)
    with slots.slot("a"):
        with pytest.raises(TooMany, match="EXPORT_MAX_PER_TENANT"), slots.slot("a"):
            pass
        with (
            slots.slot("b"),
            pytest.raises(TooMany, match="EXPORT_MAX_CONCURRENT"),
            slots.slot("c"),
        ):
            pass
        with slots.slot("c"):  # b's ended
            pass
    with slots.slot("a"):  # a's first ended
        pass


@pytest.mark.parametrize(
    "text, given",
    [
        ("cannot load {root}/data/a/mymodel (no config)", "cannot load mymodel (no config)"),
        ("cannot load data/a/mymodel ({root}/data/a/mymodel)", "cannot load mymodel (mymodel)"),
        ("cannot read {root}/shared/corpus.bin", "cannot read shared/corpus.bin"),
        ("{root}/jobs/3/files/x", "<storage>/jobs/3/files/x"),
        ("no path here", "no path here"),
    ],
)
def test_failure_reasons_name_paths_as_the_tenant_gave_them(
    tmp_path: Path, text: str, given: str
) -> None:
    from elastrain.contracts.datasets import paths_as_given

    assert paths_as_given(text.format(root=tmp_path), tmp_path, "a") == given


def an_export(tmp_path: Path) -> tuple[Path, Path]:
    """storage root and an export folder below it, as a task leaves it."""
    folder = tmp_path / "exports" / "n" / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    return tmp_path, folder


def test_the_api_packs_an_export_without_parsing_it_and_deletes_it(tmp_path: Path) -> None:
    root, folder = an_export(tmp_path)
    pack_export(root, folder, tmp_path / "a.tar", max_bytes=1000)
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert tar.getnames() == ["config.json", "model.safetensors"]
        assert tar.extractfile("model.safetensors").read() == b"\0" * 100  # type: ignore[union-attr]
    remove_export(root, folder.parent)
    assert not folder.parent.exists() and (root / "exports").is_dir()


@pytest.mark.parametrize(
    "plant, reason",
    [
        (lambda f, b: (f / "config.json").unlink() or (f / "config.json").symlink_to(b), "link"),
        (lambda f, b: os.mkfifo(f / "x.json"), "not a regular file"),
        (lambda f, b: (f / "modeling.py").write_text("import os"), "not a JSON or safetensors"),
        (lambda f, b: (f / "big.safetensors").write_bytes(b"\0" * 1000), "more than 1000 bytes"),
    ],
    ids=["link", "fifo", "code", "too-big"],
)
def test_the_api_packs_only_plain_json_and_safetensors_within_a_size(
    tmp_path: Path, plant: Any, reason: str
) -> None:
    root, folder = an_export(tmp_path)
    _, _, theirs = two_tenants(tmp_path)
    plant(folder, theirs)
    with pytest.raises(ExportError, match=reason):
        pack_export(root, folder, tmp_path / "a.tar", max_bytes=1000)
    assert theirs.read_text() == "tenant b's data"


def test_a_linked_export_folder_is_not_entered_nor_deleted_through(tmp_path: Path) -> None:
    root, _ = an_export(tmp_path)
    _, _, theirs = two_tenants(tmp_path)
    (root / "exports" / "m").symlink_to(theirs.parent)
    with pytest.raises(ExportError, match="link or not a folder"):
        pack_export(root, root / "exports" / "m", tmp_path / "a.tar", max_bytes=1000)
    remove_export(root, root / "exports" / "m")
    assert theirs.read_text() == "tenant b's data"


@pytest.mark.parametrize("field", ["checkpoint", "out", "model_folder"])
def test_the_export_task_takes_only_paths_below_the_storage_root(
    tmp_path: Path, field: str
) -> None:
    paths = {"checkpoint": "jobs/1/checkpoints/step_1-a1", "out": "exports/n/model"}
    for bad in ("../elsewhere", "/etc", "jobs/../../x"):
        request = ExportRequest(
            job_id=1, storage_path=str(tmp_path), workload="gpt", params_json="{}",
            **{**paths, field: bad},
        )  # fmt: skip
        outcome = run_export(request)
        assert "not a path below the storage root" in outcome.refused, outcome
    assert not (tmp_path.parent / "elsewhere").exists()
