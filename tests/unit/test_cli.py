"""The `elastrain` CLI against a live uvicorn server (SQLite, no scheduler)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import uvicorn
import yaml
from pydantic import SecretStr
from typer.core import TyperGroup
from typer.testing import CliRunner, Result

from elastrain.api.cli import app
from elastrain.api.main import create_app
from elastrain.contracts.storage import JobStorage
from elastrain.service.settings import Settings
from tests.factories import a_zip, spec_dict


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _serve(settings: Settings) -> Iterator[str]:
    port = _free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Settings]]:
    root = tmp_path_factory.mktemp("cli")
    settings = Settings(database_url=f"sqlite:///{root / 'db.sqlite'}", storage_path=root / "st")
    for url in _serve(settings):
        yield url, settings


@pytest.fixture
def cli(server: tuple[str, Settings]):  # type: ignore[no-untyped-def]
    url, _ = server
    runner = CliRunner()

    def invoke(*args: str):  # type: ignore[no-untyped-def]
        return runner.invoke(app, ["--url", url, *args])

    return invoke


def _submit(cli, tmp_path: Path, **overrides: object) -> int:  # type: ignore[no-untyped-def]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec_dict(**overrides)))
    result = cli("submit", str(spec_file))
    assert result.exit_code == 0, result.output
    job_id, state = result.stdout.split()
    assert state == "PENDING"
    return int(job_id)


def test_submit_yaml_then_list_status_events(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job_id = _submit(cli, tmp_path, name="cli-yaml", labels={"team": "speech"})

    listing = cli("list", "--label", "team:speech")
    assert listing.exit_code == 0, listing.output
    header, *rows = listing.stdout.strip().splitlines()
    assert header.split()[:3] == ["ID", "NAME", "STATE"]
    assert rows[0].split()[:3] == [str(job_id), "cli-yaml", "PENDING"]

    status = cli("status", str(job_id))
    assert status.exit_code == 0
    assert "cli-yaml" in status.stdout and "PENDING" in status.stdout

    events = cli("events", str(job_id))
    assert events.exit_code == 0
    assert "->PENDING" in events.stdout and "submitted" in events.stdout


def test_submit_json(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import json

    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec_dict(name="cli-json")))
    result = cli("submit", str(spec_file))
    assert result.exit_code == 0, result.output


def test_cancel_then_cancel_again_then_list_by_state(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job_id = _submit(cli, tmp_path, name="to-cancel")
    for _ in range(2):
        result = cli("cancel", str(job_id))
        assert result.exit_code == 0, result.output
        assert result.stdout.split() == [str(job_id), "CANCELLED"]
    listing = cli("list", "--state", "CANCELLED")
    assert str(job_id) in listing.stdout
    assert cli("checkpoint", str(job_id)).exit_code == 1  # 409: not running


def test_metrics_checkpoints_logs_of_a_fresh_job(cli, tmp_path: Path, server) -> None:  # type: ignore[no-untyped-def]
    job_id = _submit(cli, tmp_path)
    assert cli("metrics", str(job_id)).exit_code == 0
    assert cli("checkpoints", str(job_id)).exit_code == 0
    _, settings = server
    logs = JobStorage.of(settings.storage_path, job_id).logs
    logs.mkdir(parents=True)
    (logs / "attempt-1.rank-0.log").write_text("hello from rank 0\n")
    result = cli("logs", str(job_id))
    assert result.exit_code == 0
    assert result.stdout == "hello from rank 0\n"
    # -f returns once the job is terminal.
    assert cli("cancel", str(job_id)).exit_code == 0
    followed = cli("logs", str(job_id), "-f", "--interval", "0.1")
    assert followed.exit_code == 0
    assert followed.stdout == "hello from rank 0\n"


#: What a hostile job writes to its log for an admin's terminal: retitle it (OSC 0), write
#: the clipboard (OSC 52), clear the screen (CSI), an 8-bit CSI (C1), a bell and a NUL.
HOSTILE_LOG = (
    "step 1\tloss 2.0\n\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x1b[H\x9b31m\x00\x08done\n"
)


def test_logs_neutralise_control_sequences(cli, tmp_path: Path, server) -> None:  # type: ignore[no-untyped-def]
    job_id = _submit(cli, tmp_path)
    _, settings = server
    logs = JobStorage.of(settings.storage_path, job_id).logs
    logs.mkdir(parents=True)
    (logs / "attempt-1.rank-0.log").write_text(HOSTILE_LOG)
    shown = cli("logs", str(job_id)).stdout
    assert not any(ch in shown for ch in "\x1b\x07\x9b\x00\x08"), repr(shown)
    assert shown.startswith("step 1\tloss 2.0\n")  # newline and tab stay
    assert "\\x1b]0;pwned\\x07" in shown and "\\x1b[2J" in shown and "\\x9b31m" in shown
    assert cli("logs", str(job_id), "--raw").stdout == HOSTILE_LOG


def test_invalid_spec_exits_nonzero_naming_the_field(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump(spec_dict(scaling={"min_workers": 4, "max_workers": 2})))
    result = cli("submit", str(spec_file))
    assert result.exit_code == 1
    assert "422" in result.stderr
    assert "scaling.min_workers" in result.stderr


def test_unreadable_or_non_mapping_spec(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert cli("submit", str(tmp_path / "missing.yaml")).exit_code == 1
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    result = cli("submit", str(listy))
    assert result.exit_code == 1 and "mapping" in result.stderr


def test_unknown_job_exits_with_the_api_message(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("status", "987654")
    assert result.exit_code == 1
    assert "job 987654 not found" in result.stderr


def test_unreachable_api_exits_2() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    result = CliRunner().invoke(app, ["--url", url, "list"])
    assert result.exit_code == 2
    assert f"cannot reach the elastrain API at {url}" in result.stderr


def test_url_from_environment(server, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    url, _ = server
    result = CliRunner().invoke(app, ["list"], env={"ELASTRAIN_URL": url})
    assert result.exit_code == 0, result.output


def test_timeline_shows_each_phase_of_each_attempt(cli, tmp_path: Path, server) -> None:  # type: ignore[no-untyped-def]
    from elastrain.contracts.messages import (
        JOIN_PHASES,
        DriverReport,
        DriverStatus,
        Phase,
        Timeline,
        TimelineMark,
    )
    from elastrain.service import jobs, reports
    from elastrain.service.db import make_engine, make_session_factory, session_scope

    job_id = _submit(cli, tmp_path, name="timeline")
    marks = tuple(
        TimelineMark(phase=phase, at=1000.0 + i * 0.25, detail="peer memory at step 7" * (i == 5))
        for i, phase in enumerate(p for p in Phase if p not in JOIN_PHASES)  # no grow's
    )
    _, settings = server
    sessions = make_session_factory(make_engine(settings.database_url))
    with session_scope(sessions) as session:
        job = jobs.get_job(session, job_id, for_update=True)
        jobs.start_attempt(session, job, world_size=2, driver_name="d")
        report = DriverReport(
            status=DriverStatus.RUNNING, messages=(Timeline(cause="node lost", marks=marks),), seq=1
        )
        reports.persist_report(session, job, report)

    events = cli("events", str(job_id))
    assert "node lost -> first step in 1.50s" in events.stdout, events.stdout
    result = cli("timeline", str(job_id))
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.strip().splitlines()
    assert header.split() == ["ATTEMPT", "CAUSE", "PHASE", "SECONDS", "SINCE_START", "DETAIL"]
    assert [r.split()[3] for r in rows] == [p.value for p in Phase if p not in JOIN_PHASES]
    assert rows[-1].split()[-2:] == ["0.25", "1.50"]
    assert "peer memory at step 7" in rows[5]


def test_serve_refuses_a_public_address_without_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTRAIN_API_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert "refusing to serve on 0.0.0.0 without authentication" in result.stderr
    assert "ELASTRAIN_API_TOKEN" in result.stderr


@pytest.mark.parametrize("value", ["", "short"])
def test_serve_refuses_an_empty_or_short_token(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ELASTRAIN_API_TOKEN", value)
    result = CliRunner().invoke(app, ["serve", "--port", "1"])
    assert result.exit_code == 2
    assert "at least 16 characters" in result.stderr


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
     ("myhost", False)],
)  # fmt: skip
def test_which_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    from elastrain.api.cli.server import is_loopback

    assert is_loopback(host) is loopback


def test_stored_text_cannot_drive_the_terminal() -> None:
    from elastrain.api.cli.output import cell, printable

    assert printable("a\x1b[2Jb\x00c\u202ed") == "a\\x1b[2Jb\\x00c\\u202ed"
    assert cell("line\nbreak") == "line break"
    assert cell({"k": "\x1b]0;x\x07"}) == "k=\\x1b]0;x\\x07"


def test_tokens_and_tenants_from_the_cli(cli) -> None:  # type: ignore[no-untyped-def]
    made = cli("token", "create", "--tenant", "nlp", "--name", "ci bot")
    assert made.exit_code == 0, made.output
    token = made.stdout.strip()
    assert token.startswith("elt_") and "not shown again" in made.stderr
    listing = cli("token", "list")
    assert "nlp" in listing.stdout and "ci bot" in listing.stdout and token not in listing.stdout
    token_id = listing.stdout.strip().splitlines()[-1].split()[0]
    assert "revoked" in cli("token", "revoke", token_id).stdout
    assert cli("token", "revoke", "999999").exit_code == 1
    quota = cli("tenant", "set", "nlp", "--max-workers", "4")
    assert quota.exit_code == 0 and "nlp" in quota.stdout and "4" in quota.stdout
    assert cli("tenant", "set", "nlp").exit_code == 2  # neither --max-workers nor --no-quota
    assert "nlp" in cli("tenant", "list").stdout
    assert "authentication is off" in cli("whoami").stdout


def test_goodput_line() -> None:
    from elastrain.api.cli.client import goodput_line

    split = {"wall_s": 200.0, "training_s": 150.0, "queued_s": 10.0, "recovering_s": 40.0,
             "recomputed_s": 0.0, "starting_s": 0.0, "resizing_s": 0.0,
             "checkpoint_stall_s": 0.02, "other_s": 0.0, "goodput": 0.75}  # fmt: skip
    assert goodput_line(split) == "75% of 3m20s: training 2m30s, queued 10.0s, recovering 40.0s"
    assert goodput_line(None) == "-"


def test_connection_options_after_the_command(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`elastrain submit job.yaml --url URL`, as kubectl and gh take theirs; given both
    before and after the command, or in the environment, the one after wins."""
    url, _ = server
    dead = f"http://127.0.0.1:{_free_port()}"
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec_dict(name="url-after")))
    runner = CliRunner()

    submitted = runner.invoke(app, ["submit", str(spec_file), "--url", url])
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.stdout.split()[0]
    assert "url-after" in runner.invoke(app, ["status", job_id, f"--url={url}"]).stdout
    assert runner.invoke(app, ["--url", dead, "list", "--url", url]).exit_code == 0
    assert runner.invoke(app, ["list", "--url", url], env={"ELASTRAIN_URL": dead}).exit_code == 0
    assert runner.invoke(app, ["--url", url, "list", "--url", dead]).exit_code == 2
    made = runner.invoke(app, ["token", "create", "--tenant", "t", "--url", url, "--token", "x"])
    assert made.exit_code == 0, made.output
    # Commands that speak no REST still refuse them.
    served = runner.invoke(app, ["serve", "--port", "1", "--url", url])
    assert served.exit_code == 2 and "No such option" in served.output


