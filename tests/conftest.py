"""Shared fixtures: the real third-party rows under ../shared/fixtures (skipped when absent), the
tokenizers, the tiny targets, copies of runs, and the runs of the embedded default.

`make test` (plain `pytest`) runs every test; for a fast loop leave out the slow ones (each over
~10 s on a 2-core machine, or behind a fixture that is):
    pytest -m "not slow"
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Property tests draw the same examples on every run, so CI is never red by the luck of the draw;
# HYPOTHESIS_PROFILE=explore draws new ones (run it locally to look for new failures). No
# per-example deadline: on a loaded 2-core machine a 200 ms example took 451 ms and failed.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("deterministic", derandomize=True, database=None,
                                          deadline=None)
    _hypothesis_settings.register_profile("explore", derandomize=False, deadline=None)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
except ImportError:  # hypothesis is a dev dependency; its tests skip without it
    pass

# The repository is <root>/main (or any checkout name); fixtures live next to it in
# <root>/shared/fixtures, locally and in CI.
FIXTURES_DIR = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
REPO_ROOT = Path(__file__).resolve().parents[1]


def require_fixtures_dir() -> Path:
    """The fixtures folder, or a skip that says where it was expected."""
    if not (FIXTURES_DIR / "data").is_dir():
        pytest.skip(
            f"real fixture rows not found at {FIXTURES_DIR / 'data'} "
            "(expected ../shared/fixtures next to the repository)"
        )
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """../shared/fixtures; tests using it skip with a clear reason when it is absent."""
    return require_fixtures_dir()


@pytest.fixture(scope="session")
def fixture_data(fixtures_dir: Path) -> Path:
    """../shared/fixtures/data: real conversation rows in every supported format."""
    return fixtures_dir / "data"


@pytest.fixture(scope="session")
def tok():
    """The Qwen3.6 tokenizer (../shared/fixtures/qwen36-tokenizer) and its strict chat template."""
    from templates_helpers import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def project_tok():
    """The project's own small tokenizer (data/tokenizer), the embedded default's."""
    pytest.importorskip("transformers")
    from dflash_etl.models.tokenizer import load_tokenizer

    return load_tokenizer(str(REPO_ROOT / "data" / "tokenizer"))


# ---------------------------------------------------------------- tiny targets: built once per
# session and shared, so a test that changes a target's files changes a copy.
@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Callable[..., Path]:
    """build_tiny_qwen2 with the given keywords, built on first use and reused for the same
    keywords (in `<hash of the keywords>/model`)."""
    pytest.importorskip("torch")
    from dflash_etl.models.tiny_model import build_tiny_qwen2

    root = tmp_path_factory.mktemp("tiny-targets")

    def build(**spec: object) -> Path:
        key = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()
        return build_tiny_qwen2(root / key[:16] / "model", **spec)

    return build


@pytest.fixture(scope="session")
def tiny_target(tiny_qwen2) -> Path:
    """The extract tests' target: 4 layers of hidden 64, tied head, the project's tokenizer."""
    return tiny_qwen2()


@pytest.fixture(scope="session")
def untied_target(tiny_qwen2) -> Path:
    """tiny_target with an untied head: its greedy replies vary, which a drafter learns from."""
    return tiny_qwen2(tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_model(tiny_qwen2) -> Path:
    """The smallest generator (2 layers of hidden 32, 2 heads): real, meaningless text, fast."""
    return tiny_qwen2(hidden_size=32, layers=2, heads=2, kv_heads=1)


# ---------------------------------------------------------------- copies of runs
@pytest.fixture()
def dev_servers() -> Iterator[Callable[..., list]]:
    """Dev servers (models/devserver.py) on 127.0.0.1: `start(n, model=None, **kw)` starts n
    (no model: `--instant` replies; kw: DevServer's, e.g. extract_layers and states_dir for
    hidden-states servers), all stopped at the end; a test kills, stops or slows them."""
    from dflash_etl.models.devserver import DevServer

    started: list[DevServer] = []

    def start(n: int = 1, model: str | None = None, **kw: Any) -> list[DevServer]:
        new = [DevServer(model, instant=model is None, **kw).start() for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for srv in started:
        srv.stop()


def _copy_run(source: Path, into: Path, *skip: str) -> Path:
    """`source` copied to `into/<its name>` without the files and folders matching `skip` (glob
    patterns, e.g. "*extract*" for a stage's outputs, to run that stage again)."""
    out = into / source.name
    shutil.copytree(source, out, ignore=shutil.ignore_patterns(*skip))
    return out


@pytest.fixture(scope="session")
def copy_run() -> Callable[..., Path]:
    """_copy_run: a test changes its own copy of a shared run, never the run itself."""
    return _copy_run


@pytest.fixture
def ingest_rows(tmp_path) -> Callable[[list[dict], str], Path]:
    """Rows written as one JSONL source called `name` and ingested by one worker into
    tmp_path/run: a small run of the test's own."""
    from dflash_etl.stages import ingest, load_config

    def run(rows: list[dict], name: str) -> Path:
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / "pipeline.toml").write_text(
            f'[[sources]]\nname = "{name}"\npath = "rows.jsonl"\n')
        run_dir = tmp_path / "run"
        ingest.run(load_config(tmp_path / "pipeline.toml"), run_dir, progress=False, workers=1)
        return run_dir

    return run


