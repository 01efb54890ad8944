"""`elastrain prepare`'s pure parts and its files, without Ray: the split by document, the
shards and index, windows over them, resume skipping finished inputs, errors at submit
and at run time. The Ray Data path is tests/integration/test_prepare_ray.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from elastrain.contracts.prepared import (
    JSON_LINES,
    PARQUET,
    TEXT,
    Index,
    InputFile,
    eval_count,
    is_eval_document,
    parts_of,
    prepare_problems,
    prepared_problems,
    read_index,
    storage_relative_prepare_paths,
)
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.workload_params import GptParams, HfCausalLmParams, PrepareParams
from elastrain.workers import prepare as prepare_module
from elastrain.workers.prepare import Preparation
from elastrain.workers.sampler import ElasticSampler
from elastrain.workers.workloads import WorkloadError
from elastrain.workers.workloads.prepared_data import (
    VirtualTokens,
    eval_mask,
    prepared_streams,
    split_runs,
)
from elastrain.workers.workloads.token_data import load_token_data

TENANT = "t"
DOCS = [
    f"doc {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 3}." for i in range(120)
]


def write_tokenizer(folder: Path, texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=150, special_tokens=["[UNK]", "[EOS]"])
    )
    tok.save(str(folder / "tokenizer.json"))


def write_hf_dataset(folder: Path, texts: list[str]) -> None:
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC streams and state.json."""
    folder.mkdir(parents=True)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as f:
        writer = pa.ipc.new_stream(f, pa.schema([("text", pa.string()), ("n", pa.int64())]))
        writer.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}))
        writer.close()
    files = [{"filename": "data-00000-of-00001.arrow"}]
    (folder / "state.json").write_text(json.dumps({"_data_files": files}))
    (folder / "dataset_info.json").write_text("{}")


def write_inputs(area: Path, docs: list[str]) -> None:
    """A quarter of the documents in each kind of input."""
    q = len(docs) // 4
    (area / "in").mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:q]))
    (area / "in" / "a.jsonl").write_text(lines)
    pq.write_table(pa.table({"text": docs[q : 2 * q]}), area / "in" / "b.parquet")
    (area / "in" / "c.txt").write_text("\n\n".join(docs[2 * q : 3 * q]) + "\n")
    write_hf_dataset(area / "in" / "hf", docs[3 * q :])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    area = root / "data" / TENANT
    write_tokenizer(area / "tok", DOCS)
    write_inputs(area, DOCS)
    return root


def params(**overrides: Any) -> PrepareParams:
    base: dict[str, Any] = {
        "inputs": ["in/*.jsonl", "in/b.parquet", "in/c.txt", "in/hf"],
        "tokenizer": "tok",
        "out": "prep",
        "eval_fraction": 0.25,
    }
    return PrepareParams.model_validate({**base, **overrides})


def prepare(root: Path, **overrides: Any) -> Index | None:
    """As the worker does: params resolved by the control plane, then prepared here."""
    p = params(**overrides)
    launched = storage_relative_prepare_paths(p.model_dump(), root, TENANT)
    points: list[Any] = []
    index = Preparation(PrepareParams.model_validate(launched)).run(
        root, points.append, use_ray=False
    )
    assert points and points[-1].custom["files_done"] == points[-1].custom["files"]
    return index


# --- the split -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "n", "held"),
    [(0.0, 10, []), (0.25, 8, [3, 7]), (0.1, 25, [9, 19]), (0.5, 5, [1, 3]), (0.3, 7, [3, 6])],
)
def test_held_out_documents_are_evenly_spread(fraction: float, n: int, held: list[int]) -> None:
    assert [i for i in range(n) if is_eval_document(i, fraction)] == held
    assert eval_count(n, fraction) == len(held)
    mask = eval_mask(0, n, fraction)
    assert np.flatnonzero(mask).tolist() == held
    assert eval_mask(3, n - 3, fraction).tolist() == mask[3:].tolist()  # any first document