DIGEST = "sha256:" + "ab" * 32
#: Every REST command with arguments it accepts (what the server answers does not matter
#: here, only whom it asks and with which token). `{spec}`: a job spec file.
REST_COMMANDS: dict[str, list[str]] = {
    "submit": ["{spec}"], "list": [], "status": ["1"], "events": ["1"], "timeline": ["1"],
    "metrics": ["1"], "checkpoints": ["1"], "cancel": ["1"], "checkpoint": ["1"],
    "logs": ["1"], "plan": ["{spec}"], "whoami": [], "cluster": [],
    "drain": ["abcdef123456"], "undrain": ["abcdef123456"],
    "token create": ["--tenant", "t"], "token list": [], "token revoke": ["999"],
    "tenant list": [], "tenant set": ["t", "--max-workers", "2"],
    "packages show": [DIGEST], "packages share": [DIGEST, "--tenant", "t"],
    "packages unshare": [DIGEST, "--tenant", "t"],
    "export": ["1", "--out", "{spec}.model"],
    "prepare": ["in/*.jsonl", "--tokenizer", "tok", "--out", "prep", "--no-wait"],
}  # fmt: skip


def _command_names(command: Any, prefix: str = "") -> set[str]:
    if not isinstance(command, TyperGroup):
        return {prefix}
    return set().union(
        *(_command_names(sub, f"{prefix} {name}".strip()) for name, sub in command.commands.items())
    )


