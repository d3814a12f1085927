"""Shared pytest configuration for keel's tests (independent of the ``trainer`` package).

The tiers
---------
* ``tests/unit/``: tests that run in the pytest process and launch nothing; quick (``python -m pytest -q
  tests/unit``).
* ``tests/integration/``: a test is here only when it launches processes, or needs a fixture that does
  (``resume_fit_one_process``, a module's launched reference run), the S3 server (``s3_server``) or the SLURM
  cluster (``slurm_cluster``). Every other test is in ``tests/unit/``, even when the other tests of its subject
  launch: such a subject has a module in each folder (tests/unit/test_checkpoint_files.py beside
  tests/integration/test_checkpoint.py), and what both need is in ``tests/harness/``. Every test here carries the
  ``multiprocess`` marker, set by the folder (:func:`pytest_collection_modifyitems`): a module here writes no
  ``pytestmark`` or decorator for it.
* ``tests/harness/``: what the tests use, not tests: the launch harness (launch.py, launch_state.py), the models,
  the S3 server, the recipes' fault callbacks, the helpers a subject's unit and integration modules share (e.g.
  checkpoint_damage.py), ``scripts/`` (the programs the tests launch) and ``slurm/`` (the one-node cluster). This
  file puts ``tests/harness/`` on ``sys.path``: ``import launch``, ``from models import ...``, ``from slurm import
  cluster``.

``tests/fixtures/`` and ``tests/lightning_ports/`` are data the tests read.

The folder rule
---------------
A test launches processes only from ``tests/integration/``, so that ``python -m pytest -q tests/unit`` (or
``-m "not multiprocess"``, the same tests) is the quick, in-process suite; and a test that launches nothing is not
there, so that every in-process test is in that suite. "Launches" means: torchrun, srun or
sbatch, a ``python`` subprocess that runs the repository's code (a training script, a recipe, ``python -m
trainer.doctor``, a benchmark, ``python -c`` code), and ``multiprocessing`` / ``torch.multiprocessing`` with the
spawn or forkserver start method. The rule is enforced through the marker the folder sets:

* :func:`pytest_runtest_protocol` records the running test (for its setup, call and teardown, so module- and
  session-scoped fixtures count as part of the test that sets them up) in ``launch.running_test``;
* every launch helper of tests/harness/launch.py (``python``, ``torchrun``, ``spawn_ranks``, ``two_nodes``,
  ``elastic_agents``) and of tests/harness/slurm/cluster.py (``srun``, ``command``, ``job``) refuses to start in
  a test without the marker;
* an audit hook refuses ``subprocess.Popen`` of such a command started any other way (``subprocess.run``
  directly), and the spawn and forkserver process starters of ``multiprocessing`` refuse too;
* a test under ``tests/unit/`` that carries the ``multiprocess`` marker itself is a collection error: its
  module belongs in ``tests/integration/``.

The refusal is :class:`launch.MissingMarker`, a BaseException naming the test and saying to move it to
``tests/integration/``, so an ``except Exception`` or ``pytest.raises(AssertionError)`` in the test does not
swallow it.

Exempt, allowed in ``tests/unit/``:

* import-cost checks through ``launch.import_check(code)``: one ``python -c`` that imports modules and prints
  ``sys.modules``, a few hundred ms (tests/unit/test_layout.py's ``test_import_trainer_is_cheap``);
* other programs' command-line tools (``scontrol show hostnames``, ``mount``), and the processes libraries
  start for themselves: a DataLoader's forked workers, W&B's service process.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
UNIT_DIR = TESTS_DIR / "unit"
INTEGRATION_DIR = TESTS_DIR / "integration"
HARNESS_DIR = TESTS_DIR / "harness"
SCRIPTS_DIR = HARNESS_DIR / "scripts"

# Make `import launch` (tests/harness/launch.py), `from models import ...` and `from slurm import cluster` work
# whatever pytest's import mode is.
if str(HARNESS_DIR) not in sys.path:
    sys.path.insert(0, str(HARNESS_DIR))

import launch  # noqa: E402  (needs the path above)

# ---------------------------------------------------------------------------------- the multiprocess marker
_LAUNCHERS = {"torchrun", "srun", "sbatch", "salloc", "mpirun"}
_REPO_PACKAGES = {"trainer", "recipes", "callbacks", "benchmarks", "tests"}
_TORCH_LAUNCHERS = {"torch.distributed.run", "torch.distributed.launch"}
_PYTHON = re.compile(r"python[\d.]*")


def launched(
    argv: str | bytes | Sequence[str | os.PathLike[str]], cwd: str | os.PathLike[str] | None = None
) -> str | None:
    """What ``argv`` launches when it is a launch that needs the ``multiprocess`` marker, else None."""
    if isinstance(argv, bytes):
        argv = argv.decode(errors="replace")
    args = shlex.split(argv) if isinstance(argv, str) else [os.fspath(a) for a in argv]
    while args and os.path.basename(args[0]) == "env":  # env [-u NAME] [--unset=NAME] [NAME=VALUE]... cmd
        args = args[1:]
        while args and (args[0].startswith("-") or "=" in args[0]):
            args = args[2:] if args[0] in ("-u", "--unset") else args[1:]
    if not args:
        return None
    name = os.path.basename(args[0])
    if name in _LAUNCHERS:
        return name
    if name in ("sh", "bash") and len(args) > 2 and args[1] == "-c":  # shell=True, or a shell's -c
        return launched(args[2], cwd)
    if not _PYTHON.fullmatch(name) and os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    rest = args[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-c", "-m"):
        rest = rest[2:] if rest[0] in ("-W", "-X") else rest[1:]  # interpreter options
    if not rest:
        return None
    if rest[0] == "-c":
        return None if launch.import_check_running else "python -c"
    if rest[0] == "-m":
        module = rest[1] if len(rest) > 1 else ""
        return f"python -m {module}" if module.split(".")[0] in _REPO_PACKAGES or module in _TORCH_LAUNCHERS else None
    script = Path(rest[0])
    if not script.is_absolute():
        script = Path(cwd if cwd is not None else os.getcwd()) / script
    return f"python {rest[0]}" if REPO_ROOT in script.resolve().parents else None


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or launch.running_test is None or launch._starting:
        return
    what = launched(args[1], args[2])
    if what is None:
        return
    if not launch.running_test[1]:
        launch.require_multiprocess_marker(what)
    launch.launches += 1  # a launch a test made with subprocess itself counts toward the budget too


def _guard_spawn_starters() -> None:
    """``multiprocessing``'s spawn and forkserver starters (torch.multiprocessing.spawn uses spawn) check the
    marker too; they start the child without ``subprocess``, so the audit hook does not see them."""
    from multiprocessing import popen_forkserver, popen_spawn_posix

    for cls in (popen_spawn_posix.Popen, popen_forkserver.Popen):
        original = cls._launch

        def _launch(self, process_obj, _original=original):  # type: ignore[no-untyped-def]
            launch.require_multiprocess_marker("multiprocessing with the spawn or forkserver start method")
            return _original(self, process_obj)

        cls._launch = _launch  # type: ignore[method-assign]


if not getattr(sys, "_keel_launch_guard", False):  # once per process, whatever imports this file again
    sys._keel_launch_guard = True  # type: ignore[attr-defined]
    sys.addaudithook(_audit)
    if sys.platform != "win32":
        _guard_spawn_starters()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    launch.running_test = (item.nodeid, item.get_closest_marker("multiprocess") is not None)
    try:
        yield
    finally:
        launch.running_test = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line(
        "markers", "multiprocess: launches processes; set by the folder on every test of tests/integration/"
    )
    config.addinivalue_line("markers", "slurm: runs jobs on the one-node SLURM cluster of tests/harness/slurm/start.sh")
    config.addinivalue_line(
        "markers", "index: needs the package index; skipped unless --run-index (or KEEL_RUN_INDEX=1)"
    )
    config.addinivalue_line(
        "markers",
        "slow: over a minute each, or a variant of a scenario the default run covers; skipped unless --run-slow "
        "(or KEEL_RUN_SLOW=1)",
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")
    parser.addoption("--run-index", action="store_true", help="also run the tests marked index (they need PyPI)")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _in(path: Path, folder: Path) -> bool:
    return folder in Path(path).resolve().parents


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """The folder rule's other half: a test of tests/unit/ that carries the ``multiprocess`` marker (its module's
    ``pytestmark``, a decorator, a parameter's marks) fails its module's collection."""
    report = yield
    if report.passed and isinstance(collector, (pytest.Module, pytest.Class)) and _in(collector.path, UNIT_DIR):
        marked = [
            node.name
            for node in report.result
            if isinstance(node, pytest.Function) and node.get_closest_marker("multiprocess") is not None
        ]
        if marked:
            where = Path(collector.path).resolve().relative_to(REPO_ROOT)
            report.outcome = "failed"
            report.longrepr = (
                f"{where}: {', '.join(marked)} {'carries' if len(marked) == 1 else 'carry'} the multiprocess "
                f"marker, but tests/unit/ runs in-process only: move {where.name} to tests/integration/ (the folder "
                "sets the marker there: drop the decorator or pytestmark). See tests/conftest.py."
            )
            report.result = []
    return report


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker (the mark plugin's hook)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The folder rule: every test under tests/integration/ may launch processes.
    for item in items:
        if _in(item.path, INTEGRATION_DIR):
            item.add_marker(pytest.mark.multiprocess)
    # The SLURM tests share one two-CPU node: one test worker runs them all, one after the other (--dist loadgroup).
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
    # The tests that launch processes (tests/integration/) first, in-process ones (ms to seconds each) last: two workers
    # then finish together instead of one waiting out the last module's long launches (collection is alphabetical,
    # and test_s3, test_slurm, test_streams, test_tensor_parallel and test_tracking_dist are among the slowest).
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)
    for marker, why in _OPT_IN.items():
        if not _opted_in(config, marker):
            skip = pytest.mark.skip(reason=f"{why}: run with --run-{marker} or KEEL_RUN_{marker.upper()}=1")
            for item in items:
                if item.get_closest_marker(marker) is not None:
                    item.add_marker(skip)


# The markers whose tests the default run skips, and why.
_OPT_IN = {"slow": "slow (over a minute, or a variant)", "index": "needs the package index, which moves"}


def _opted_in(config: pytest.Config, marker: str) -> bool:
    """Whether this run includes the tests marked ``marker`` (``--run-<marker>`` or ``KEEL_RUN_<MARKER>=1``)."""
    return bool(config.getoption(f"--run-{marker}")) or os.environ.get(f"KEEL_RUN_{marker.upper()}") == "1"


# ---------------------------------------------------------------------------------- nothing written into the checkout
# What git sees in the checkout, ignored files included, before the run and after it: whatever appeared in between
# was written by a test (or by a program it launched) and fails the run, named. The test runner's own files, the
# development environments and the caches of the linter and type checker (a developer may run them meanwhile) are
# not the tests' doing. The workers of pytest-xdist leave it to the controller.
_RUNNER_FILES = re.compile(
    r"(^|/)(__pycache__|\.pytest_cache|[^/]*\.egg-info|\.venv|\.ci-venv|\.mypy_cache|\.ruff_cache)(/|$)"
)


def _checkout_entries() -> set[str] | None:
    import subprocess

    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:  # not a git checkout (an unpacked sdist): nothing to compare
        return None
    return {line for line in done.stdout.splitlines() if not _RUNNER_FILES.search(line[3:])}


def written_into_checkout(before: set[str], after: set[str]) -> list[str]:
    """The entries of ``git status --porcelain --ignored`` that the test run added (paths, sorted)."""
    return sorted(line[3:] for line in after - before)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_CHECKOUT_BEFORE] = _checkout_entries()


# ---------------------------------------------------------------------------------- the launch budget
# README's command (`python -m pytest -q`, the slow and index tests skipped) launches at most this many processes
# through tests/harness/launch.py (python, spawn_ranks, torchrun, two_nodes, elastic_agents; a retry of the known
# gloo abort is the same launch). A launch costs seconds of a suite that must stay within 10 minutes on 2 cores:
# raise this only on purpose, and record the suite's new time in docs/development.md ("Where the time goes").
LAUNCH_BUDGET = 266


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    """pytest-xdist: a worker's launch count reaches the controller."""
    counts = node.config.stash.setdefault(_WORKER_LAUNCHES, [])
    counts.append(int(getattr(node, "workeroutput", {}).get("keel_launches", 0)))


