"""The Logger base class, and the run identity that keeps a run directory across restarts.

A logger owns one folder, ``save_dir/name/version_N`` (Lightning's layout). The only distributed thing
a logger does is :meth:`Logger.resolve_version`, a collective that every rank calls at the same point
so that all ranks agree on ``N`` (docs/design.md section 9). Everything else writes files and is called by
the Trainer on global rank 0 only (docs/design.md section 7).

The concrete loggers subclass :class:`Logger`: CSV and TensorBoard in trainer/loggers/local.py, W&B and MLflow
in their own modules; trainer.loggers re-exports all of them. This module imports none of them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from trainer.distributed import comm
from trainer.distributed.launcher import is_this_process, process_alive, run_identity, this_process
from trainer.storage import RemotePath, check_writable, is_url, join, local_dir, location

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"version_(\d+)")


RUN_ID_MARKER = ".keel_run_id"
HOLDER_FILE = ".keel_run_holder"  # the process running in a version folder (host, pid, start time)


class Logger:
    """Base class of keel's loggers: a versioned folder plus ``log_metrics`` / ``log_hyperparams``.

    Contract:

    * :meth:`resolve_version` is a collective: the Trainer calls it on every rank, at the start of each
      stage, before anything is written. It never creates folders.
    * :meth:`log_metrics`, :meth:`log_hyperparams` and :meth:`finalize` write files. The Trainer calls
      them on global rank 0 only; subclasses need no rank checks. Values are host floats already.
    * :meth:`finalize` may be called several times (after ``fit`` and again after ``test``); a later
      ``log_*`` call reopens whatever it closed.

    Args:
        save_dir: Root folder of the logs.
        name: Experiment name, a sub-folder of ``save_dir``; None or ``""`` for none.
        version: ``int`` N for ``version_N``, a ``str`` used as the folder name as is, or None to pick
            the next free ``version_N`` in :meth:`resolve_version`.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "keel_logs",
        version: int | str | None = None,
    ) -> None:
        self.save_dir: str = location(save_dir, f"{type(self).__name__}(save_dir=...)")
        self.name: str | None = name
        self.version: int | str | None = version

    @property
    def root_dir(self) -> str:
        """``save_dir/name``, or ``save_dir`` when ``name`` is None or empty: the folder of the versions."""
        return join(self.save_dir, self.name) if self.name else self.save_dir

    @property
    def log_dir(self) -> str:
        """This run's folder: ``root_dir/version_N`` (int version) or ``root_dir/<version>`` (str version).

        Raises:
            RuntimeError: The version is None and :meth:`resolve_version` has not run yet.
        """
        if self.version is None:
            raise RuntimeError(
                f"{type(self).__name__}.log_dir is unknown until the version is resolved: call "
                "resolve_version() on every rank first (the Trainer does it at the start of each stage), "
                "or pass version=... to the constructor."
            )
        folder = f"version_{self.version}" if isinstance(self.version, int) else str(self.version)
        return join(self.root_dir, folder)

    def resolve_version(self, continue_newest: bool = False, owner: str | None = None) -> None:
        """Picks the run's ``version_N`` on rank 0 and shares it with every rank: a restarted job's own folder
        (:meth:`_pick_version`); with ``continue_newest`` (a fit with ``ckpt_path="last"``) the newest version that
        no live process holds, so re-running the same command continues the run; else the next free one. ``owner``
        names the Trainer: its loggers share the folder the first of them picked.

        A collective (one ``broadcast_object``) when the version is still None: every rank must call it
        at the same point. Idempotent: once resolved (or given to the constructor), the version is kept
        and nothing is communicated, so ``fit`` then ``test`` write to the same folder.
        """
        if self.version is not None:
            return
        picked: int | str | None = None
        failure: BaseException | None = None
        if comm.get_rank() == 0:
            try:
                picked = self._pick_version(continue_newest, owner)
            except Exception as exc:  # every rank raises it: the others would wait in the broadcast for good
                failure, picked = exc, f"error:{type(exc).__name__}: {exc}"
        # Rank 0's folder is every rank's, as in Lightning: a program that gives each rank its own temporary
        # default_root_dir still has one run directory.
        shared, self.save_dir = comm.broadcast_object((picked, self.save_dir), src=0)
        if isinstance(shared, str) and shared.startswith("error:"):
            if failure is not None:
                raise failure
            raise RuntimeError(
                f"{type(self).__name__}: rank 0 could not pick the run directory's version: {shared[6:]}"
            )
        self.version = shared
        log.debug("%s resolved version %s under %s", type(self).__name__, self.version, self.root_dir)

    def _pick_version(self, continue_newest: bool = False, owner: str | None = None) -> int:
        """A restarted job (same ``run_identity()``) gets its own folder back; with ``continue_newest`` (a fit
        with ``ckpt_path="last"``) the newest folder, unless a live process holds it (the ``.keel_run_holder``
        record: another run, or a sweep's job running beside this one) or an earlier Trainer of this process does
        (a sweep's jobs run one after another in one process are separate runs); otherwise the next free one.

        A new folder is created with the holder record and, under a launcher, a ``.keel_run_id`` marker so that a
        torchrun restart or a SLURM requeue of the same job lands in the same run directory and resumes from its
        checkpoints. It is created whole by one rename, so jobs that start at the same moment never share one.
        """
        identity = run_identity()
        if is_url(self.root_dir):
            return self._pick_remote_version(identity, continue_newest)
        if identity is not None:
            for entry in sorted(os.listdir(self.root_dir)) if os.path.isdir(self.root_dir) else []:
                marker = os.path.join(self.root_dir, entry, RUN_ID_MARKER)
                if _VERSION_DIR.fullmatch(entry) and os.path.isfile(marker):
                    with open(marker) as handle:
                        if handle.read().strip() == identity:
                            version = int(_VERSION_DIR.fullmatch(entry).group(1))  # type: ignore[union-attr]
                            self._hold(os.path.join(self.root_dir, entry), identity, owner)
                            return version
        version = self._next_version()
        if continue_newest and version > 0:
            folder = os.path.join(self.root_dir, f"version_{version - 1}")
            holder = self._holder(folder)
            if holder is not None and is_this_process(holder) and owner is not None and holder.get("owner") == owner:
                return version - 1  # another logger of this Trainer picked it a moment ago
            if holder is None or (process_alive(holder) is False and not is_this_process(holder)):
                self._hold(folder, identity, owner)
                log.info("Continuing the run in %s (fit with ckpt_path='last').", folder)
                return version - 1
        if identity is None and not continue_newest:
            return version  # nothing to record: the folder is made when something is written
        os.makedirs(self.root_dir, exist_ok=True)
        staged = tempfile.mkdtemp(prefix=".version-", dir=self.root_dir)
        self._hold(staged, identity, owner)
        while True:  # a rename onto an existing (non-empty) folder fails: the next N is tried
            try:
                os.rename(staged, os.path.join(self.root_dir, f"version_{version}"))
                return version
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                version += 1

    @staticmethod
    def _holder(folder: str) -> dict[str, Any] | None:
        """The process recorded as running in ``folder``; None when none is (an older keel, or nothing yet)."""
        try:
            with open(os.path.join(folder, HOLDER_FILE)) as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    @staticmethod
    def _hold(folder: str, identity: str | None, owner: str | None) -> None:
        """Record that this process (the Trainer ``owner``) runs in ``folder`` (and, under a launcher, the job's
        identity)."""
        with open(os.path.join(folder, HOLDER_FILE), "w") as handle:
            json.dump({**this_process(), "owner": owner}, handle)
        if identity is not None:
            with open(os.path.join(folder, RUN_ID_MARKER), "w") as handle:
                handle.write(identity)

    def _pick_remote_version(self, identity: str | None, continue_newest: bool) -> int:
        """:meth:`_pick_version` on object storage: the marker object names the job; there is no exclusive
        create, so two jobs that start in the same second under one prefix may share a version (give each its
        own ``version=`` or ``save_dir`` there)."""
        check_writable(self.root_dir, f"{type(self).__name__}(save_dir=...)")
        root = RemotePath(self.root_dir)
        versions = sorted(
            int(match.group(1))
            for entry in (root.iterdir() if root.is_dir() else [])
            if (match := _VERSION_DIR.fullmatch(entry.name))
        )
        if identity is not None:
            for version in versions:
                marker = root / f"version_{version}" / RUN_ID_MARKER
                if marker.is_file() and marker.read_text().strip() == identity:
                    return version
        if continue_newest and versions:  # no process to check on a store: the newest run continues
            return versions[-1]
        version = versions[-1] + 1 if versions else 0
        if identity is not None:
            (root / f"version_{version}" / RUN_ID_MARKER).write_bytes(identity.encode())
        return version

    def _next_version(self) -> int:
        """``max(N) + 1`` over the ``version_N`` folders in :attr:`root_dir`, or 0 when there are none."""
        try:
            entries = os.listdir(self.root_dir)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        found = [
            int(match.group(1))
            for entry in entries
            if (match := _VERSION_DIR.fullmatch(entry)) and os.path.isdir(os.path.join(self.root_dir, entry))
        ]
        return max(found) + 1 if found else 0

    def _ensure_log_dir(self) -> str:
        """Creates and returns :attr:`log_dir`; resolves the version first in a single process.

        Raises:
            RuntimeError: The version is unresolved in a distributed job (resolving it here, on rank 0
                alone, would hang the collective).
        """
        if self.version is None and comm.get_world_size() == 1:
            self.resolve_version()
        path = self.log_dir
        if is_url(path):  # a local mirror, uploaded after each checkpoint and at the end of each stage
            return local_dir(path, download=True)
        os.makedirs(path, exist_ok=True)
        return path

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Records scalar metrics at optimizer step ``step``. Called on global rank 0 only.

        Args:
            metrics: Metric name to host float.
            step: The global step (optimizer steps) the values belong to.
        """
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Records the run's hyperparameters (the resolved options). Called on global rank 0 only.

        Args:
            params: A possibly nested mapping (a dict or an omegaconf ``DictConfig``).
        """
        raise NotImplementedError

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Records the model's graph (Lightning's hook; only :class:`~trainer.loggers.TensorBoardLogger` with
        ``log_graph=True`` writes one). The Trainer calls it on global rank 0 at the start of ``fit``, after
        :meth:`log_hyperparams`. The default does nothing.

        Args:
            model: The task (a ``torch.nn.Module``) on its device.
            input_array: The forward's input; None: ``model.example_input_array``.
        """

    def log_config(self, config: dict[str, Any]) -> None:
        """Records the run's resolved config once (``recipes.train`` calls it at the start of ``fit``, rank 0).

        The default does nothing: the run directory's ``config.yaml`` already holds it. Trackers that
        live outside the run directory (W&B, MLflow) override it.

        Args:
            config: The composed config as plain nested dicts and lists.
        """

    def finalize(self, status: str) -> None:
        """Flushes and closes open files. Safe to call several times; a later ``log_*`` reopens them.

        Args:
            status: ``"success"`` or ``"failed"``.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(save_dir={self.save_dir!r}, name={self.name!r}, version={self.version!r})"


