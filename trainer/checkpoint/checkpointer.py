"""The run's checkpoints: :class:`Checkpointer` holds what a save holds, writes it and loads it back.

The Trainer owns one. A save is ``Checkpointer.save`` -> :func:`trainer.checkpoint.store.save` (the commit protocol)
-> ``dcp.save``; a resume is ``Checkpointer.load`` -> :func:`trainer.checkpoint.reader.load` (verify, then
``dcp.load``). What varies between strategies is how the model and optimizer state dicts are taken
(``Strategy.model_state_dict`` and the rest, through :mod:`trainer.checkpoint.stateful`); nothing here asks which
strategy runs. The Trainer is never read: it hands in the objects (:meth:`Checkpointer.track`) and three hooks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from trainer.checkpoint import claim, store
from trainer.checkpoint.files import (
    FORMAT_VERSION,
    K_CALLBACKS,
    K_DATAMODULE,
    K_FORMAT,
    K_HPARAMS,
    K_KEEL_VERSION,
    K_LOOP,
    K_OPTIMIZERS,
    K_OPTIONS,
    K_RNG,
    K_SCALER,
    K_SCHEDULERS,
    K_STATE_DICT,
    K_STREAMS,
    K_WORLD_SIZE,
    KEEL_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    StoreReadError,
    refuse_non_finite,
    save_file,
    store_failed,
)
from trainer.checkpoint.reader import committed_runs, load, read_manifest, resolve_best, resolve_last, save_folder
from trainer.checkpoint.stateful import (
    CallbackStates,
    KeyedState,
    ModelState,
    OptimizerStates,
    RNGStates,
    SchedulerStates,
    Value,
    plain,
    plain_hparams,
)
from trainer.data.streams import Stream, StreamPositions
from trainer.distributed import comm
from trainer.distributed.launcher import run_identity
from trainer.options import SEED_DEFAULT, TrainerOptions, resolve_seed
from trainer.state import TrainState
from trainer.storage import describe_error, is_url, location

if TYPE_CHECKING:  # pragma: no cover
    from trainer.checkpoint.async_save import AsyncCheckpointer
    from trainer.distributed.strategy import Strategy

log = logging.getLogger(__name__)

Hook = Callable[[dict[str, Any]], None]


class Checkpointer:
    """Saves the run as one folder and loads one back into it; the Trainer owns one.

    Args:
        strategy: how the model and optimizer state dicts are taken and loaded.
        options: the Trainer's options (saved with the run; ``seed``, ``stream_reshard``, ``initial_weights``).
        state: the loop's :class:`~trainer.state.TrainState`.
        scaler: the precision plugin (the loss scaler's state).
        callbacks: the Trainer's callbacks (their states; ``ModelCheckpoint`` resolves ``last`` and ``best``).
        device, rank, world_size: where this process runs.
        before_save: called with the path before anything is written (the watchdog's phase, the non-finite
            check); ``on_save`` / ``on_load``: the ``on_save_checkpoint`` / ``on_load_checkpoint`` hooks, with the
            checkpoint dict.
    """

    def __init__(
        self,
        *,
        strategy: Strategy,
        options: TrainerOptions,
        state: TrainState,
        scaler: Any,
        callbacks: Sequence[KeyedState],
        device: torch.device,
        rank: int,
        world_size: int,
        before_save: Callable[[str], None],
        on_save: Hook,
        on_load: Hook,
    ) -> None:
        self.strategy, self.options, self.state, self.scaler = strategy, options, state, scaler
        self.callbacks, self.device, self.rank, self.world_size = callbacks, device, rank, world_size
        self.before_save, self.on_save, self.on_load = before_save, on_save, on_load
        self.task: torch.nn.Module | None = None  # the TaskModule
        self.datamodule: Any = None  # a DataModule: saved with its state_dict() / load_state_dict()
        self.optimizers: Sequence[torch.optim.Optimizer] = ()
        self.schedulers: Sequence[Any] = ()
        self.stream: Stream | None = None  # the training loader's position, when it keeps one
        self.sampler: Any = None  # keel's training sampler: resumes with the saved seed
        self.loaded_path: str | None = None  # Lightning's trainer.ckpt_path: what the last load read
        # The run's identity, in every manifest and in the claim on the checkpoint folder: the launcher's job id
        # (a restart or requeue is the same run), else this Trainer's own; ckpt_path="last" adopts the folder's.
        self.run_id = run_identity() or f"keel:{uuid.uuid4().hex[:12]}"
        self.claimed: list[str] = []  # the checkpoint folders this run holds (begin)
        self._released: list[str] = []  # those it let go of when fit ended (a later save takes them again)
        # The background writer of this run's last asynchronous save: any other save waits for it first, so that at
        # most one save of the run is in flight (and a commit's sweep of leftovers never meets a live save).
        self._background: AsyncCheckpointer | None = None
        self._initial_weights_of: torch.nn.Module | None = None  # the task Trainer(initial_weights=...) went into

    def track(
        self,
        task: torch.nn.Module,
        *,
        datamodule: Any,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Any] = (),
        stream: Stream | None = None,
        sampler: Any = None,
    ) -> None:
        """The stage's objects: its task and datamodule; in fit also its optimizers, schedulers and the training
        loader's stream and sampler (a stream's position and the sampler's seed are saved). An evaluation stage of
        the task a fit trained keeps the fit's objects: ``save_checkpoint`` after ``validate`` saves the whole run."""
        if task is not self.task or optimizers:
            self.optimizers, self.schedulers, self.stream, self.sampler = optimizers, schedulers, stream, sampler
        self.task, self.datamodule = task, datamodule

    # ------------------------------------------------------------------ what a save holds
    def objects(self, *, full: bool = True, path: str = "") -> dict[str, Any]:
        """Checkpoint key -> object with ``state_dict()`` / ``load_state_dict()``. ``full=False``: the weights
        only (validate / test / predict from a checkpoint). ``path``: the save being loaded, for messages."""
        task = self.task
        assert task is not None
        objects: dict[str, Any] = {K_STATE_DICT: ModelState(self.strategy, task)}
        if not full:
            return objects
        options, state, sampler = self.options, self.state, self.sampler

        def fallback_seed() -> int:  # a rank the save did not have
            return (options.seed or 0) + 1_000_003 * (self.rank + 1) + state.global_step

        objects.update(
            {
                K_OPTIMIZERS: OptimizerStates(self.strategy, task, list(self.optimizers)),
                K_SCHEDULERS: SchedulerStates(list(self.schedulers)),
                K_SCALER: self.scaler,
                K_CALLBACKS: CallbackStates(self.callbacks),
            }
        )
        if self.datamodule is not None:
            objects[K_DATAMODULE] = self.datamodule
        objects[K_LOOP] = state
        objects[K_STREAMS] = StreamPositions(  # after the loop: it reads where the loop resumes
            self.stream,
            state,
            rank=self.rank,
            world_size=self.world_size,
            reshard=options.stream_reshard,
            path=path,
        )
        objects[K_RNG] = RNGStates(self.device, self.rank, fallback_seed)
        announce = self.rank == 0
        objects[K_OPTIONS] = Value(
            plain(options.resolved()), lambda saved: resume_seed(options, saved, sampler, announce=announce)
        )
        if hparams := getattr(task, "hparams", None):
            objects[K_HPARAMS] = Value(plain_hparams(dict(hparams)))
        return objects

    # ------------------------------------------------------------------ save
    def save(
        self,
        path: str | os.PathLike,
        *,
        weights_only: bool = False,
        background: AsyncCheckpointer | None = None,
        on_commit: Callable[[], None] | None = None,
        lightning_file: bool = False,
    ) -> None:
        """The whole run as one save folder (:func:`trainer.checkpoint.store.save`; ``background``: written by
        that checkpointer's thread), or ``weights_only``: one plain file (weights, hyperparameters, step and
        epoch). ``on_commit`` runs on rank 0 once the save is committed. A collective: every rank calls it."""
        path = location(path, "save_checkpoint(path)")
        task = self.task
        assert task is not None, "save_checkpoint needs a task (call it during or after fit)"
        if self._background is not None and self._background is not background:
            self._background.wait()  # one save of the run in flight: the background one is written and committed
        if background is not None:
            self._background = background
        self.before_save(os.fspath(path))
        state = self.state
        if not weights_only:
            identity = {
                "run": self.run_id,
                "step": state.global_step,
                "epoch": state.current_epoch,
                "world_size": self.world_size,
            }
            store.save(
                path,
                self.objects(),
                identity=identity,
                on_save=self.on_save,
                finite=lambda: self.strategy.weights_finite(task),
                checkpointer=background,
                commit=on_commit,
                lightning_file=lightning_file,
                check=self._claim_check(path),
            )
            return
        refuse_non_finite(self.strategy.weights_finite(task), path, state.global_step)
        check = self._claim_check(path)
        checkpoint: dict[str, Any] = {
            K_FORMAT: FORMAT_VERSION,
            K_KEEL_VERSION: KEEL_VERSION,
            K_STATE_DICT: self.strategy.full_model_state_dict(task),
            K_LOOP: state.state_dict(),
            K_OPTIONS: plain(self.options.resolved()),
            K_WORLD_SIZE: self.world_size,
            "epoch": state.current_epoch,
            "global_step": state.global_step,
        }
        if hparams := getattr(task, "hparams", None):
            checkpoint[K_HPARAMS] = plain_hparams(dict(hparams))
        self.on_save(checkpoint)
        if self.rank == 0:
            if check is not None:
                check()
            save_file(checkpoint, path)
        comm.barrier(self.device)
        if on_commit is not None and self.rank == 0:
            on_commit()

    # ------------------------------------------------------------------ the run and its folder
    def begin(self, ckpt_path: str | None) -> None:
        """Fit start, before anything is restored: decide the run's identity and claim its checkpoint folder
        (rank 0 decides; every rank learns the run id, or raises rank 0's refusal). ``ckpt_path="last"`` (or
        ``"best"``) continues the run that holds the folder; an explicit save continues the run that wrote it;
        otherwise this is a new run, which may write beside a stopped run's saves (with a warning naming it) but
        never resumes or deletes them.

        Raises:
            CheckpointError: another live process holds the folder (or another run's claim on another host), naming
                it and the fix; or the folder could not be read. Nothing is written or deleted.
        """
        folders: list[str] = []  # every ModelCheckpoint's; the first is the one `last` and `best` resolve in
        for cb in self.callbacks:
            folder = getattr(cb, "dirpath", None) if getattr(cb, "is_model_checkpoint", False) else None
            if folder is not None and os.fspath(folder) not in folders:
                folders.append(os.fspath(folder))
        if not folders or self.options.fast_dev_run:  # a smoke test writes nothing (unless forced: no claim)
            return
        decided: tuple[str, str] = ("", "")
        if self.rank == 0:
            folder = folders[0]
            try:
                run = self._claim(folder, ckpt_path, self.run_id)
                for folder in folders[1:]:
                    self._claim(folder, None, run)
                decided = (run, "")
            except CheckpointError as exc:
                decided = ("", str(exc))
            except Exception as exc:  # the store failed: say so on every rank, never a bare traceback on one
                decided = ("", unverified(folder, exc))
        run, error = comm.broadcast_object(decided)
        if error:
            raise CheckpointError(error)
        self.run_id, self.claimed, self._released = run, folders, []

    def _claim(self, folder: str, ckpt_path: str | None, run: str) -> str:
        """Rank 0: the run this fit continues or starts (``run`` unless ``ckpt_path`` continues another), once
        ``folder`` is claimed for it. The read, the decision and the write are one exclusive exchange
        (:func:`claim.exclusive`): of runs starting together, the first takes the folder and the rest find its
        claim live."""
        try:
            with claim.exclusive(folder):
                return self._claim_held(folder, ckpt_path, run)
        except claim.Busy as exc:
            raise CheckpointError(
                f"Checkpoint folder {folder!r}: another process held its claim lock ({exc}) for "
                f"{claim.LOCK_WAIT_S:g} s, which taking a claim never needs. Another run is starting on this folder "
                "and is stuck: stop it, or give this run its own folder (ModelCheckpoint(dirpath=...))."
            ) from None

    def _claim_held(self, folder: str, ckpt_path: str | None, run: str) -> str:
        held, seen = claim.read_for_replacing(folder)
        saves = committed_runs(folder)
        if ckpt_path in ("last", "best"):  # a save of the folder's run, resumed: that run continues
            run = (held or {}).get("run") or next((r for _, r in saves if r), run)
        elif ckpt_path is not None:
            run = _run_of(ckpt_path) or run
        if held is not None and not claim.same_launch(held) and not claim.released(held):
            live = claim.alive(held)  # False: its process has ended, so the claim is stale and taken over
            if live is not False:
                refuse_held(folder, held, live)
        others = [(name, r) for name, r in saves if r and r != run]
        if others:  # as Lightning, a new run may write beside them; keel neither resumes nor deletes them
            name, other = others[0]
            log.warning(
                "Checkpoint folder %r holds %d save(s) of another run (%r, newest %s): this run (%r) writes beside "
                "them and never resumes, prunes or deletes them. To continue that run instead, pass "
                "ckpt_path='last'; to keep runs apart, give each its own folder.",
                folder,
                len(others),
                other,
                name,
                run,
            )
        try:
            claim.write(folder, run, seen)
        except claim.Taken:
            now = claim.read(folder)
            raise CheckpointError(
                f"Checkpoint folder {folder!r} was claimed by {claim.describe(now) if now else 'another process'} "
                "while this run was starting: two processes may not write one folder. Stop the other run, or give "
                "this one its own folder (ModelCheckpoint(dirpath=...), or another logger version)."
            ) from None
        return run

    def release(self) -> None:
        """Rank 0, when fit ends (however it ends, after its saves are committed): mark this run's claims released,
        so that a rerun on any host may take the folder over. A failure to do so is logged, never raised: the
        claim then stays, and names its (ended) process."""
        folders, self.claimed = self.claimed, []
        self._released = folders
        if self.rank != 0:
            return
        for folder in folders:
            try:
                claim.release(folder, self.run_id)
            except Exception as exc:
                log.warning(
                    "Could not mark the claim on checkpoint folder %r released (%s: %s): a rerun on this host "
                    "takes it over; on another host delete %s once this run has stopped.",
                    folder,
                    type(exc).__name__,
                    exc,
                    os.path.join(folder, claim.CLAIM_FILE),
                )

    def _claim_check(self, path: str | os.PathLike) -> Callable[[], None] | None:
        """Rank 0, before a save into a folder this run claimed is committed: the claim is still this process's
        (held, or released when fit ended and not taken over since: ``save_checkpoint`` after ``fit``)."""
        parent = os.path.dirname(os.fspath(path).rstrip("/"))
        folder = next((f for f in self.claimed + self._released if f.rstrip("/") == parent), None)
        if folder is None:
            return None
        run = self.run_id

        def check() -> None:
            held = claim.read(folder)
            if not claim.mine(held, run):
                who = claim.describe(held) if held is not None else "no process (its claim was removed)"
                raise CheckpointError(
                    f"Checkpoint folder {folder!r} is now held by {who}, not by this process (pid {os.getpid()} on "
                    f"{socket.gethostname()}): {path} was not committed, and nothing another run wrote was touched."
                )

        return check

    def _checkpoint_callback(self) -> Any:
        return next((cb for cb in self.callbacks if getattr(cb, "is_model_checkpoint", False)), None)

    # ------------------------------------------------------------------ load
    def load(self, ckpt_path: str | None, *, full: bool) -> float:
        """Load ``ckpt_path`` (a path, ``"last"`` or ``"best"``): the whole run (``full``, fit) or the weights;
        the seconds it took. ``"last"`` falls back to the previous committed save when the newest is damaged.
        No checkpoint (None, or ``"last"`` before the first save): ``Trainer(initial_weights=...)``."""
        if ckpt_path is None:
            return self.initial_weights()
        began = time.perf_counter()
        if ckpt_path not in ("last", "best"):
            ckpt_path = location(ckpt_path, "ckpt_path")
        candidates = self._candidates(ckpt_path, full=full)
        if not candidates:
            log.info("ckpt_path='last': no checkpoint saved yet; starting from scratch.")
            self.initial_weights()
            return time.perf_counter() - began
        task = self.task
        assert task is not None
        required = (K_OPTIMIZERS, K_SCHEDULERS, K_LOOP) if full else ()
        for i, path in enumerate(candidates):
            self.loaded_path = path
            try:
                load(path, self.objects(full=full, path=path), on_load=self.on_load, required=required)
            except CorruptCheckpointError as exc:
                if ckpt_path not in ("last", "best") or i + 1 == len(candidates):
                    raise
                log.warning(
                    "%s Falling back to the next candidate for ckpt_path=%r, %s.", exc, ckpt_path, candidates[i + 1]
                )
                continue
            break
        self._initial_weights_of = task  # a later stage keeps these weights (initial_weights is not read over them)
        if full:
            log.info(
                "Resumed at global step %d, epoch %d, from %s.",
                self.state.global_step,
                self.state.current_epoch,
                self.loaded_path,
            )
        else:
            log.info("Restored the weights from %s.", self.loaded_path)
        return time.perf_counter() - began

    def initial_weights(self) -> float:
        """``Trainer(initial_weights=...)`` into the task, once per task (a later stage keeps what it trained); the
        seconds it took. Not called when a checkpoint is restored: its weights win."""
        opts, task = self.options, self.task
        if opts.initial_weights is None or task is None or self._initial_weights_of is task:
            return 0.0
        from trainer.checkpoint.initial import load_initial_weights

        began = time.perf_counter()
        load_initial_weights(
            task, opts.initial_weights, rename=opts.initial_weights_rename, strict=opts.initial_weights_strict
        )
        self._initial_weights_of = task
        return time.perf_counter() - began

    def _this_runs(self, dirpath: str, found: list[str], ckpt_path: str) -> list[str]:
        """Rank 0: the candidates this run wrote (or an older keel, which named no run); a save of another run,
        copied or written into the folder, is named and never resumed.

        Raises:
            CheckpointError: every candidate is another run's.
        """
        runs = dict(committed_runs(dirpath))
        mine: list[tuple[str, str]] = []
        theirs: list[tuple[str, str]] = []
        for path in found:
            run = runs.get(os.path.basename(path.rstrip("/")), "")
            (mine if run in ("", self.run_id) else theirs).append((path, run))
        for path, run in theirs:
            log.warning(
                "ckpt_path=%r: skipping %s: it was written by run %r, not by this run (%r); keel never resumes "
                "another run's save.",
                ckpt_path,
                path,
                run,
                self.run_id,
            )
        if theirs and not mine:
            raise CheckpointError(
                f"ckpt_path={ckpt_path!r}: {dirpath!r} holds only saves of another run ({theirs[0][1]!r}); this run "
                f"({self.run_id!r}) resumes none of them. Pass that save's path as ckpt_path to continue from it."
            )
        return [path for path, _ in mine]

    def _candidates(self, ckpt_path: str, *, full: bool) -> list[str]:
        """The saves to try, in order, decided on rank 0 and broadcast (an error on rank 0 is raised everywhere)."""
        if ckpt_path not in ("last", "best"):
            return [str(ckpt_path)]
        callback = self._checkpoint_callback()
        if callback is None:
            raise ValueError(f'ckpt_path="{ckpt_path}" needs a ModelCheckpoint callback (enable_checkpointing=True).')
        dirpath = getattr(callback, "dirpath", None)
        assert dirpath is not None  # set in the callback's setup, before any checkpoint is restored
        found: list[str] | str = []
        if self.rank == 0:
            try:
                if ckpt_path == "last":
                    found = resolve_last(dirpath)
                else:
                    found = resolve_best(dirpath, callback.find_state_key, callback.best_k_models, callback.mode)
                    if not found:
                        found = f'ckpt_path="best": no best checkpoint is known (no monitored save in {dirpath}).'
                if full and isinstance(found, list):  # a fit continues this run; evaluating any save's weights is fine
                    found = self._this_runs(dirpath, found, ckpt_path)
            except CheckpointError as exc:
                found = str(exc)
            except Exception as exc:  # the store failed: never a fallback to an older save, never a fresh start
                found = unverified(dirpath, exc)
        found = comm.broadcast_object(found)
        if isinstance(found, str) and found.startswith(_UNVERIFIED):
            raise CheckpointError(found)
        if isinstance(found, str):
            raise (CheckpointError if ckpt_path == "last" else ValueError)(found)
        return found


def resume_seed(options: TrainerOptions, saved_options: Any, sampler: Any, *, announce: bool) -> None:
    """A full restore read the interrupted run's options (``saved_options``): resume with its seed. The training
    ``sampler`` (keel's, or None) was built with this run's seed before the checkpoint was read, and its shuffle
    is what the seed still decides (the generators come back from the checkpoint).

    When this run got no seed (no ``Trainer(seed=...)``, no ``seed_everything``) it takes the checkpoint's, so a
    run started with ``seed_everything(42)`` resumes exactly from a script that does not call it; when it got
    another one, that one is kept with a warning: the data order from here on differs from the interrupted run's.
    """
    recorded = saved_options.get("seed") if isinstance(saved_options, dict) else None
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded == (options.seed or 0):
        return
    source = resolve_seed(options)
    if source != SEED_DEFAULT:
        if announce:
            log.warning(
                "The checkpoint was written by a run with seed %d; this run uses seed %s (from %s), so its data "
                "order differs from the interrupted run's. Pass Trainer(seed=%d) or call seed_everything(%d) to "
                "resume it exactly.",
                recorded,
                options.seed,
                source,
                recorded,
                recorded,
            )
        return
    options.seed = recorded
    if sampler is not None and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict({**sampler.state_dict(), "seed": recorded})
    if announce:
        log.info(
            "Seed %d from the checkpoint (this run got no seed): the resumed run shuffles as the interrupted one.",
            recorded,
        )


def _run_of(path: str | os.PathLike) -> str:
    """The run that wrote the save ``path`` (its manifest), "" when it names none or cannot be read (the load
    then says why). The store failing is raised: the run's identity is never guessed past it."""
    try:
        return str(read_manifest(save_folder(location(path, "ckpt_path")))["identity"].get("run") or "")
    except StoreReadError:
        raise
    except (CheckpointError, OSError, ValueError, KeyError) as exc:
        if store_failed(os.fspath(path), exc):
            raise
        return ""


_UNVERIFIED = "Checkpoint folder "


def refuse_held(folder: str, held: dict[str, Any], live: bool | None) -> NoReturn:
    """Refuse a fit on ``folder``, which ``held`` claims and has not released: a live process on this host
    (``live``), or a process on another host (``live`` None), whose liveness cannot be told from here."""
    if live:
        raise CheckpointError(
            f"Checkpoint folder {folder!r} is being written by {claim.describe(held)}, which is still running: two "
            "processes may not write one folder. Stop that run, or give this one its own folder "
            "(ModelCheckpoint(dirpath=...), or another logger version)."
        )
    raise CheckpointError(
        f"Checkpoint folder {folder!r} is being written by {claim.describe(held)}, another host: whether that "
        f"process still runs cannot be told from {socket.gethostname()!r}, so its claim is never taken over, "
        "whatever ckpt_path says. If that run is really gone (its job ended or its machine died), delete "
        f"{os.path.join(folder, claim.CLAIM_FILE)} and run again; otherwise stop it, or give this run its own folder "
        "(ModelCheckpoint(dirpath=...), or another logger version)."
    )


def unverified(folder: str | os.PathLike, exc: BaseException) -> str:
    """The message for a checkpoint folder that failed while its saves were listed or resolved, or its claim
    written: on object storage, the store; on a filesystem, the folder itself."""
    again = "run again once the store answers" if is_url(os.fspath(folder)) else "fix the folder and run again"
    return (
        f"{_UNVERIFIED}{os.fspath(folder)!r} could not be read ({describe_error(exc)}): its saves could not be "
        f"verified; {again}. Nothing was resumed, started over or deleted."
    )
