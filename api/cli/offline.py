"""Tools that run here, with no server: token files for the gpt workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from elastrain.api.cli.output import fail
from elastrain.contracts.datasets import SHARED_DATA_DIR, TENANT_DATA_DIR


def prepare_text(
    source: Annotated[Path, typer.Argument(help="A UTF-8 text file.")],
    out_dir: Annotated[
        Path, typer.Argument(help="Where to write train.bin, val.bin and meta.json.")
    ],
    eval_fraction: Annotated[
        float, typer.Option(help="The share of the text (its end) held out in val.bin.")
    ] = 0.1,
) -> None:
    """Make the gpt workload's token files from a text file (runs here, no server)."""
    from elastrain.api.prepare_text import PrepareError
    from elastrain.api.prepare_text import prepare_text as prepare
    from elastrain.service.settings import Settings

    try:
        done = prepare(source, out_dir, eval_fraction=eval_fraction)
    except PrepareError as exc:
        fail(str(exc), code=2)
    typer.echo(
        f"{done.train_tokens} training and {done.val_tokens} held-out tokens, "
        f"vocabulary {done.vocab_size} ({done.token_dtype}) in {out_dir}",
        err=True,
    )
    folder = data_path_of(out_dir.resolve(), Settings().storage_path)
    if folder is None:
        typer.echo(
            f"note: {out_dir} is in no data area: copy it into your tenant's "
            "(<storage>/data/<tenant>/) and name it from there",
            err=True,
        )
        folder = out_dir.resolve()
    params: dict[str, Any] = {
        "data_path": str(folder / "train.bin"),
        "token_dtype": done.token_dtype,
        "vocab_size": done.vocab_size,
    }
    if done.val_tokens:
        params["eval_path"] = str(folder / "val.bin")
    typer.echo(json.dumps({"workload": {"name": "gpt", "params": params}}))


def data_path_of(folder: Path, storage: Path) -> Path | None:
    """How a job names `folder`: relative to the tenant's data area it lies in
    (`<storage>/data/<tenant>/...`), or `shared/...`; None when it is in neither."""
    own, shared = storage / TENANT_DATA_DIR, storage / SHARED_DATA_DIR
    if folder.is_relative_to(shared):
        return Path(SHARED_DATA_DIR) / folder.relative_to(shared)
    if folder.is_relative_to(own) and len(folder.relative_to(own).parts) >= 1:
        return Path(*folder.relative_to(own).parts[1:])
    return None
