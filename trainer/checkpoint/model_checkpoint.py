"""ModelCheckpoint: when to save, what to keep, and the ``last`` pointer (re-exported by ``callbacks``).

It lives in ``trainer/`` because ``enable_checkpointing=True`` adds one by default and ``trainer`` never
imports ``callbacks``. It uses the public Callback API and the Trainer's ``checkpointer`` (its ``save``).

Files in ``dirpath``: one ``*.ckpt`` folder per save (committed by ``Checkpointer.save``,
trainer/checkpoint/store.py; a plain file with ``save_weights_only``) and a small JSON pointer ``last``
(``{"last": name, "history": [newer, ..., older]}``) replaced atomically after each commit. Old saves are
pruned only after the new one and the pointer are committed; what a killed save left is removed then too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainer.callback import Callback
from trainer.checkpoint.async_save import AsyncCheckpointer
from trainer.checkpoint.files import CheckpointSaveError, write_pointer
from trainer.checkpoint.reader import committed, read_manifest
from trainer.checkpoint.store import LIGHTNING_FILE, LIGHTNING_FILE_NAMES, remove_save
from trainer.storage import as_path, check_writable, describe_error, is_url, join, location, sync_mirrors

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


LAST_NAME = "last.ckpt"  # Lightning's name for the latest checkpoint (save_last=True)
# One background writer per Trainer, shared by all its ModelCheckpoints and waited on by synchronous saves
# too: one save in flight at most, so two callbacks' background collectives never interleave.
_CHECKPOINTERS: weakref.WeakKeyDictionary[Any, AsyncCheckpointer] = weakref.WeakKeyDictionary()


def check_filename(template: str) -> None:
    """Refuse a ``filename`` template whose format specs cannot render (``epoch`` / ``step`` are ints,
    metrics floats), when the callback is built rather than at the first save.

    Raises:
        ValueError: naming the field, its spec and what went wrong.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"ModelCheckpoint(filename={template!r}): expected a non-empty template string.")
    for match in _FIELD.finditer(template):
        key, fmt = match.group(1), (match.group(2) or "")[1:]
        sample: int | float = 7 if key in ("epoch", "step") else 0.5
        try:
            format(sample, fmt)
        except (ValueError, TypeError) as exc:
            kind = "an int" if key in ("epoch", "step") else "a float (metrics are floats)"
            raise ValueError(
                f"ModelCheckpoint(filename={template!r}): field {{{key}:{fmt}}} cannot format {kind}: {exc}."
            ) from None
    leftover = _FIELD.sub("", template)
    if "{" in leftover or "}" in leftover:
        raise ValueError(
            f"ModelCheckpoint(filename={template!r}): unbalanced braces; fields look like {{epoch}} "
            "or {val/loss:.3f}."
        )


def link_last(path: str, *, lightning_file: bool = False) -> None:
    """Point ``dirpath/last.ckpt`` at ``path`` (rank 0, after ``path`` is committed), atomically: a relative
    symlink to a save folder, or with ``lightning_file`` to its ``lightning.pt`` (which Lightning programs
    ``torch.load``; passed back as ``ckpt_path`` it resumes from its folder); a hard link to a plain file
    (it outlives pruning of ``path``)."""
    target = os.path.join(os.path.dirname(path), LAST_NAME)
    if os.path.abspath(path) == os.path.abspath(target):
        return
    inner = os.path.join(os.path.basename(path), LIGHTNING_FILE)
    link = inner if lightning_file and os.path.isfile(os.path.join(path, LIGHTNING_FILE)) else os.path.basename(path)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        if os.path.isdir(path):
            os.symlink(link, tmp)
        else:
            try:
                os.link(path, tmp)
            except OSError:  # no hard links on this filesystem: a copy
                import shutil

                shutil.copy2(path, tmp)
        os.replace(tmp, target)
    except OSError as exc:  # the checkpoint itself is committed; only the alias failed
        log.warning("Could not update %s -> %s: %s", target, path, exc)
        with contextlib.suppress(OSError):
            os.remove(tmp)