# ---------------------------------------------------------------- runs shared by the CLI, suite
# and report tests: one real run of the embedded default per session (great_expectations' import
# alone takes minutes on a slow machine; each extra process pays it again).
_DEFAULT_RUN: dict[str, object] = {}


def _start_default_run() -> None:
    """Start `python -m dflash_etl run` in the background in a fresh working directory: it runs
    on the second core while the in-process tests run (it takes minutes on a slow machine)."""
    cwd = Path(tempfile.mkdtemp(prefix="dflash-default-run-"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    stdout, stderr = open(cwd / "stdout.txt", "w+"), open(cwd / "stderr.txt", "w+")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "dflash_etl", "run"], cwd=cwd, env=env, stdout=stdout,
        stderr=stderr, text=True,
    )
    _DEFAULT_RUN.update(cwd=cwd, process=process, stdout=stdout, stderr=stderr, env=env)


def _uses_default_run(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return "default_cli_run" in names or "default_run_dir_later" in names


def _in_browser_module(item: pytest.Item) -> bool:
    return item.path.name == "test_report_browser.py"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so the marks made here count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the default run are slow (they wait for it) and go last, so the background run
    has time to finish; the browser tests stay together among them, so one Chromium serves them
    all."""
    for item in items:
        if _uses_default_run(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: (_uses_default_run(item) or _in_browser_module(item),
                                 _in_browser_module(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    wanted = any(_uses_default_run(item) for item in session.items)
    if wanted and not os.environ.get("DFLASH_TEST_DEFAULT_RUN") and not _DEFAULT_RUN:
        _start_default_run()


# ---------------------------------------------------------------- test time, kept in view
DURATIONS_FILE = REPO_ROOT / "build" / "test-durations.txt"  # CI prints it (.ci/run)
_TIMES: dict[str, float] = {}
_SESSION: dict[str, float] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION["start"] = time.perf_counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's seconds: its setup (a session fixture it is the first to ask for), call and
    teardown."""
    _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration


def _write_durations(session: pytest.Session, slowest: int = 40) -> None:
    """build/test-durations.txt: the session's wall time, its tests and the slowest of them."""
    wall = time.perf_counter() - _SESSION.get("start", time.perf_counter())
    ranked = sorted(_TIMES.items(), key=lambda kv: -kv[1])
    marks = {item.nodeid: item.get_closest_marker("slow") is not None for item in session.items}
    lines = [f"{len(_TIMES)} tests in {wall:.0f} s wall ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} cores, 1-min load {os.getloadavg()[0]:.1f} at the end); "
             f"{sum(_TIMES.values()):.0f} s in the tests themselves", "",
             f"the {min(slowest, len(ranked))} slowest (setup + call + teardown):"]
    lines += [f"{seconds:8.1f} s  {'slow ' if marks.get(node) else '     '}{node}"
              for node, seconds in ranked[:slowest]]
    DURATIONS_FILE.parent.mkdir(exist_ok=True)
    DURATIONS_FILE.write_text("\n".join(lines) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _TIMES:
        _write_durations(session)
    process = _DEFAULT_RUN.get("process")
    if isinstance(process, subprocess.Popen) and process.poll() is None:
        process.kill()
    for key in ("stdout", "stderr"):
        if key in _DEFAULT_RUN:
            _DEFAULT_RUN[key].close()  # type: ignore[attr-defined]
    if "cwd" in _DEFAULT_RUN:
        shutil.rmtree(_DEFAULT_RUN["cwd"], ignore_errors=True)


@pytest.fixture(scope="session")
def default_cli_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`python -m dflash_etl run` exactly as the README's `make run` calls it (default config,
    default workers, its gates and report), once per session in a fresh working directory,
    started in the background as soon as collection finishes.

    DFLASH_TEST_DEFAULT_RUN=DIR reuses a copy of such a run (for iterating on the tests; the
    run takes minutes on a slow machine)."""
    if os.environ.get("DFLASH_TEST_DEFAULT_RUN"):
        cwd = tmp_path_factory.mktemp("cwd")
        run = cwd / "runs" / "default"
        shutil.copytree(os.environ["DFLASH_TEST_DEFAULT_RUN"], run)
        out = f"ingest done\n{run / 'ingest' / 'conversations'}"
        return cwd, subprocess.CompletedProcess([], 0, out, "")
    if not _DEFAULT_RUN:
        _start_default_run()
    process = _DEFAULT_RUN["process"]
    assert isinstance(process, subprocess.Popen)
    code = process.wait(timeout=2400)  # a loaded 2-core machine; great_expectations is slow
    outputs = []
    for key in ("stdout", "stderr"):
        handle = _DEFAULT_RUN[key]
        handle.seek(0)
        outputs.append(handle.read())
    cwd = _DEFAULT_RUN["cwd"]
    assert isinstance(cwd, Path)
    return cwd, subprocess.CompletedProcess(process.args, code, *outputs)


@pytest.fixture(scope="session")
def default_run_dir(default_cli_run) -> Path:
    """The embedded default's run directory (ingest + tokenize, gates passed, report built)."""
    cwd, result = default_cli_run
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "default"


@pytest.fixture(scope="session")
def default_tokenized(tmp_path_factory) -> Path:
    """The embedded default's sources, ingested and tokenized with the project tokenizer (no
    later stage): shared by the extract, torchrun and device-map tests, which work on copies."""
    from dflash_etl.stages import ingest, load_config, tokenize

    run_dir = tmp_path_factory.mktemp("default-tokenized") / "run"
    config = load_config(REPO_ROOT / "data" / "pipeline.toml")
    ingest.run(config, run_dir, progress=False)
    tokenize.run(config, run_dir, progress=False)
    return run_dir


@pytest.fixture(scope="session")
def default_run_env(default_cli_run) -> dict[str, str]:
    """The environment the session's default run was started with, as it was then: a test that
    runs the default again to compare with it must run it in the same one. This process's
    environment changes on the way (CI saw OMP_NUM_THREADS=1 in it by the suite's end; which
    test leaves it is not pinned down), and training's floating-point sums depend on the
    thread count."""
    return dict(_DEFAULT_RUN.get("env") or {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")})


@pytest.fixture
def default_run_dir_later(request) -> Callable[[], Path]:
    """default_run_dir, waited for only when the test calls it: a test with slow work of its own
    (test_kill_resume's interrupted runs) does it while the background run goes on."""
    return lambda: request.getfixturevalue("default_run_dir")


@pytest.fixture(scope="session")
def failed_gate_run(tmp_path_factory) -> tuple[Path, int, str]:
    """`dflash-etl ingest` on the default sources with an impossible quarantine limit (0%):
    the conversations suite fails. Returns (run dir, exit code, stderr)."""
    import contextlib
    import io
    import tomllib

    import tomli_w

    from dflash_etl.cli.main import main

    base = tmp_path_factory.mktemp("failed-gate")
    config = tomllib.loads((REPO_ROOT / "data" / "pipeline.toml").read_text())
    for source in config["sources"]:
        source["path"] = str(REPO_ROOT / "data" / source["path"])
    config["expectations"]["max_quarantine_rate"] = 0.0
    config["expectations"]["max_quarantine_rate_per_source"] = {}
    (base / "pipeline.toml").write_text(tomli_w.dumps(config))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["ingest", "--config", str(base / "pipeline.toml"), "--run",
                     str(base / "run"), "--workers", "1"])
    return base / "run", code, err.getvalue()
