"""The gpt workload's data files on the storage root: whose they are, where, whether they work.

Every tenant reads data from its own area of the storage root (the folder every node
shares), and from the shared area an operator publishes data sets in:

```
<storage>/data/<tenant>/...   a tenant's own files: `data_path: mytext/train.bin`
<storage>/shared/...          published read-only by the operator: `data_path: shared/...`
```

A `data_path` (and `eval_path`) is relative to the job owner's area, or starts with
`shared/`; an absolute path is accepted only inside one of those two. Links are resolved
before the path is confined, so a link in a tenant's area cannot reach another tenant's
files, a job's folder or the package store. Errors name the path as the job gave it and
never a server path, nor anything about files outside the areas the job may read.

The API checks at submit what can be checked without reading the data (the file exists and
is a regular file, a binary file holds whole token ids, there are enough tokens for one
training window on each side of the split), so a typo is a 422 naming the field. The
control plane resolves the paths again when it launches an attempt, and hands the workers
the path relative to the storage root (`storage_relative_data_paths`), which they confine to
the root once more (`elastrain.workers.workloads.load_workload`). Torch-free.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from elastrain.contracts.workload_params import (
    TOKEN_WIDTH,
    GptParams,
    HfCausalLmParams,
    PrepareParams,
)

#: Tenants' own areas: `<storage>/data/<tenant>/`.
TENANT_DATA_DIR = "data"
#: Data an operator publishes for every tenant, read-only for jobs: `<storage>/shared/`.
SHARED_DATA_DIR = "shared"
#: The params of the gpt (and hf_causal_lm) that name files or folders.
PATH_PARAMS = ("data_path", "eval_path", "model", "tokenizer")
#: A Hugging Face tokenizer's file, in the folder `tokenizer` names.
TOKENIZER_FILE = "tokenizer.json"
#: The most bytes of a tokenizer.json read at submit (large vocabularies are ~10-20 MB).
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
#: The built-in workloads that read files from the tenant's data area.
DATA_WORKLOADS = frozenset({"gpt", "hf_causal_lm"})

_WHERE = (
    "data paths are relative to your tenant's data area (<storage>/data/<tenant>/), or "
    "start with 'shared/' for data the operator publishes"
)


class DataPathError(ValueError):
    """The path cannot name a data file the job may read; the message says why."""


def tenant_area(storage_root: Path, owner: str) -> Path:
    """A tenant's own data folder under the storage root."""
    if not owner or "/" in owner or owner in (".", ".."):
        raise DataPathError(f"tenant {owner!r} has no data area")
    return storage_root / TENANT_DATA_DIR / owner


def shared_area(storage_root: Path) -> Path:
    return storage_root / SHARED_DATA_DIR


def paths_as_given(text: str, storage_root: Path, owner: str) -> str:
    """`text` (a failure's message) with paths as the tenant gives them: its own data area
    dropped (`mytext/train.bin`), the shared one as `shared/...`, anything else under the
    storage root as `<storage>/...`: a reason never tells a tenant where the server keeps
    things. Both the root as configured and as resolved are found, and the
    root-relative form the workers get (`data/<tenant>/...`)."""
    roots = {str(storage_root), str(storage_root.resolve())}
    for root in sorted(roots, key=len, reverse=True):
        text = text.replace(f"{root}/{TENANT_DATA_DIR}/{owner}/", "")
        text = text.replace(f"{root}/{SHARED_DATA_DIR}/", f"{SHARED_DATA_DIR}/")
        text = text.replace(root, "<storage>")
    return text.replace(f"{TENANT_DATA_DIR}/{owner}/", "")


