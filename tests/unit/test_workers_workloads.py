"""Built-in workloads: deterministic data, pipeline stages that keep parameter names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from elastrain.contracts.spec import BUILTIN_WORKLOADS, WorkloadSpec
from elastrain.workers.api import Workload
from elastrain.workers.workloads import WorkloadError, load_workload, stage_block_range

TINY = {
    "gpt": {"n_layer": 3, "n_embd": 16, "n_head": 2, "seq_len": 8},
    "synthetic": {"num_samples": 64, "n_layer": 3},
}


def _batch(workload: Workload, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [workload.dataset[i] for i in range(n)]
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


@pytest.mark.parametrize("name", ["gpt", "synthetic"])
def test_builtin_is_deterministic(name: str) -> None:
    """The samples belong to the workload (its params), not to the random state it is built
    in: jobs that differ only in `training.seed`, which the loop seeds everything with
    before building, train on the same data. The model's first weights do follow that
    seed, the same on every rank."""
    torch.manual_seed(0)
    a = load_workload(WorkloadSpec(name=name, params=TINY[name]))
    torch.manual_seed(1)
    b = load_workload(WorkloadSpec(name=name, params=TINY[name]))
    torch.manual_seed(0)
    c = load_workload(WorkloadSpec(name=name, params=TINY[name]))
    assert len(a.dataset) == len(b.dataset) > 0
    for i in (0, len(a.dataset) - 1):
        assert all(torch.equal(u, v) for u, v in zip(a.dataset[i], b.dataset[i], strict=True))
    assert all(
        torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True)
    )
    assert a.flops_per_sample and a.flops_per_sample > 0


def test_gpt_windows_are_next_token_pairs() -> None:
    w = load_workload(WorkloadSpec(name="gpt", params=TINY["gpt"]))
    x, y = w.dataset[3]
    assert x.shape == y.shape == (8,)
    assert torch.equal(x[1:], y[:-1])
    assert w.tokens_per_sample == 8
    logits = w.model(x[None])
    assert logits.shape == (1, 8, 65)  # 65 distinct characters in Tiny Shakespeare


@pytest.mark.parametrize("name", ["gpt", "synthetic"])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_stages_compose_and_keep_names(name: str, num_stages: int) -> None:
    torch.manual_seed(0)
    w = load_workload(WorkloadSpec(name=name, params=TINY[name]))
    x, _ = _batch(w)
    full_out = w.model(x)
    full_names = set(w.model.state_dict())
    stages = [w.model.pipeline_stage(i, num_stages) for i in range(num_stages)]
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, full_out)
    names = [set(stage.state_dict()) for stage in stages]
    assert set().union(*names) == full_names  # same FQNs, so checkpoints load across splits
    assert sum(map(len, names)) == len(full_names)  # and no parameter in two stages


def test_shard_units_are_the_blocks() -> None:
    w = load_workload(WorkloadSpec(name="gpt", params=TINY["gpt"]))
    assert w.model.shard_units() == list(w.model.blocks.values())


def test_stage_block_range() -> None:
    assert [stage_block_range(5, i, 3) for i in range(3)] == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="cannot split"):
        stage_block_range(2, 0, 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "nope"}, "unknown built-in"),
        ({"name": "gpt", "entrypoint": "a:b"}, "exactly one"),
        ({"entrypoint": "no_such_module_xyz:f"}, "cannot import module"),
        ({"entrypoint": f"{__name__}:missing"}, "no callable 'missing'"),
        ({"entrypoint": f"{__name__}:two_args"}, "do not fit"),
        ({"name": "synthetic", "params": {"bogus": 1}}, "workload.params.bogus: unknown"),
        ({"entrypoint": f"{__name__}:synthetic_factory", "params": {"bogus": 1}}, "do not fit"),
        ({"entrypoint": f"{__name__}:not_a_workload"}, "expected elastrain.workers.api.Workload"),
        # Built-ins by name only: their module's functions skip the checks the name gets.
        ({"entrypoint": "elastrain.workers.workloads.gpt:load_corpus"}, "elastrain's own"),
        ({"entrypoint": "elastrain.workers.workloads.synthetic:build"}, "elastrain's own"),
        ({"entrypoint": f"{__name__}:_private_helper"}, "'_private_helper' is private"),
    ],
)
def test_load_workload_errors_name_the_field(spec: dict, message: str) -> None:
    # The spec's own checks (unknown name, both sources) fail as it is validated, before a
    # worker sees it; the rest when the worker loads the workload.
    with pytest.raises((ValidationError, WorkloadError), match=message):
        load_workload(WorkloadSpec.model_validate(spec))


def synthetic_factory(num_samples: int = 8) -> Workload:
    """A user's factory (the synthetic workload under another name)."""
    from elastrain.contracts.workload_params import SyntheticParams
    from elastrain.workers.workloads.synthetic import build

    return build(SyntheticParams(num_samples=num_samples))