class ModelCheckpoint(Callback):
    """Save checkpoints on the step clock or at epoch ends; keep the best ``save_top_k``.

    Args:
        dirpath: folder for checkpoints; default ``<run dir>/checkpoints``. A URL (``s3://bucket/prefix``, any
            fsspec filesystem that is installed) puts them on object storage, committed without rename
            (docs/storage.md); every rank's access is checked when fit starts. A save that cannot be written
            (disk full, the store down) raises :class:`~trainer.checkpoint.files.CheckpointSaveError` and the run
            stops (an async save: at the next step boundary, on every rank); the previous save stays loadable.
        filename: template such as ``"{epoch}-{step}-{val/loss:.3f}"`` or ``"epoch_{epoch:03d}"``; each field
            renders as ``name=value`` (just the value with ``auto_insert_metric_name=False``), with its
            format spec (``epoch`` and ``step`` are ints, metrics floats), and ``/`` becomes ``_``.
            Checked when the callback is built. Default ``"{epoch}-{step}"``.
        monitor: metric key in ``trainer.callback_metrics`` (reduced over ranks, so every rank makes the
            same top-k decision). None keeps the most recent ``save_top_k`` checkpoints.
        mode: ``"min"`` or ``"max"``.
        save_top_k: how many to keep (-1: all, 0: none except ``last``).
        save_last: always keep the most recent checkpoint (``last_model_path``) besides the top-k; True
            (or Lightning's ``"link"``, the same here) also leaves ``last.ckpt`` in ``dirpath`` (a symlink to the
            save folder, or to its ``lightning.pt``), the file Lightning users and their scripts look for,
            beside keel's ``last`` pointer. Either way the end of ``fit`` saves the final state when no periodic
            save already holds it (kept as ``last``, outside the top-k).
        every_n_train_steps: save every n optimizer steps.
        every_n_epochs: save every n epochs (default 1 when no other trigger is given).
        train_time_interval: save when this many seconds passed since the last save (checked at steps).
        save_on_exception: save when a loop raises (all ranks must reach the hook; a rank that died cannot).
        async_save: return to training once the state is staged in CPU memory (one copy of the weights
            and optimizer state, kept between saves); the write, fsync and rename, then the ``last``
            pointer swap and pruning, run on a background thread; the save is reported done (or its
            error raised) at a later step boundary. At most one save is in flight; forced saves
            (preemption, exception) are synchronous, and the end of ``fit`` waits for the save in flight
            (trainer/checkpoint/async_save.py).
        verbose: log each save (and why) on rank 0 at INFO.
        save_weights_only: checkpoints hold the weights (and hyperparameters, step, epoch) only, not the
            optimizer, scheduler, callback or loop state: they load with ``load_from_checkpoint`` but cannot
            resume a fit.
        auto_insert_metric_name: ``name=`` before each field's value (Lightning's default True).
        save_on_train_epoch_end: epoch-triggered saves at the end of the training epoch (True; None: keel's
            default, the same, after the epoch's validation) or at the end of each validation run of
            ``fit`` (False).
        enable_version_counter: when a checkpoint of the same name already exists from another save (a
            rerun into the same folder), append ``-v1``, ``-v2``, ... instead of replacing it.
        lightning_file: each save folder also holds ``lightning.pt``, one plain file with Lightning's keys
            (``state_dict``, ``epoch``, ``global_step``, ``hyper_parameters``; DDP or one device), written before
            the folder is committed; ``best_model_path``, ``last_model_path`` and ``last.ckpt`` name it, so
            programs that ``torch.load`` them keep working. Passing that path back as ``ckpt_path`` resumes
            from its folder. ``callbacks.lightning.ModelCheckpoint`` turns it on.
    """

    is_model_checkpoint = True

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        *,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | Literal["link"] | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: float | None = None,
        save_on_exception: bool = False,
        async_save: bool = False,
        verbose: bool = False,
        save_weights_only: bool = False,
        auto_insert_metric_name: bool = True,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        lightning_file: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): expected 'min' or 'max'.")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}): expected an int >= -1.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelCheckpoint({name}={value!r}): expected an int >= 1 or None.")
        _check_flags(
            async_save=async_save,
            verbose=verbose,
            save_weights_only=save_weights_only,
            auto_insert_metric_name=auto_insert_metric_name,
            enable_version_counter=enable_version_counter,
            lightning_file=lightning_file,
        )
        if save_on_train_epoch_end is not None and not isinstance(save_on_train_epoch_end, bool):
            raise ValueError(
                f"ModelCheckpoint(save_on_train_epoch_end={save_on_train_epoch_end!r}): expected True, False or None."
            )
        if save_last not in (None, True, False, "link"):
            raise ValueError(f"ModelCheckpoint(save_last={save_last!r}): expected True, 'link', False or None.")
        if async_save and save_weights_only:
            raise ValueError(
                "ModelCheckpoint(async_save=True, save_weights_only=True): pick one (async saves "
                "stage the whole run state)."
            )
        check_filename(filename or "{epoch}-{step}")
        if train_time_interval is not None and not train_time_interval > 0:
            raise ValueError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}): expected seconds > 0.")
        self.dirpath = location(dirpath, "ModelCheckpoint(dirpath=...)") if dirpath is not None else None
        self.filename = filename or "{epoch}-{step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        if every_n_epochs is None and every_n_train_steps is None and train_time_interval is None:
            self.every_n_epochs = 1
        self.train_time_interval = train_time_interval
        self.save_on_exception = save_on_exception
        self.async_save = async_save
        self.verbose = verbose
        self.save_weights_only = save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.enable_version_counter = enable_version_counter
        self.lightning_file = lightning_file
        self._checkpointer = AsyncCheckpointer()  # replaced in setup by the trainer's shared one
        self.best_k_models: dict[str, float] = {}
        self._best_path = ""  # the saves themselves; best_model_path / last_model_path report them
        self.best_model_score: float | None = None
        self._last_path = ""
        self._last_saved_step = -1
        self._pending_after_validation = False
        self._monitor_checked = False  # whether the first optimizer step of this fit looked for the monitor
        self._last_time = time.monotonic()
        self._names_in_store: set[str] | None = None  # a dirpath on object storage: its committed saves (setup)
        self._leftovers: list[str] = []  # uncommitted saves found there at setup: removed after the next commit
        # Saves the next commit prunes (what its save replaces, and what an earlier commit could not prune because its
        # pointer swap failed): pruned only once a pointer swap succeeds, so never the save `last` still names. Saved
        # in each save's state: a run resumed after a failed swap prunes them at its first commit (_restored).
        self._unpruned: list[str] = []
        self._restored_unpruned: dict[str, int] = {}  # -> the step of the save whose state named it

    @property
    def best_model_path(self) -> str:
        """The best save (with ``lightning_file``: its ``lightning.pt``, when the save has one)."""
        return self._report(self._best_path)

    @best_model_path.setter
    def best_model_path(self, path: str) -> None:
        self._best_path = _save_of(path)

    @property
    def last_model_path(self) -> str:
        """The newest save (with ``lightning_file``: its ``lightning.pt``, when the save has one)."""
        return self._report(self._last_path)

    @last_model_path.setter
    def last_model_path(self, path: str) -> None:
        self._last_path = _save_of(path)

    def _report(self, path: str) -> str:
        if not path or not self.lightning_file or is_url(path):
            return path
        inner = os.path.join(path, LIGHTNING_FILE)
        return inner if os.path.isfile(inner) else path

    @property
    def state_key(self) -> str:
        """What it monitors and the name of its folder, not the folder's path: a folder spelled another way
        (relative, absolute, through a symlink) or moved keeps its state, and so does a run that changes how
        often it saves."""
        folder = os.path.basename(str(self.dirpath).rstrip("/")) if self.dirpath is not None else None
        return f"{type(self).__name__}{{monitor={self.monitor!r}, mode={self.mode!r}, folder={folder!r}}}"

    def matching_state_key(self, keys: list[str]) -> str | None:
        """Among saved states no callback of this run claimed, this callback's in another folder: the one key of a
        ModelCheckpoint with the same monitor and mode (the folder was renamed, moved or reached through a link)."""
        mine = self.state_key.split(", folder=")[0]
        same = [key for key in keys if key.split(", folder=")[0] == mine]
        return same[0] if len(same) == 1 else None

    def find_state_key(self, keys: list[str]) -> str | None:
        """This callback's key among the saved ones: its own, else :meth:`matching_state_key`."""
        return self.state_key if self.state_key in keys else self.matching_state_key(keys)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._monitor_checked = stage != "fit"
        if self.dirpath is None:
            self.dirpath = join(trainer.log_dir, "checkpoints")
        if trainer.world_size > 1:  # rank 0's folder is every rank's, as in Lightning (each rank may name its own)
            from trainer.distributed import comm

            self.dirpath = comm.broadcast_object(self.dirpath)
        if stage == "fit" and not is_url(self.dirpath):
            _check_folder(self.dirpath)
        if stage == "fit" and is_url(self.dirpath):
            _check_store(self.dirpath)
            # Listed once, here: a save then asks the store nothing on the training thread, so a store that hangs
            # stalls only the background upload.
            folder = as_path(self.dirpath)
            present = {e.name for e in folder.iterdir()} if folder.is_dir() else set()
            # Only committed saves keep their names; what a killed save left is removed after the next commit.
            self._names_in_store = set(committed(self.dirpath))
            self._leftovers = sorted(n for n in present - self._names_in_store if n.endswith(".ckpt"))
        shared = _CHECKPOINTERS.setdefault(trainer, AsyncCheckpointer())
        if self._checkpointer is not shared:
            self._checkpointer.wait()
            self._checkpointer = shared

    def on_train_batch_end(self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._checkpointer.in_flight:
            self._checkpointer.poll()  # commit a background save whose file is durable (no collective, no sync)
        if not self._monitor_checked and trainer.optimizer_stepped:
            self._monitor_checked = True
            self._check_monitor_logged(trainer)
        step = trainer.global_step
        if step == self._last_saved_step or not trainer.optimizer_stepped:
            return
        if self.every_n_train_steps is not None and step % self.every_n_train_steps == 0:
            if self.monitor is not None and trainer.val_check_due:
                self._pending_after_validation = True  # validation runs right after this hook
            else:
                self.save(trainer)
        elif self.train_time_interval is not None and (trainer.world_size == 1 or trainer.is_logging_step):
            # Every rank must agree to save: the elapsed time is decided on rank 0 and broadcast, on
            # logging steps only in DDP (no extra collective on other steps).
            from trainer.distributed import comm

            due = comm.broadcast_object(time.monotonic() - self._last_time >= self.train_time_interval)
            if due:
                self.save(trainer)

    def _check_monitor_logged(self, trainer: Trainer) -> None:
        """At the fit's first optimizer step, after the sanity check's validation: warn (rank 0) when nothing has
        been logged under ``monitor`` yet, instead of only failing at the first save an epoch later. A warning, not
        an error: a metric logged later (in an epoch-end hook, or every few batches) is legitimate. Skipped when
        validation keys are still unknown (a validation loop whose sanity check did not run)."""
        if self.monitor is None or not trainer.is_global_zero:
            return
        sanity = any(n != 0 for n in trainer.num_sanity_val_batches)
        if trainer.num_val_batches and not sanity:
            return
        known = trainer._metrics.seen | set(trainer.callback_metrics)
        if self.monitor in known:
            return
        where = "the sanity check's validation or the first training step" if sanity else "the first training step"
        log.warning(
            "ModelCheckpoint(monitor=%r): nothing has been logged under that name by %s; logged so far: %s. If it "
            "is logged later (in an epoch-end hook, or every few batches) this is fine; otherwise the first save "
            "fails with a KeyError: check the name against self.log's.",
            self.monitor,
            where,
            sorted(known),
        )

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        # A step-triggered save that coincides with mid-epoch validation waits for the fresh metrics.
        if self._pending_after_validation and not trainer.sanity_checking:
            self._pending_after_validation = False
            self.save(trainer)
        elif self.save_on_train_epoch_end is False and trainer.state_stage == "fit" and not trainer.sanity_checking:
            self._save_epoch(trainer)  # Lightning's save_on_train_epoch_end=False: after each validation run

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if self.save_on_train_epoch_end is not False:
            self._save_epoch(trainer)

    def _save_epoch(self, trainer: Trainer) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            if trainer.global_step != self._last_saved_step:
                self.save(trainer)

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        # save_last: the fit ends with its final state saved, whatever the periodic triggers did.
        if self.save_last and trainer.optimizers and trainer.global_step != self._last_saved_step:
            self.save(trainer, last_only=True)
        self._checkpointer.wait()  # the end of fit never leaves a save in flight

    def teardown(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._checkpointer.wait()

    def on_exception(self, trainer: Trainer, task: TaskModule, exception: BaseException) -> None:
        self._checkpointer.wait(raise_errors=False)  # finish (commit) the save in flight; the run's error wins
        if (
            self.save_on_exception
            and not isinstance(exception, KeyboardInterrupt)  # a second Ctrl-C: stop now, as asked
            and trainer.state_stage == "fit"
            and trainer.optimizers
            and trainer.global_step != self._last_saved_step
        ):
            self.save(trainer, suffix="-exception", force=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_k_models": dict(self.best_k_models),
            "best_model_path": self._best_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self._last_path,
            "dirpath": self.dirpath,
            "monitor": self.monitor,
            "mode": self.mode,
            "last_saved_step": self._last_saved_step,
            "unpruned": list(dict.fromkeys([*self._unpruned, *self._restored_unpruned])),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saves the state names are looked up by name in this run's ``dirpath``: the folder may be spelled
        another way, or have been moved or copied, since they were written."""
        here = {k: self._here(k) for k in state.get("best_k_models", {})}
        self.best_k_models = {
            here[k]: float(v) for k, v in state.get("best_k_models", {}).items() if as_path(here[k]).exists()
        }
        self._best_path = self._here(state.get("best_model_path", ""))
        self.best_model_score = state.get("best_model_score")
        self._last_path = self._here(state.get("last_model_path", ""))
        self._last_saved_step = int(state.get("last_saved_step", -1))
        self._restored_unpruned = {self._here(p): self._last_saved_step for p in state.get("unpruned", [])}

    def _here(self, path: str) -> str:
        """A save named in a saved state, as a path in this run's ``dirpath`` (by its name)."""
        if not path or self.dirpath is None:
            return path
        return join(self.dirpath, os.path.basename(str(path).rstrip("/")))

    # ------------------------------------------------------------------ saving
    def format_name(
        self, metrics: dict[str, float], epoch: int, step: int, suffix: str = "", *, missing_ok: bool = False
    ) -> str:
        values = dict(metrics, epoch=epoch, step=step)

        prefix = (lambda key: f"{key}=") if self.auto_insert_metric_name else (lambda key: "")

        def render(match: re.Match[str]) -> str:
            key, fmt = match.group(1), match.group(2) or ""
            if key not in values:
                if missing_ok:  # a forced save (preemption, exception) before the metric exists
                    return f"{prefix(key)}na"
                raise KeyError(
                    f"ModelCheckpoint filename {self.filename!r} uses {key!r}, which was not logged; "
                    f"available: {sorted(values)}."
                )
            value = values[key] if key in ("epoch", "step") else float(values[key])  # ints stay ints: {epoch:03d}
            return f"{prefix(key)}{format(value, fmt[1:]) if fmt else value}"

        return _FIELD.sub(render, self.filename).replace("/", "_") + suffix + ".ckpt"

    def save(self, trainer: Trainer, suffix: str = "", *, force: bool = False, last_only: bool = False) -> str | None:
        """Save now (collective: every rank calls it). Returns the path, or None if top-k rejected it.

        ``force`` (preemption, exceptions) always writes and records the file as ``last``, whatever top-k
        decides; it is pruned like any other ``last`` once a newer checkpoint exists. ``last_only`` (the end
        of fit with ``save_last``) writes it as ``last`` outside the top-k. Under ``fast_dev_run`` only a forced
        save writes (a smoke test keeps no checkpoints, as in Lightning).
        """
        if trainer.fast_dev_run and not force:
            return None
        assert self.dirpath is not None
        # A save made only because of save_last is named last.ckpt, as Lightning names it; the alias last.ckpt to an
        # older save goes first (rank 0, before the broadcast below, so every rank then sees the name free).
        named_last = last_only and bool(self.save_last)
        if named_last and trainer.is_global_zero:
            self._unlink_last_alias()
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if trainer.world_size > 1:  # rank 0's values name the file and decide top-k on every rank (per-step
            from trainer.distributed import comm  # training values in callback_metrics are this rank's, not reduced)

            metrics = comm.broadcast_object(metrics)
        score = None
        if self.monitor is not None:
            if self.monitor in metrics:
                score = metrics[self.monitor]
            elif not (force or last_only):
                raise KeyError(
                    f"ModelCheckpoint(monitor={self.monitor!r}): no such metric was logged; available: "
                    f"{sorted(metrics)}."
                )
        if named_last:
            path = self._free(join(self.dirpath, LAST_NAME))
        else:
            name = self.format_name(
                metrics, trainer.current_epoch, trainer.global_step, suffix, missing_ok=force or last_only
            )
            path = self._versioned(join(self.dirpath, name))
        # A forced save without the monitored value is kept as `last` only, outside the top-k.
        keep = not last_only and self._admits(score) and (self.monitor is None or score is not None)
        if not keep and not self.save_last and not force:
            return None
        self._checkpointer.wait()  # the previous (background) save is committed before this one's bookkeeping
        # Bookkeeping first, so the state saved inside this checkpoint already lists this file.
        old_last = self._last_path
        self._last_path = path
        removed: list[str] = []
        if keep:
            self.best_k_models[path] = score if score is not None else float(trainer.global_step)
            removed = self._prune_top_k()
        victims = removed + ([old_last] if old_last and old_last != path else [])
        self._unpruned = list(dict.fromkeys([*self._unpruned, *victims]))  # in this save's state too
        background = self.async_save and not force  # forced saves (preemption, exception) are synchronous
        self._last_saved_step = trainer.global_step  # before the save: its own callback state records it
        if self._names_in_store is not None:
            self._names_in_store.add(os.path.basename(path))
        trainer.checkpointer.save(
            path,
            weights_only=self.save_weights_only,
            background=self._checkpointer if background else None,
            on_commit=lambda: self._commit(trainer, path),
            lightning_file=self.lightning_file,
        )
        self._last_time = time.monotonic()
        return path

    def _commit(self, trainer: Trainer, path: str) -> None:
        """Rank 0, only after ``path`` is committed: point `last` at it, then prune what it replaces (and what an
        earlier commit left unpruned because its pointer swap failed).

        Raises:
            CheckpointSaveError: the pointer could not be swapped; the message says the save itself is committed
                (``ckpt_path="last"`` resumes it: a committed save newer than the pointer's wins) and that nothing
                was pruned (the pointer may still name what would have been): the next commit prunes it.
        """
        try:
            write_pointer(path)
        except OSError as exc:
            error = CheckpointSaveError(
                f"Checkpoint {path!r} was committed, but the `last` pointer beside it could not be updated "
                f"({describe_error(exc)}). The save is complete: ckpt_path='last' resumes it (a committed save newer "
                "than the one the pointer names is preferred). Nothing older was removed: the saves it replaces are "
                "pruned once a later pointer update succeeds (the next save's, in this run or in the run resumed "
                "from it)."
            )
            error.errno = exc.errno
            raise error from exc
        victims, self._unpruned = self._unpruned, []
        restored, self._restored_unpruned = self._restored_unpruned, {}
        victims += [v for v, step in restored.items() if v not in victims and self._superseded(v, step, trainer)]
        if self.verbose:
            score = self.best_k_models.get(path)
            why = (
                f"{self.monitor!r} = {score:.6g} (best {self.best_model_score:.6g})"
                if self.monitor and score is not None
                else "the latest"
            )
            log.info("Epoch %d, global step %d: saved %s as %s.", trainer.current_epoch, trainer.global_step, path, why)
        for victim in victims:
            if victim != path and victim not in self.best_k_models:
                remove_save(victim)
        leftovers, self._leftovers = self._leftovers, []
        for name in leftovers:  # this run holds the folder (its claim): no other run is writing these
            if join(self.dirpath or "", name) != path:
                log.info("Removing %s: an uncommitted save a stopped run left.", join(self.dirpath or "", name))
                remove_save(join(self.dirpath or "", name))
        # After pruning: a pruned save made for save_last frees the name last.ckpt for the alias.
        if self.save_last and not is_url(path):  # object stores have no links: `last` and ckpt_path="last" remain
            link_last(path, lightning_file=self.lightning_file)
        sync_mirrors()  # a run directory on object storage: the logs up to this checkpoint go with it

    def _superseded(self, victim: str, step: int, trainer: Trainer) -> bool:
        """A save that the commit of the resumed save (of step ``step``) would have pruned, named in its state: still
        one of this run's, committed before that step. Anything else of that name (another run's save, a newer save
        that reused the name, a damaged one) is left alone."""
        try:
            identity = read_manifest(as_path(victim))["identity"]
        except Exception:  # gone (pruned already), damaged, a plain file, or the store failed: left alone
            return False
        return identity.get("run") == trainer.checkpointer.run_id and int(identity.get("step", -1)) < step

    def _versioned(self, path: str) -> str:
        """``enable_version_counter``: ``name-vN.ckpt`` when ``path`` exists from another save."""
        if not self.enable_version_counter or path == self._last_path or path in self.best_k_models:
            return path
        stem, ext = os.path.splitext(path)
        version, candidate = 0, path
        while self._exists(candidate) and candidate != self._last_path:
            version += 1
            candidate = f"{stem}-v{version}{ext}"
        return candidate

    def _free(self, path: str) -> str:
        """``path``, or ``name-vN.ckpt`` while a save of that name exists (the previous save made for save_last:
        it is pruned once this one is committed, never written over)."""
        stem, ext = os.path.splitext(path)
        version, candidate = 0, path
        while self._exists(candidate):
            version += 1
            candidate = f"{stem}-v{version}{ext}"
        return candidate

    def _unlink_last_alias(self) -> None:
        """Remove ``dirpath/last.ckpt`` when it is the alias (a link) to an older save, not a save itself."""
        target = join(self.dirpath or "", LAST_NAME)
        if not is_url(target) and os.path.islink(target):
            os.remove(target)

    def _exists(self, path: str) -> bool:
        if is_url(path) and self._names_in_store is not None:
            return os.path.basename(path) in self._names_in_store
        return as_path(path).exists()

    @property
    def _mode(self) -> str:
        """Without a monitor the score is the global step and newer is better."""
        return self.mode if self.monitor is not None else "max"

    def _worst(self) -> str:
        pick = max if self._mode == "min" else min
        return pick(self.best_k_models, key=self.best_k_models.__getitem__)

    def _admits(self, score: float | None) -> bool:
        if self.save_top_k == 0:
            return False
        if score is not None and math.isnan(score):
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k or self.monitor is None:
            return True
        if score is None:  # a forced save (preemption, exception) before the monitored value exists
            return False
        worst = self.best_k_models[self._worst()]
        return score < worst if self._mode == "min" else score > worst

    def _prune_top_k(self) -> list[str]:
        removed = []
        while self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            removed.append(self._worst())
            self.best_k_models.pop(removed[-1])
        if self.best_k_models:
            best = (min if self._mode == "min" else max)(self.best_k_models, key=self.best_k_models.__getitem__)
            self._best_path = best
            self.best_model_score = self.best_k_models[best] if self.monitor is not None else None
        return removed


def _check_folder(path: str) -> None:
    """A local ``dirpath``, checked when fit starts as a URL is (:func:`_check_store`): a folder this process can
    create and write, not a file. A collective: every rank raises the same error.

    Raises:
        ValueError: ``dirpath`` is a file (or under one). PermissionError: it cannot be created or written.
    """
    from trainer.distributed import comm

    problem = ""
    folder = Path(path)
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        problem = (
            f"ValueError:ModelCheckpoint(dirpath={path!r}): {str(blocker)!r} is a file, so no checkpoint folder can be "
            "made there. Remove it, or choose another dirpath."
        )
    else:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not os.access(existing, os.W_OK | os.X_OK):
            problem = (
                f"PermissionError:ModelCheckpoint(dirpath={path!r}): {str(existing)!r} is not writable by this user, "
                "so no checkpoint could be saved. Make it writable, or choose another dirpath."
            )
    problems = comm.all_gather_object(problem) if comm.get_world_size() > 1 else [problem]
    failed = next((text for text in problems if text), "")
    if failed:
        kind, text = failed.split(":", 1)
        raise (ValueError if kind == "ValueError" else PermissionError)(text)


def _check_store(url: str) -> None:
    """Every rank can write to ``url`` (its credentials, the endpoint, the bucket), checked when fit starts: a
    collective, so that every rank raises the same error rather than one rank failing its first save an hour in."""
    from trainer.distributed import comm

    try:
        check_writable(url, "ModelCheckpoint(dirpath=...)")
        problem = ""
    except PermissionError as exc:
        problem = str(exc)
    problems = comm.all_gather_object(problem) if comm.get_world_size() > 1 else [problem]
    failed = [(rank, text) for rank, text in enumerate(problems) if text]
    if failed:
        rank, text = failed[0]
        raise PermissionError(f"{text} (rank {rank}{' and others' if len(failed) > 1 else ''})")


def _check_flags(**flags: Any) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"ModelCheckpoint({name}={flag!r}): expected True or False.")


def _save_of(path: str) -> str:
    """The save a reported path names (``<save>/lightning.pt`` -> ``<save>``)."""
    return os.path.dirname(path) if os.path.basename(path) in LIGHTNING_FILE_NAMES else path