def test_every_rest_command_is_in_the_table() -> None:
    from elastrain.api.cli import OFFLINE_COMMANDS

    assert _command_names(typer.main.get_command(app)) - OFFLINE_COMMANDS == set(REST_COMMANDS)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second server that needs ADMIN's token."""
    root = tmp_path_factory.mktemp("cli-secured")
    settings = Settings(
        database_url=f"sqlite:///{root / 'db.sqlite'}",
        storage_path=root / "st",
        api_token=SecretStr(ADMIN),
    )
    yield from _serve(settings)


ADMIN = "cli-admin-token-0123456789abcdef"


@pytest.mark.parametrize("command", sorted(REST_COMMANDS))
def test_connection_options_before_or_after_every_command(
    command: str, secured: str, tmp_path: Path
) -> None:
    """Every REST command takes `--url` and `--token` before its name or after it; given
    in both places (or in the environment too) the one after the command wins."""
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec_dict(name="anywhere")))
    args = [
        *command.split(),
        *(a.replace("{spec}", str(spec_file)) for a in REST_COMMANDS[command]),
    ]
    dead = f"http://127.0.0.1:{_free_port()}"
    runner = CliRunner()

    def asks(result: Result) -> str:
        """Whom the command asked: the dead server, or the secured one (and whether its
        token was refused)."""
        if f"cannot reach the elastrain API at {dead}" in result.stderr:
            return "dead"
        assert result.exception is None or isinstance(result.exception, SystemExit), result
        return "refused" if "error 401" in result.stderr else "secured"

    # --url: before, after, both (after wins), and over the environment.
    assert asks(runner.invoke(app, ["--url", dead, "--token", ADMIN, *args])) == "dead"
    assert asks(runner.invoke(app, [*args, "--url", dead])) == "dead"
    assert asks(runner.invoke(app, [*args, "--url", secured, "--token", ADMIN],
                              env={"ELASTRAIN_URL": dead})) == "secured"  # fmt: skip
    assert asks(runner.invoke(app, ["--url", dead, *args, "--url", secured,
                                    "--token", ADMIN])) == "secured"  # fmt: skip
    assert asks(runner.invoke(app, ["--url", secured, *args, "--url", dead])) == "dead"
    # --token likewise: the secured server refuses a wrong one.
    url = ["--url", secured]
    assert asks(runner.invoke(app, [*url, "--token", ADMIN, *args])) == "secured"
    assert asks(runner.invoke(app, [*url, *args, "--token", ADMIN])) == "secured"
    assert asks(runner.invoke(app, [*url, "--token", "wrong", *args, "--token", ADMIN])) == (
        "secured"
    )
    assert asks(runner.invoke(app, [*url, "--token", ADMIN, *args, "--token", "wrong"])) == (
        "refused"
    )
    assert asks(runner.invoke(app, [*args, "--token", ADMIN], env={
        "ELASTRAIN_URL": secured, "ELASTRAIN_TOKEN": "wrong"})) == "secured"  # fmt: skip
    assert asks(runner.invoke(app, [*args], env={"ELASTRAIN_URL": secured})) == "refused"


