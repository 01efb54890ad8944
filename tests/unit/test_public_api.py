"""What users import: `import elastrain` and its public names only, loading neither torch
nor Ray until a name that needs them is used."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_public_names_are_the_implementations() -> None:
    import elastrain
    from elastrain.workers import api, user_api

    assert elastrain.Workload is api.Workload
    assert elastrain.report is user_api.report
    assert elastrain.job_dir is user_api.job_dir
    assert {"Workload", "report", "job_dir"} <= set(dir(elastrain))


def test_an_unknown_name_is_an_attribute_error() -> None:
    import elastrain

    try:
        elastrain.train  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "elastrain" in str(exc)
    else:
        raise AssertionError("elastrain.train should not exist")


def test_import_elastrain_is_light() -> None:
    probe = "import json, sys, elastrain; print(json.dumps(sorted({'torch', 'ray'} & set(sys.modules))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_report_outside_a_job_does_nothing() -> None:
    import elastrain

    elastrain.report(1, loss=0.5)  # no job: a no-op, as under plain torchrun