@pytest.mark.parametrize(
    ("ends", "held", "train_runs", "held_runs"),
    [
        ([3, 5, 9, 10], [0, 1, 0, 0], [(0, 3), (5, 10)], [(3, 5)]),
        ([4], [0], [(0, 4)], []),
        ([2, 4, 6], [1, 1, 0], [(4, 6)], [(0, 4)]),
    ],
)
def test_runs_of_documents_per_side(
    ends: list[int], held: list[int], train_runs: list[Any], held_runs: list[Any]
) -> None:
    e, h = np.array(ends, dtype=np.uint64), np.array(held, dtype=bool)
    for side, runs in ((False, train_runs), (True, held_runs)):
        lo, hi = split_runs(e, h, want_held=side)
        assert list(zip(lo.tolist(), hi.tolist(), strict=True)) == runs


def test_virtual_tokens_read_across_pieces() -> None:
    a, b = np.arange(10, dtype=np.uint16), np.arange(100, 110, dtype=np.uint16)
    tokens = VirtualTokens([a, b], np.array([0, 1, 1]), np.array([2, 0, 4]), np.array([5, 0, 10]))
    assert len(tokens) == 9
    assert tokens[0:9].tolist() == [2, 3, 4, 104, 105, 106, 107, 108, 109]
    assert tokens[2:5].tolist() == [4, 104, 105]
    assert tokens[8:20].tolist() == [109]


# --- files: shards, index, windows ----------------------------------------------------


def test_every_kind_of_input_becomes_shards_and_an_index(root: Path) -> None:
    index = prepare(root)
    assert index is not None
    out = root / "data" / TENANT / "prep"
    assert read_index(out) == index
    assert [s.source for s in index.shards] == [
        "data/t/in/a.jsonl", "data/t/in/b.parquet", "data/t/in/c.txt",
        "data/t/in/hf/data-00000-of-00001.arrow",
    ]  # fmt: skip
    assert [s.documents for s in index.shards] == [30, 30, 30, 30]
    tok = Tokenizer.from_file(str(root / "data" / TENANT / "tok" / "tokenizer.json"))
    eos = tok.token_to_id("[EOS]")
    assert index.eos_id == eos and index.vocab_size == tok.get_vocab_size()
    assert index.token_dtype == "uint16"
    # Shard by shard: each document's ids and the end-of-text token, in row order.
    expected = [i for d in DOCS for i in [*tok.encode(d, add_special_tokens=False).ids, eos]]
    got = np.concatenate(
        [np.fromfile(out / s.bin_file, dtype="<u2") for s in index.shards]
    ).tolist()
    assert got == expected
    assert index.train_tokens + index.eval_tokens == len(expected)


def test_windows_pack_documents_and_never_cross_the_split(root: Path) -> None:
    index = prepare(root)
    assert index is not None
    folder = root / "data" / TENANT / "prep"
    tok = Tokenizer.from_file(str(root / "data" / TENANT / "tok" / "tokenizer.json"))
    docs = [[*tok.encode(d, add_special_tokens=False).ids, index.eos_id] for d in DOCS]
    train = [i for n, d in enumerate(docs) if not is_eval_document(n, 0.25) for i in d]
    held = [i for n, d in enumerate(docs) if is_eval_document(n, 0.25) for i in d]
    _, train_tokens, held_tokens = prepared_streams(folder)
    assert train_tokens[0 : len(train_tokens)].tolist() == train
    assert held_tokens[0 : len(held_tokens)].tolist() == held
    data = load_token_data(
        data_path=str(folder), token_dtype=None, vocab_size=None, eval_path=None,
        held_out_fraction=0.1, seq_len=16, stride=None,
    )  # fmt: skip
    assert data.vocab_size == index.vocab_size
    assert len(data.train) == (len(train) - 17) // 17 + 1
    assert data.held_out is not None and len(data.held_out) == (len(held) - 17) // 17 + 1
    x, y = data.train[3]
    assert x.dtype == torch.int64 and x.tolist() == train[51:67] and y.tolist() == train[52:68]
    hx, _ = data.held_out[1]
    assert hx.tolist() == held[17:33]