def resolve_data_path(path: str, storage_root: Path, owner: str) -> Path:
    """The real absolute path of a data file of `owner`'s job: in the owner's own area, or
    in the shared one (`shared/...`); anything else is refused without saying whether it
    exists."""
    raw = Path(path)
    if ".." in raw.parts:
        raise DataPathError(f"{path!r}: '..' is not allowed; {_WHERE}")
    root = storage_root.resolve()
    own, shared = tenant_area(root, owner), shared_area(root)
    if raw.is_absolute():
        candidate = raw
    elif raw.parts and raw.parts[0] == SHARED_DATA_DIR:
        candidate = shared.joinpath(*raw.parts[1:])
    else:
        candidate = own / raw
    real = candidate.resolve()
    for area in (own.resolve(), shared.resolve()):
        if real.is_relative_to(area) and real != area:
            return real
    raise DataPathError(f"{path!r} is outside your data area (links resolved); {_WHERE}")


def resolve_under(path: str, root: Path) -> Path:
    """`path` (relative to `root`, or absolute inside it) once links are resolved, refused
    outside `root`: the workers' last check on what the control plane handed them."""
    raw = Path(path)
    if ".." in raw.parts:
        raise DataPathError(f"{path!r}: '..' is not allowed")
    base = root.resolve()
    real = (raw if raw.is_absolute() else base / raw).resolve()
    if not real.is_relative_to(base):
        raise DataPathError(f"{path!r} lies outside the storage root, links resolved")
    return real


def storage_relative_data_paths(
    params: dict[str, Any], storage_root: Path, owner: str
) -> dict[str, Any]:
    """The gpt's params with each data path resolved for `owner` and written relative to
    the storage root, as the workers receive them. Raises DataPathError."""
    out = dict(params)
    root = storage_root.resolve()
    for key in PATH_PARAMS:
        if isinstance(out.get(key), str):
            try:
                real = resolve_data_path(out[key], root, owner)
            except DataPathError as exc:
                raise DataPathError(f"workload.params.{key}: {exc}") from exc
            out[key] = str(real.relative_to(root))
    return out


def split_sizes(tokens: int, held_out_fraction: float) -> tuple[int, int]:
    """(training tokens, held-out tokens) of a file of `tokens`: the held-out part is the
    end of the file, rounded up."""
    held = math.ceil(tokens * held_out_fraction) if held_out_fraction > 0 else 0
    return tokens - held, held


def data_path_problems(
    params: GptParams | HfCausalLmParams, storage_root: Path, owner: str
) -> list[str]:
    """What is wrong with the params' data files (and an hf_causal_lm's model folder) for
    `owner`'s job, one line per problem, each starting with `workload.params.<key>:` ([]
    when they can work, or when no data_path is given)."""
    window = params.seq_len + 1
    problems: list[str] = []
    if isinstance(params, HfCausalLmParams) and params.model is not None:
        problems.extend(model_folder_problems(params.model, storage_root, owner))
    if params.tokenizer is not None:
        problems.extend(tokenizer_problems(params, storage_root, owner))
    for key in ("data_path", "eval_path"):
        path = getattr(params, key)
        if path is None:
            continue
        where = f"workload.params.{key}"
        try:
            real = resolve_data_path(path, storage_root, owner)
        except DataPathError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not real.exists():
            problems.append(
                f"{where}: {path!r} does not exist in your data area; copy the data there "
                f"first ({_WHERE})"
            )
            continue
        if key == "data_path" and real.is_dir():
            from elastrain.contracts.prepared import prepared_problems

            problems.extend(prepared_problems(params, path, real))
            continue
        if not real.is_file():
            problems.append(f"{where}: {path!r} is not a regular file")
            continue
        size = real.stat().st_size
        if params.token_dtype is not None:
            width = TOKEN_WIDTH[params.token_dtype]
            if size % width:
                problems.append(
                    f"{where}: {size} bytes is not a whole number of {params.token_dtype} "
                    f"token ids ({width} bytes each); is token_dtype right?"
                )
                continue
            tokens = size // width
        else:
            tokens = size  # an upper bound for UTF-8 text: the worker counts characters
        if key == "eval_path":
            if tokens < window:
                problems.append(f"{where}: {tokens} tokens, fewer than one window ({window})")
            continue
        train, held = split_sizes(tokens, params.held_out_fraction)
        if train < window:
            problems.append(
                f"{where}: {train} tokens for training, fewer than one window of seq_len + 1 "
                f"= {window}"
            )
        if 0 < held < window:
            problems.append(
                f"{where}: {held} held-out tokens, fewer than one window of seq_len + 1 = "
                f"{window}; hold out more (eval_fraction) or give an eval_path"
            )
    return problems