def test_connection_options_after_the_command_are_in_its_help() -> None:
    shown = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "200"})
    assert "--url" in shown.stdout and "--token" in shown.stdout
    assert "--url" not in CliRunner().invoke(app, ["serve", "--help"]).stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["logs", "1", "--", "--url", "U"], "Got unexpected extra argument"),  # -- ends options
        (["list", "--url"], "requires an argument"),  # no value: the command says so
        (["serve", "--url", "U"], "No such option"),  # no REST: refused as before
        (["prepare-text", "a", "b", "--token", "T"], "No such option"),
    ],
)
def test_connection_options_that_stay_errors(args: list[str], words: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and words in result.output, result.output


def test_drain_cluster_undrain_from_the_cli(server) -> None:  # type: ignore[no-untyped-def]
    url, settings = server
    node = "e5" * 28
    from elastrain.service import cluster as cluster_view
    from elastrain.service.db import make_engine, make_session_factory, session_scope

    engine = make_engine(settings.database_url)
    try:
        view = cluster_view.ClusterView(connected=True, nodes=[cluster_view.NodeView(
            node_id=node, address="10.0.0.7", alive=True, cpus_total=4, cpus_free=3,
            gpus_total=0, gpus_free=0, jobs=[7],
        ), cluster_view.NodeView(
            node_id="a1" * 28, address="10.0.0.8", alive=True, cpus_total=4, cpus_free=4,
            gpus_total=0, gpus_free=0, warming=True,
        )])  # fmt: skip
        with session_scope(make_session_factory(engine)) as s:
            cluster_view.publish(s, view)
    finally:
        engine.dispose()
    runner = CliRunner()
    # The connection options after the command, as for every other command.
    drained = runner.invoke(
        app, ["drain", node[:10], "--deadline", "300", "--reason", "kernel upgrade", "--url", url]
    )
    assert drained.exit_code == 0, drained.output
    assert drained.stdout.startswith(f"{node[:12]}\tdraining, deadline ")
    shown = runner.invoke(app, ["cluster", "--url", url])
    assert shown.exit_code == 0, shown.output
    header, row, joined = shown.stdout.strip().splitlines()
    assert header.split() == ["NODE", "ADDRESS", "STATE", "CPUS", "GPUS", "JOBS", "DRAIN"]
    assert row.split()[:6] == [node[:12], "10.0.0.7", "draining", "3/4", "0/0", "7"]
    # Just joined, its worker processes still starting: jobs grow onto it once they are up.
    assert joined.split()[:3] == ["a1" * 6, "10.0.0.8", "warming"]
    assert "admin: kernel upgrade, deadline in 4m5" in row
    undrained = runner.invoke(app, ["undrain", node, "--url", url])
    assert undrained.exit_code == 0 and "undrained" in undrained.stdout
    again = runner.invoke(app, ["undrain", node, "--url", url])
    assert again.exit_code == 1 and "not drained" in again.output
    unknown = runner.invoke(app, ["drain", "f" * 56, "--url", url])
    assert unknown.exit_code == 1 and "error 404" in unknown.output


def test_packages_show_share_and_unshare(secured: str) -> None:
    """An admin shares team-a's package with team-b and takes the share back; team-b sees
    it only in between; team-a's own access stays; non-admins cannot share."""
    runner = CliRunner()
    admin = ["--url", secured, "--token", ADMIN]
    tokens = {}
    for tenant in ("cli-a", "cli-b"):
        made = runner.invoke(app, [*admin, "token", "create", "--tenant", tenant])
        assert made.exit_code == 0, made.output
        tokens[tenant] = made.stdout.strip()
    upload = httpx.post(
        f"{secured}/v1/packages",
        content=a_zip({"shared_model.py": "def build(): ...\n"}),
        headers={"Content-Type": "application/zip", "Authorization": f"Bearer {tokens['cli-a']}"},
    )
    assert upload.status_code == 201, upload.text
    digest = upload.json()["digest"]

    def show(tenant: str) -> Result:
        return runner.invoke(app, ["packages", "show", digest, "--url", secured,
                                   "--token", tokens[tenant]])  # fmt: skip

    assert show("cli-a").exit_code == 0 and "shared_model.py" in show("cli-a").stdout
    assert "who may use it" not in show("cli-a").stdout  # grants: admins only
    hidden = show("cli-b")
    assert hidden.exit_code == 1 and f"error 404: no package {digest}" in hidden.stderr

    refused = runner.invoke(app, ["packages", "share", digest, "--tenant", "cli-b",
                                  "--url", secured, "--token", tokens["cli-a"]])  # fmt: skip
    assert refused.exit_code == 1 and "error 403" in refused.stderr

    shared = runner.invoke(app, [*admin, "packages", "share", digest, "--tenant", "cli-b"])
    assert shared.exit_code == 0, shared.output
    assert f"{digest}\tshared with cli-b" in shared.stderr
    grants = {line.split()[0]: line.split()[1:3] for line in shared.stdout.splitlines()[1:]}
    assert grants == {"cli-a": ["yes", "cli-a"], "cli-b": ["no", "default"]}
    assert show("cli-b").exit_code == 0
    shown = runner.invoke(app, [*admin, "packages", "show", digest])
    assert "who may use it:" in shown.stdout and "cli-b" in shown.stdout

    bad = runner.invoke(app, [*admin, "packages", "share", digest, "--tenant", "bad name"])
    assert bad.exit_code == 1 and "error 422" in bad.stderr and "tenant" in bad.stderr

    withdrawn = runner.invoke(app, [*admin, "packages", "unshare", digest, "--tenant", "cli-b"])
    assert withdrawn.exit_code == 0, withdrawn.output
    assert "no longer shared with cli-b" in withdrawn.stderr
    assert "cli-b" not in withdrawn.stdout and "cli-a" in withdrawn.stdout
    assert show("cli-b").exit_code == 1
    assert show("cli-a").exit_code == 0  # the uploader's own access stays

    everyone = runner.invoke(app, [*admin, "packages", "share", digest, "--tenant", "*"])
    assert everyone.exit_code == 0 and show("cli-b").exit_code == 0
    assert (
        runner.invoke(app, [*admin, "packages", "unshare", digest, "--tenant", "*"]).exit_code == 0
    )
    assert show("cli-b").exit_code == 1


def test_the_example_command_job_submits_as_the_readme_says(cli) -> None:  # type: ignore[no-untyped-def]
    """`elastrain submit examples/torchrun.yaml --working-dir examples/torchrun` (README,
    "Bring your own script"): the folder is uploaded and the command shown by status."""
    repo = Path(__file__).resolve().parents[2]
    result = cli("submit", str(repo / "examples" / "torchrun.yaml"), "--working-dir",
                 str(repo / "examples" / "torchrun"))  # fmt: skip
    assert result.exit_code == 0, result.output
    job_id = result.stdout.split()[0]
    status = cli("status", job_id)
    assert status.exit_code == 0, status.output
    assert "python train.py --steps 300" in status.stdout
    assert "package:          sha256:" in status.stdout