def test_the_same_sample_ids_give_the_same_tokens_at_any_world_size(root: Path) -> None:
    """The sampler names windows; a window is fixed by the files. A step's global batch is
    the same tokens whether 1 or 3 ranks share it, and when a resume at another size asks
    for it again."""
    prepare(root)
    folder = str(root / "data" / TENANT / "prep")

    def load() -> Any:
        return load_token_data(
            data_path=folder, token_dtype=None, vocab_size=None, eval_path=None,
            held_out_fraction=0.1, seq_len=8, stride=None,
        ).train  # fmt: skip

    windows = load()
    sampler = ElasticSampler(num_samples=len(windows), global_batch_size=12, seed=5)

    def step_tokens(step: int, dp: int, data: Any) -> list[list[int]]:
        shares = [sampler.replica_share(step, r, dp) for r in range(dp)]
        return [data[i][0].tolist() for share in shares for i in share]

    one = [step_tokens(s, 1, windows) for s in range(6)]
    three = [step_tokens(s, 3, windows) for s in range(6)]
    assert one == three
    resumed = load()  # a new attempt maps the files again, at world size 2, from step 3
    assert [step_tokens(s, 2, resumed) for s in range(3, 6)] == one[3:]


def record_tokenized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on: the key of every input (or part) tokenized, in order."""
    tokenized: list[str] = []
    real = prepare_module.tokenize_file

    def recording(source: InputFile, *args: Any) -> Any:
        tokenized.append(source.key)
        return real(source, *args)

    monkeypatch.setattr(prepare_module, "tokenize_file", recording)
    return tokenized


def test_a_retry_skips_finished_inputs(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = prepare(root)
    out = root / "data" / TENANT / "prep"
    # The second input's shard "was lost with its attempt": no done marker.
    lost = first.shards[1] if first else None
    assert lost is not None
    (out / "shards" / f"{lost.name}.done.json").unlink()
    tokenized = record_tokenized(monkeypatch)
    again = prepare(root)
    assert tokenized == [lost.source]
    assert again == first
    # A changed input is prepared again; the others are not.
    (root / "data" / TENANT / "in" / "c.txt").write_text("\n\n".join(DOCS[:5]))
    tokenized.clear()
    changed = prepare(root)
    assert tokenized == ["data/t/in/c.txt"] and changed is not None
    assert changed.shards[2].documents == 5
    # An input left out: its shard goes with the next index.
    fewer = prepare(root, inputs=["in/*.jsonl"])
    assert fewer is not None and len(fewer.shards) == 1
    names = {p.name.split(".")[0] for p in (out / "shards").iterdir() if p.name != "step.json"}
    assert names == {fewer.shards[0].name}


def test_a_stop_keeps_finished_inputs(root: Path) -> None:
    from elastrain.contracts.messages import Control

    p = PrepareParams.model_validate(
        storage_relative_prepare_paths(params().model_dump(), root, TENANT)
    )
    assert Preparation(p).run(root, lambda _: None, lambda: Control.STOP, use_ray=False) is None
    assert not (root / "data" / TENANT / "prep" / "index.json").exists()


# --- a big file in parts ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "size", "splittable", "part", "ranges"),
    [
        (TEXT, 100, True, 100, [(0, -1)]),
        (TEXT, 101, True, 100, [(0, 100), (100, 101)]),
        (JSON_LINES, 250, True, 100, [(0, 100), (100, 200), (200, 250)]),
        (JSON_LINES, 250, False, 100, [(0, -1)]),  # a JSON array: one value
        (PARQUET, 300, True, 150, [(0, 150), (150, 300)]),
        ("arrow", 300, True, 100, [(0, -1)]),  # save_to_disk: already in files
    ],
)  # fmt: skip
def test_a_file_larger_than_a_part_is_cut_in_consecutive_ranges(
    kind: str, size: int, splittable: bool, part: int, ranges: list[tuple[int, int]]
) -> None:
    whole = InputFile("data/t/x", kind, size, 1)
    parts = parts_of(whole, splittable, part)
    assert [(p.start, p.stop) for p in parts] == ranges
    assert sum(p.length for p in parts) == size
    assert len({p.key for p in parts}) == len(parts)
    assert (parts == [whole]) == (len(ranges) == 1) and whole.whole


TEXT_CASES = {  # a document is a run of non-blank lines
    "paragraphs": (
        "one\ntwo\n\nthree\n\n\n\nfour five\nsix\n \t\nseven\n",
        ["one\ntwo", "three", "four five\nsix", "seven"],
    ),
    "crlf and leading blanks": (
        "\r\n\r\n  alpha\r\nbeta\r\n\r\ngamma\r\n",
        ["  alpha\r\nbeta", "gamma"],
    ),
    "no final newline": (
        "a\n\nb b b b b b b b b b b b\nc",
        ["a", "b b b b b b b b b b b b\nc"],
    ),
    "long lines": (
        "\n\n".join("w" * n for n in (1, 50, 3, 200, 7)) + "\n",
        ["w" * n for n in (1, 50, 3, 200, 7)],
    ),
}


@pytest.mark.parametrize(("text", "expected"), TEXT_CASES.values(), ids=list(TEXT_CASES))
def test_the_parts_of_a_text_file_hold_its_paragraphs_once_in_order(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    (tmp_path / "x.txt").write_bytes(text.encode())
    whole = InputFile("x.txt", TEXT, len(text.encode()), 1)
    assert _docs(whole, tmp_path) == expected
    for part in range(1, len(text) + 1):  # every cut point, every part size
        parts = parts_of(whole, True, part)
        assert [d for p in parts for d in _docs(p, tmp_path)] == expected, part


def test_the_parts_of_json_lines_and_parquet_hold_their_rows_once_in_order(
    tmp_path: Path,
) -> None:
    rows = [f"row {i} " + "x" * (i % 13) for i in range(60)]
    lines = "".join(json.dumps({"text": r}) + ("\n\n" if i % 7 == 0 else "\n")
                    for i, r in enumerate(rows))  # fmt: skip
    (tmp_path / "x.jsonl").write_text(lines)
    pq.write_table(pa.table({"text": rows}), tmp_path / "x.parquet", row_group_size=7)
    for name, kind, sizes in (
        ("x.jsonl", JSON_LINES, range(1, len(lines) + 1, 7)),
        ("x.parquet", PARQUET, range(64, 4096, 97)),
    ):
        size = (tmp_path / name).stat().st_size
        whole = InputFile(name, kind, size, 1)
        assert _docs(whole, tmp_path) == rows
        for part in sizes:
            parts = parts_of(whole, True, part)
            assert [d for p in parts for d in _docs(p, tmp_path)] == rows, (name, part)


def _docs(source: InputFile, root: Path) -> list[str]:
    return [d for texts, _ in prepare_module.documents(source, root, "text", 5) for d in texts]


def test_a_big_file_prepared_in_parts_gives_the_same_tokens_and_resumes_by_part(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = prepare(root)
    assert whole is not None and len(whole.shards) == 4
    out = root / "data" / TENANT / "prep"
    stream = _token_stream(out, whole)
    monkeypatch.setattr(prepare_module, "PART_BYTES", 200)
    cut = prepare(root)
    assert cut is not None and len(cut.shards) > 8
    assert _token_stream(out, cut) == stream
    assert (cut.documents, cut.train_tokens, cut.eval_tokens) == (
        whole.documents, whole.train_tokens, whole.eval_tokens,
    )  # fmt: skip
    # A part lost with its attempt is the only thing prepared again.
    lost = cut.shards[3]
    (out / "shards" / f"{lost.name}.done.json").unlink()
    tokenized = record_tokenized(monkeypatch)
    assert prepare(root) == cut
    assert len(tokenized) == 1 and tokenized[0].startswith(lost.source + "@")


def _token_stream(out: Path, index: Index) -> list[int]:
    return [int(t) for s in index.shards
            for t in np.fromfile(out / s.bin_file, dtype=index.token_dtype)]  # fmt: skip


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "overrides", "message"),
    [
        ({"x.jsonl": '{"body": "hi"}\n'}, {}, "x.jsonl: row 1 has no field 'text' (it has: body)"),
        ({"x.jsonl": b'{"text": "\xff"}\n'}, {}, "x.jsonl is not UTF-8 (invalid start byte on line 1"),
        ({"x.txt": b"ok\n\xfe\xfe"}, {}, "x.txt is not UTF-8 text (invalid start byte at byte 3)"),
        ({"x.txt": ""}, {}, "x.txt holds no text (empty input)"),
        ({"x.jsonl": '{"text": 3}\n'}, {}, "row 1: 'text' is int, not text"),
        ({"x.jsonl": "{oops\n"}, {}, "x.jsonl: line 1 is not JSON"),
        ({"x.parquet": None}, {"text_field": "body"}, "x.parquet has no column 'body' (it has: text)"),
    ],
)  # fmt: skip
def test_bad_inputs_fail_with_their_reason(
    root: Path, files: dict[str, Any], overrides: dict[str, Any], message: str
) -> None:
    area = root / "data" / TENANT / "bad"
    area.mkdir()
    for name, body in files.items():
        if body is None:
            pq.write_table(pa.table({"text": ["a b c"]}), area / name)
        elif isinstance(body, bytes):
            (area / name).write_bytes(body)
        else:
            (area / name).write_text(body)
    with pytest.raises(WorkloadError) as caught:
        prepare(root, inputs=["bad/*"], **overrides)
    assert message in str(caught.value)
    assert str(caught.value).startswith("workload.params.inputs: ")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"inputs": ["in/*.tsv"]}, "workload.params.inputs.0: 'in/*.tsv' matched no file"),
        ({"inputs": ["../other/x.txt"]}, "workload.params.inputs.0: '../other/x.txt': '..'"),
        ({"inputs": ["/etc/passwd"]}, "workload.params.inputs.0: '/etc/passwd' is outside"),
        ({"inputs": ["tok"]}, "'tok' is a folder but not a save_to_disk data set"),
        ({"inputs": ["in/*.csv"], "extra": "a,b"}, "'notes.csv' is not .txt, .jsonl"),
        ({"tokenizer": "nope"}, "workload.params.tokenizer: 'nope' is not a tokenizer.json"),
        ({"out": "in"}, "workload.params.out: 'in' holds other files"),
        ({"out": "shared/x"}, "workload.params.out: 'shared/x': a folder name in your own"),
        ({"out": "../x"}, "workload.params.out: '../x': a folder name in your own"),
    ],
)
def test_submit_refuses_params_naming_the_field(
    root: Path, overrides: dict[str, Any], message: str
) -> None:
    if (extra := overrides.pop("extra", None)) is not None:
        (root / "data" / TENANT / "in" / "notes.csv").write_text(extra)
    problems = prepare_problems(params(**overrides), root, TENANT)
    assert any(message in p for p in problems), problems


def test_a_link_out_of_the_area_is_refused(root: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("secret")
    (root / "data" / TENANT / "in" / "link.txt").symlink_to(tmp_path / "secret.txt")
    problems = prepare_problems(params(inputs=["in/*.txt"]), root, TENANT)
    assert any("a match is outside your data area" in p for p in problems), problems


def test_good_params_have_no_problems(root: Path) -> None:
    assert prepare_problems(params(), root, TENANT) == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"workload": {"name": "prepare", "params": {"inputs": ["a"], "tokenizer": "t", "out": "o", "eval_fraction": 1}}},
         "eval_fraction"),
        ({"workload": {"name": "prepare", "params": {"inputs": [], "tokenizer": "t", "out": "o"}}},
         "workload.params.inputs"),
        ({"workload": {"name": "prepare", "params": {"inputs": ["a"], "out": "o"}}},
         "workload.params.tokenizer"),
        ({"workload": {"name": "prepare", "params": {"inputs": ["a"], "tokenizer": "t", "out": "o"}},
          "scaling": {"max_workers": 2}},
         "scaling.max_workers: a prepare job runs on exactly one"),
    ],
)  # fmt: skip
def test_a_prepare_spec_is_checked_at_submit(spec: dict[str, Any], message: str) -> None:
    base = {"name": "p", "scaling": {"min_workers": 1, "max_workers": 1}}
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate({**base, **spec})


def test_a_prepared_data_path_checks_at_submit(root: Path) -> None:
    prepare(root)
    folder = root / "data" / TENANT / "prep"
    assert prepared_problems(GptParams(data_path="prep", seq_len=16), "prep", folder) == []
    assert (
        "leave it out"
        in prepared_problems(
            GptParams(data_path="prep", token_dtype="uint16", vocab_size=150), "prep", folder
        )[0]
    )
    assert (
        "fewer than one window"
        in prepared_problems(GptParams(data_path="prep", seq_len=60000), "prep", folder)[0]
    )
    llama = HfCausalLmParams(data_path="prep", config={"model_type": "llama", "vocab_size": 10})
    assert (
        "smaller than the prepared data's vocabulary (150)"
        in prepared_problems(llama, "prep", folder)[0]
    )
    (folder / "index.json").unlink()
    assert "is not finished" in prepared_problems(GptParams(data_path="prep"), "prep", folder)[0]


def test_the_cli_submits_a_valid_one_worker_spec_and_prints_progress() -> None:
    from elastrain.api.cli.prepare import prepare_spec, progress_line

    spec = JobSpec.model_validate(
        prepare_spec(["a/*.jsonl"], tokenizer="tok", out="o", text_field="body", eval_fraction=0)
    )
    assert spec.workload.name == "prepare" and spec.world_sizes == [1]
    assert spec.workload.params["text_field"] == "body"
    line = progress_line(
        {"files_done": 1, "files": 4, "rows": 12345, "bytes": 3 * 2**20, "progress": 0.5,
         "tokens": 1_000_000, "tokens_per_s": 250_000.4, "eta_s": 75.0}
    )  # fmt: skip
    assert line == (
        "files 1/4  rows 12,345  3.00 MiB (50%)  tokens 1,000,000  250,000 tokens/s  ETA 1m15s"
    )
    assert progress_line({"step": 1}).endswith("ETA -")


def test_the_worker_gets_storage_relative_paths_checked_again_at_launch(root: Path) -> None:
    from elastrain.contracts.datasets import DataPathError
    from elastrain.contracts.prepared import InputError

    launched = storage_relative_prepare_paths(
        params(inputs=["in/*.jsonl", "shared/books/*.txt"]).model_dump(), root, TENANT
    )
    assert launched["inputs"] == ["data/t/in/*.jsonl", "shared/books/*.txt"]
    assert (launched["tokenizer"], launched["out"]) == ("data/t/tok", "data/t/prep")
    with pytest.raises(InputError, match=r"workload.params.inputs.0: '/etc/\*' is outside"):
        storage_relative_prepare_paths(params(inputs=["/etc/*"]).model_dump(), root, TENANT)
    with pytest.raises(DataPathError, match=r"workload\.params\.tokenizer: '/etc' is outside"):
        storage_relative_prepare_paths(params(tokenizer="/etc").model_dump(), root, TENANT)


def test_files_a_job_wrote_are_read_as_hostile_input_at_submit(root: Path) -> None:
    """index.json and state.json are written by jobs: a link there is refused, not
    followed (it could name another tenant's file), and a FIFO never blocks the API."""
    import os

    from elastrain.contracts.prepared import InputError, expand_inputs

    prepare(root)
    folder = root / "data" / TENANT / "prep"
    elsewhere = root / "elsewhere.json"
    (folder / "index.json").rename(elsewhere)
    (folder / "index.json").symlink_to(elsewhere)
    found = prepared_problems(GptParams(data_path="prep", seq_len=16), "prep", folder)
    assert found and "a link is never followed" in found[0]
    (folder / "index.json").unlink()
    os.mkfifo(folder / "index.json")
    found = prepared_problems(GptParams(data_path="prep", seq_len=16), "prep", folder)
    assert found  # refused at once: no reader waits on the FIFO's writer

    hf = root / "data" / TENANT / "hf"
    hf.mkdir()
    (hf / "state.json").symlink_to(elsewhere)
    with pytest.raises(InputError, match=r"a bad state\.json"):
        expand_inputs([f"data/{TENANT}/hf"], root)