def two_args(a: int, b: int) -> Workload:
    raise AssertionError("never called: the params do not fit")


def not_a_workload() -> int:
    return 3


def _private_helper() -> Workload:
    raise AssertionError("never called: private")


def refusing_factory(size: int = 1) -> Workload:
    """A user's factory that refuses its params with an ordinary exception."""
    raise KeyError(f"no model of size {size}")


def test_a_factory_that_raises_while_building_is_a_configuration_error() -> None:
    # Not retried (the scheduler fails the job at once on a WorkloadError), and the job's
    # failure says what the factory said.
    spec = WorkloadSpec(entrypoint=f"{__name__}:refusing_factory", params={"size": 7})
    with pytest.raises(WorkloadError, match=r"refusing_factory raised KeyError .*size 7"):
        load_workload(spec)


def test_a_module_that_raises_on_import_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "needs_a_config.py").write_text('raise RuntimeError("no config.toml")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError, match=r"importing module 'needs_a_config' raised "
                       r"RuntimeError: no config.toml"):  # fmt: skip
        load_workload(WorkloadSpec(entrypoint="needs_a_config:build"))


def test_custom_entrypoint() -> None:
    w = load_workload(
        WorkloadSpec(entrypoint=f"{__name__}:synthetic_factory", params={"num_samples": 8})
    )
    assert len(w.dataset) == 8


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_a_builtin_factory_takes_its_typed_params(name: str) -> None:
    """A built-in's factory takes the very model elastrain.contracts.workload_params checks
    at submit (its fields and defaults, written once): what passes there builds here."""
    import inspect
    import typing

    from elastrain.contracts.workload_params import BUILTIN_PARAMS
    from elastrain.workers.workloads import resolve_entrypoint

    factory = resolve_entrypoint(BUILTIN_WORKLOADS[name])
    assert list(inspect.signature(factory).parameters) == ["params"]
    assert typing.get_type_hints(factory)["params"] is BUILTIN_PARAMS[name]


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "gpt",
            {"n_layer": 0},
            "workload.params.n_layer: Input should be greater than or equal to 1",
        ),
        ("synthetic", {"bogus": 1}, "workload.params.bogus: unknown parameter of 'synthetic'"),
        ("gpt", {"n_embd": 130}, r"workload.params.n_embd \(130\) must be divisible by"),
    ],
)
def test_a_stored_builtins_params_are_checked_again_on_the_worker(
    name: str, params: dict[str, Any], message: str
) -> None:
    """A spec stored before its params were checked at submit (model_construct skips the
    checks, as a row read back from an older service would have)."""
    spec = WorkloadSpec.model_construct(name=name, entrypoint=None, params=params)
    with pytest.raises(WorkloadError, match=message):
        load_workload(spec)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"n_layer": 0}, "workload.params.n_layer: Input should be greater than or equal to 1"),
        ({"n_layer": "4"}, "workload.params.n_layer: Input should be a valid integer"),
        ({"seq_len": -1}, "workload.params.seq_len"),
        ({"dropout": 1.5}, "workload.params.dropout"),
        (
            {"n_embd": 130},
            "workload.params.n_embd (130) must be divisible by workload.params.n_head (4)",
        ),
        ({"bogus": 1}, "workload.params.bogus: unknown parameter of 'gpt'; allowed: n_layer,"),
    ],
)
def test_gpt_params_are_checked_at_submit(params: dict, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        WorkloadSpec.model_validate({"name": "gpt", "params": params})
    assert message in str(caught.value)


def test_gpt_model_flops_count_attention() -> None:
    """6·N per token plus 12·L·d·T per token (nanoGPT's and torchtitan's count)."""
    from elastrain.contracts.workload_params import GptParams
    from elastrain.workers.workloads.gpt import build

    w = build(GptParams(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    n = sum(p.numel() for p in w.model.parameters())
    assert w.flops_per_sample == 16 * (6 * n + 12 * 2 * 32 * 16)