def _fail_session(session: pytest.Session, message: str) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True, bold=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):
        config.workeroutput["keel_launches"] = launch.launches  # type: ignore[attr-defined]
        return
    launches = launch.launches + sum(config.stash.get(_WORKER_LAUNCHES, []))
    if launches > LAUNCH_BUDGET and not any(_opted_in(config, marker) for marker in _OPT_IN):
        _fail_session(
            session,
            f"the tests launched {launches} processes, over the budget of {LAUNCH_BUDGET} (tests/conftest.py): share "
            "a launch between the tests that observe the same run, run a single-process reference in the test "
            "process, or raise the budget on purpose",
        )
    before = config.stash.get(_CHECKOUT_BEFORE, None)
    after = _checkout_entries() if before is not None else None
    written = written_into_checkout(before, after) if before is not None and after is not None else []
    if written:
        _fail_session(
            session,
            f"the test run wrote {len(written)} path(s) into the checkout (run tests in tmp_path; launches get a "
            f"temporary working directory): {', '.join(written[:20])}",
        )


_CHECKOUT_BEFORE = pytest.StashKey[set[str] | None]()
_WORKER_LAUNCHES = pytest.StashKey[list[int]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What was imported to collect the tests (torch, the trackers, Hydra, every test module) lives for the whole
    run: frozen out of the garbage collector's sight, a collection in a test (the Tuner's ``gc.collect()`` between
    trials, as Lightning's; Python's own full collections) walks only what the tests made. Measured: the Tuner's
    tests 23.6 s -> 15.7 s alone, and a collection from 100 ms to 230 ms in the whole unit tier without it."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_global_seed_between_tests():  # type: ignore[no-untyped-def]
    """``seed_everything(n)`` sets ``PL_GLOBAL_SEED`` (and ``workers=True`` ``PL_SEED_WORKERS``), which a Trainer
    built without ``seed=`` then uses: every test starts without them and leaves the environment as it was."""
    saved = {name: os.environ.pop(name, None) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the parent of tests/)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def scripts_dir() -> Path:
    """tests/harness/scripts/: small standalone scripts launched by the tests."""
    return SCRIPTS_DIR


