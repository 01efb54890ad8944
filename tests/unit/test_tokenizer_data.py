"""A Hugging Face tokenizer for the gpt's and hf_causal_lm's text (`workload.params.tokenizer`):
a tokenizer trained here (nothing downloaded) is checked at submit, tokenizes the text on
the worker with the vocabulary its own, and a gpt trains on it with falling loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from elastrain.contracts.datasets import data_path_problems, tokenizer_vocab_size
from elastrain.contracts.spec import WorkloadSpec
from elastrain.contracts.workload_params import GptParams, HfCausalLmParams
from elastrain.workers.workloads import WorkloadError, load_workload

TENANT = "t"
TEXT = "the quick brown fox jumps over the lazy dog.\nthe dog sleeps; the fox runs on.\n" * 120


@pytest.fixture
def area(tmp_path: Path) -> Path:
    """A tenant's data area holding `corpus.txt` and `tok/tokenizer.json` (a small byte-level BPE)."""
    area = tmp_path / "storage" / "data" / TENANT
    (area / "tok").mkdir(parents=True)
    (area / "corpus.txt").write_text(TEXT)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        [TEXT], trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "[EOS]"])
    )
    tok.save(str(area / "tok" / "tokenizer.json"))
    return area


def _problems(area: Path, workload: type[GptParams | HfCausalLmParams], **params: Any) -> list[str]:
    base = {"seq_len": 16, "data_path": "corpus.txt", "tokenizer": "tok"}
    return data_path_problems(
        workload.model_validate({**base, **params}), area.parent.parent, TENANT
    )


def test_the_vocabulary_is_read_from_the_file_as_json(area: Path) -> None:
    data = (area / "tok" / "tokenizer.json").read_bytes()
    expected = Tokenizer.from_file(str(area / "tok" / "tokenizer.json")).get_vocab_size()
    assert tokenizer_vocab_size(data) == expected
    with pytest.raises(ValueError, match=r"no model\.vocab"):
        tokenizer_vocab_size(json.dumps({"model": {}}).encode())


def test_a_good_tokenizer_has_no_problems(area: Path) -> None:
    assert _problems(area, GptParams) == []
    assert _problems(area, GptParams, tokenizer="tok/tokenizer.json") == []  # the file itself
    llama = {"model_type": "llama", "vocab_size": 128}
    assert _problems(area, HfCausalLmParams, config=llama) == []


@pytest.mark.parametrize(
    ("workload", "params", "message"),
    [
        (GptParams, {"tokenizer": "nope"}, "workload.params.tokenizer: 'nope' is not a tokenizer.json"),
        (GptParams, {"tokenizer": "corpus.txt"}, "workload.params.tokenizer: 'corpus.txt' is not a Hugging Face"),
        (GptParams, {"tokenizer": "../../x"}, "workload.params.tokenizer: '../../x': '..' is not allowed"),
        (
            HfCausalLmParams,
            {"config": {"model_type": "llama", "vocab_size": 40}},
            "workload.params.config.vocab_size (40) is smaller than the tokenizer's vocabulary (",
        ),
    ],
)  # fmt: skip
def test_bad_tokenizers_are_problems_naming_the_field(
    area: Path, workload: type[GptParams | HfCausalLmParams], params: dict[str, Any], message: str
) -> None:
    problems = _problems(area, workload, **params)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "params",
    [
        {"tokenizer": "tok"},  # the bundled corpus is characters
        {"tokenizer": "tok", "data_path": "d.bin", "token_dtype": "uint16", "vocab_size": 9},
    ],
)
def test_a_tokenizer_only_with_a_text_data_path(params: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"workload\.params\.tokenizer: only with a text"):
        WorkloadSpec.model_validate({"name": "gpt", "params": params})


def _gpt(area: Path, **params: Any) -> Any:
    spec = WorkloadSpec.model_validate(
        {
            "name": "gpt",
            "params": {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, **params},
        }
    )
    return load_workload(spec, storage_root=area)


def test_the_worker_tokenizes_the_text_and_the_vocabulary_is_the_tokenizers(area: Path) -> None:
    w = _gpt(area, data_path="corpus.txt", tokenizer="tok")
    tok = Tokenizer.from_file(str(area / "tok" / "tokenizer.json"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert w.model.tok_emb.num_embeddings == tok.get_vocab_size() > 40
    x, y = w.dataset[0]
    assert x.tolist() == ids[:16] and y.tolist() == ids[1:17]
    held = int(len(ids) * 0.1 + 0.999)
    assert len(w.dataset) == (len(ids) - held - 17) // 17 + 1  # the end held out, as for text

    # It trains: the loss falls over a few steps on one process.
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=3e-3)
    batch = [w.dataset[i] for i in range(8)]
    xs, ys = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    losses = []
    for _ in range(15):
        loss = w.loss_fn(w.model(xs), ys)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_a_broken_tokenizer_file_is_a_configuration_error(area: Path) -> None:
    (area / "tok" / "tokenizer.json").write_text('{"model": "broken"}')
    with pytest.raises(WorkloadError, match=r"workload.params.tokenizer: cannot load"):
        _gpt(area, data_path="corpus.txt", tokenizer="tok")


def test_a_link_in_the_tokenizer_folder_is_resolved_then_confined(area: Path) -> None:
    theirs = area.parent / "other" / "tok"
    theirs.mkdir(parents=True)
    (area / "tok" / "tokenizer.json").rename(theirs / "tokenizer.json")
    (area / "tok" / "tokenizer.json").symlink_to(theirs / "tokenizer.json")
    problems = _problems(area, GptParams)
    assert problems and "tokenizer.json" in problems[0] and "outside" in problems[0], problems