def model_folder_problems(path: str, storage_root: Path, owner: str) -> list[str]:
    """What is wrong with an hf_causal_lm's `model` folder: it must be a folder in the
    owner's (or the shared) data area holding a `config.json`."""
    where = "workload.params.model"
    try:
        real = resolve_data_path(path, storage_root, owner)
    except DataPathError as exc:
        return [f"{where}: {exc}"]
    if not real.is_dir():
        return [
            f"{where}: {path!r} is not a folder in your data area; copy the model's folder "
            f"(config.json, model.safetensors) there first ({_WHERE})"
        ]
    if not (real / "config.json").is_file():
        return [f"{where}: {path!r} has no config.json (a Hugging Face model folder has)"]
    return []


def tokenizer_file(real: Path) -> Path:
    """The tokenizer.json a `tokenizer` param names: the folder's, or the file itself."""
    return real / TOKENIZER_FILE if real.is_dir() else real


def tokenizer_vocab_size(data: bytes) -> int:
    """The vocabulary of a Hugging Face tokenizer.json (its model's ids and the added
    tokens'), read as JSON. ValueError when it is not one."""
    doc = json.loads(data)
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = [i for i in vocab.values() if isinstance(i, int)]
    elif isinstance(vocab, list):  # Unigram: [token, score] by id
        ids = list(range(len(vocab)))
    else:
        raise ValueError("no model.vocab: not a Hugging Face tokenizer.json")
    added = doc.get("added_tokens") or []
    ids += [t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if not ids:
        raise ValueError("an empty vocabulary")
    return max(ids) + 1


def tokenizer_problems(
    params: GptParams | HfCausalLmParams | PrepareParams, storage_root: Path, owner: str
) -> list[str]:
    """What is wrong with the params' `tokenizer`: it must name a tokenizer.json (or a
    folder holding one) in the owner's (or the shared) area, and an hf_causal_lm built
    from a config must have an embedding row for each of its ids."""
    where, path = "workload.params.tokenizer", params.tokenizer
    assert path is not None
    try:
        real = resolve_data_path(path, storage_root, owner)
    except DataPathError as exc:
        return [f"{where}: {exc}"]
    try:
        # The file in a folder goes through the same rules: a link there resolved, then
        # confined to the areas the job may read.
        found = (
            resolve_data_path(str(Path(path) / TOKENIZER_FILE), storage_root, owner)
            if real.is_dir()
            else real
        )
    except DataPathError as exc:
        return [f"{where}: {exc}"]
    if not found.is_file():
        return [
            f"{where}: {path!r} is not a {TOKENIZER_FILE} nor a folder holding one in your "
            f"data area ({_WHERE}); save it with tokenizer.save_pretrained(folder) and copy it"
        ]
    try:
        with found.open("rb") as f:
            data = f.read(MAX_TOKENIZER_BYTES + 1)
        if len(data) > MAX_TOKENIZER_BYTES:
            return [f"{where}: {path!r} is larger than {MAX_TOKENIZER_BYTES} bytes"]
        vocab = tokenizer_vocab_size(data)
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        return [f"{where}: {path!r} is not a Hugging Face {TOKENIZER_FILE} ({exc})"]
    model_vocab = (
        params.config.get("vocab_size")
        if isinstance(params, HfCausalLmParams) and params.config is not None
        else None
    )
    if isinstance(model_vocab, int) and model_vocab < vocab:
        return [
            f"workload.params.config.vocab_size ({model_vocab}) is smaller than the "
            f"tokenizer's vocabulary ({vocab}): every token id must have an embedding row; "
            "raise config.vocab_size"
        ]
    return []