# The uninterrupted runs of tests/harness/scripts/resume_fit.py that several modules compare against (test_checkpoint,
# test_async_checkpoint, test_s3): deterministic, so one run each serves the whole session.
@pytest.fixture(scope="session")
def resume_fit_one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder (``rank0.pt``) of resume_fit.py run uninterrupted in one process."""
    root = tmp_path_factory.mktemp("resume_fit_one_process")
    script = SCRIPTS_DIR / "resume_fit.py"
    launch.python(script, str(root / "out"), "--ckpt-dir", str(root / "ck"), timeout=120).check()
    return root / "out"


@pytest.fixture(scope="session")
def resume_fit_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder (``rank0.pt``, ``rank1.pt``) of resume_fit.py run uninterrupted on 2 ranks (spawn_ranks)."""
    root = tmp_path_factory.mktemp("resume_fit_two_ranks")
    script = SCRIPTS_DIR / "resume_fit.py"
    launch.spawn_ranks(script, str(root / "out"), "--ckpt-dir", str(root / "ck"), nproc=2, timeout=180).check()
    return root / "out"


@pytest.fixture(scope="session")
def slurm_cluster():
    """The one-node SLURM cluster (tests/harness/slurm/start.sh): reused when running, started when this is root and
    SLURM is installed (and stopped at the end), else the test is skipped with the reason."""
    from slurm.cluster import connect

    cluster, reason = connect()
    if cluster is None:
        pytest.skip(reason)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """One S3 server (SeaweedFS on 127.0.0.1, tests/harness/s3server.py) for the whole run, started when a test first
    asks for it and stopped at the end; skipped with the reason where weed or s3fs is not installed (a server
    that is installed but fails to start is an error, with weed's log). Tests that kill or pause a server
    start their own."""
    from s3server import S3Server, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    server = S3Server.start(tmp_path_factory.mktemp("s3server"))
    yield server
    server.kill()  # its data is the run's scratch: no graceful stop (weed's takes ~15 s)