class DummyExperiment:
    """What a logger's ``experiment`` is on a rank other than 0 (Lightning's ``DummyExperiment``): every
    attribute is a no-op callable, so ``self.logger.experiment.add_image(...)`` in a hook that runs on
    every rank writes nothing there (no second event file in the run directory)."""

    def _nothing(self, *args: Any, **kwargs: Any) -> DummyExperiment:
        return self

    def __getattr__(self, name: str) -> Any:
        return self._nothing

    def __getitem__(self, key: Any) -> DummyExperiment:
        return self

    def __bool__(self) -> bool:
        return False


def _to_plain(params: Any) -> Any:
    """An omegaconf config (resolved) or any nested mapping as plain dicts and lists."""
    if type(params).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(params, resolve=True)
    if isinstance(params, Mapping):
        return {key: _to_plain(value) for key, value in params.items()}
    if isinstance(params, (list, tuple)):
        return [_to_plain(value) for value in params]
    return params


def _yaml_safe(value: Any) -> Any:
    """Nested dicts / lists of YAML scalars; any other leaf becomes ``str(leaf)``, keys become str."""
    if isinstance(value, Mapping):
        return {str(key): _yaml_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def flatten_params(params: Mapping[str, Any], sep: str = "/") -> dict[str, int | float | str | bool]:
    """Flattens nested mappings with ``sep`` (``{"a": {"b": 1}}`` -> ``{"a/b": 1}``).

    Leaves that are not ``int``, ``float``, ``str`` or ``bool`` (None, lists, objects) become ``str``,
    which is what the TensorBoard HPARAMS tab accepts.
    """
    flat: dict[str, int | float | str | bool] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                visit(f"{prefix}{sep}{key}" if prefix else str(key), item)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:
            flat[prefix] = str(value)

    for key, value in _to_plain(params).items():
        visit(str(key), value)
    return flat
