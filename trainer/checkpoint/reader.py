"""Reading a save: which one (``last`` / ``best``), is it intact, and loading it (docs/design.md section 8).

Resolving reads only manifests (``keel.json``, a few hundred bytes) and, for ``best``, the last save's
``keel.pt``; never the weights. Loading verifies every file of the save against the manifest's sizes and
CRC32s (the ranks share the files) and the identity of ``keel.pt`` against the manifest, checks the
optimizer and scheduler classes, and only then reads the tensors: a corrupt or foreign part is refused by
name before anything is loaded, and ``ckpt_path="last"`` falls back to the previous committed save.

Nothing in a save can run code: ``keel.pt`` and every plain file load with ``weights_only=True``; DCP's
``.metadata`` is read through an unpickler that admits only DCP's own metadata classes; DCP's non-tensor
items (optimizer hyperparameters) load with ``weights_only=True`` too (DCP's own planner unpickles them
freely).
"""

from __future__ import annotations

import io
import json
import logging
import os
import zlib
from collections.abc import Callable, Collection
from typing import Any

import torch

from trainer.checkpoint.files import (
    FORMAT_VERSION,
    K_CALLBACKS,
    K_CLASSES,
    K_FORMAT,
    K_IDENTITY,
    K_STATE_DICT,
    POINTER_NAME,
    CheckpointError,
    CorruptCheckpointError,
    StoreReadError,
    load_file,
    read_object,
    read_pointer,
    store_failed,
)
from trainer.checkpoint.stateful import check_classes
from trainer.checkpoint.store import (
    DCP_KEYS,
    KEEL_FILE,
    LIGHTNING_FILE_NAMES,
    MANIFEST_FILE,
    METADATA_FILE,
    MODEL_SHAPED_KEYS,
    quiet_dcp,
)
from trainer.distributed import comm
from trainer.storage import AnyPath, RemotePath, as_path, describe_error, is_url

log = logging.getLogger(__name__)


def data_root(folder: AnyPath, manifest: dict[str, Any] | None) -> AnyPath:
    """Where a save's files are: the folder itself, or on object storage the prefix its manifest names."""
    data = (manifest or {}).get("data") or ""
    return folder / data if data else folder


# ---------------------------------------------------------------------- one save
def read_manifest(folder: AnyPath) -> dict[str, Any]:
    """The manifest of a committed save. Raises :class:`CheckpointError` naming what is wrong."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise CorruptCheckpointError(f"Checkpoint {str(folder)!r} has no {MANIFEST_FILE}: it was never committed.")
    try:
        manifest = json.loads(path.read_text())
        body = {k: manifest[k] for k in ("format", "keel_version", "identity", "files")}
        if "data" in manifest:
            body["data"] = check_data(manifest["data"], path)
        intact = zlib.crc32(json.dumps(body, sort_keys=True).encode()) == manifest["crc32"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(path, RemotePath) and isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            raise  # the store failed (a timeout, a refusal): not a damaged manifest
        raise CorruptCheckpointError(
            f"Checkpoint manifest {str(path)!r} is unreadable ({type(exc).__name__}: {exc})."
        ) from exc
    if not intact:
        raise CorruptCheckpointError(f"Checkpoint manifest {str(path)!r} is corrupt (its checksum does not match).")
    if int(body["format"]) > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {str(folder)!r} has format version {body['format']}, newer than this keel "
            f"({FORMAT_VERSION}); upgrade keel to load it."
        )
    return manifest


STORE_FAILED = "store:"  # a verify problem that is the store's failure, not damage (never a fallback)


def check_data(data: Any, manifest: AnyPath) -> str:
    """The manifest's ``data`` prefix: a plain name inside the save (never a path out of it)."""
    if not isinstance(data, str) or not data or data.startswith(".") or "/" in data or "\\" in data:
        raise CorruptCheckpointError(f"Checkpoint manifest {str(manifest)!r} names {data!r} as its data prefix.")
    return data


def verify(folder: AnyPath, manifest: dict[str, Any], *, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with this rank's share of the save's files (every ``world_size``-th, from ``rank``):
    missing, another size, another checksum. Empty when intact."""
    problems = []
    names = sorted(manifest["files"])
    root = data_root(folder, manifest)
    for name in names[rank::world_size]:
        size, crc = manifest["files"][name]
        path = root / name
        try:
            actual, actual_crc = path.stat().st_size, 0
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 24):
                    actual_crc = zlib.crc32(chunk, actual_crc)
        except Exception as exc:  # OSError, or an object store's own error
            if isinstance(root, RemotePath) and not isinstance(exc, FileNotFoundError):
                problems.append(f"{STORE_FAILED}{name} could not be read from the store ({describe_error(exc)})")
            elif isinstance(exc, OSError):
                problems.append(f"{name} cannot be read ({exc.strerror or exc})")
            else:
                raise
            continue
        if actual != size or actual_crc != crc:
            problems.append(
                f"{name} is corrupt or from another save ({actual:,} bytes, crc32 {actual_crc:08x}; the manifest "
                f"of save {manifest['identity'].get('save_id', '?')[:8]} at step {manifest['identity'].get('step')} "
                f"records {size:,} bytes, crc32 {crc:08x})"
            )
    return problems


def _verified(
    folder: AnyPath, *, collective: bool, keys: set[str] | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(manifest, keel.pt) of an intact save, or a CheckpointError naming every bad part. ``collective``: the
    ranks share the checks and agree. ``keys``: filled with the DCP entries the save holds."""
    problems: list[str] = []
    refused = ""  # a CheckpointError that is not damage (a newer format): raised, never skipped
    manifest = None
    try:
        manifest = read_manifest(folder)
        rank, world = (comm.get_rank(), comm.get_world_size()) if collective else (0, 1)
        problems = verify(folder, manifest, rank=rank, world_size=world)
    except CorruptCheckpointError as exc:
        problems = [str(exc)]
    except CheckpointError as exc:
        if not collective:
            raise
        refused = str(exc)
    except Exception as exc:  # the store failed: agreed on by every rank (one raising alone would hang the rest)
        if isinstance(folder, RemotePath) and not isinstance(exc, CheckpointError):
            problems = [f"{STORE_FAILED}{MANIFEST_FILE} could not be read from the store ({describe_error(exc)})"]
        elif not collective:
            raise
        else:
            refused = f"{type(exc).__name__}: {exc}"
    if collective:  # every rank reaches this gather, whatever failed: the others' findings name their rank
        me = comm.get_rank()
        found = comm.all_gather_object((problems, refused))
        refused = next((_on(r, me, text) for r, (_, text) in enumerate(found) if text), "")
        problems = [p if p.startswith(STORE_FAILED) else _on(r, me, p) for r, (ps, _) in enumerate(found) for p in ps]
        if refused:
            raise CheckpointError(refused)
    failed = [p[len(STORE_FAILED) :] for p in problems if p.startswith(STORE_FAILED)]
    if failed:  # not damage: falling back to an older save would silently lose progress
        raise StoreReadError.of(folder, failed)
    if problems:
        raise CorruptCheckpointError(f"Checkpoint {str(folder)!r} is damaged: {'; '.join(problems)}.")
    assert manifest is not None  # read, or a problem raised above
    rest: dict[str, Any] = {}

    def read() -> None:  # every rank reads keel.pt: the ranks agree on the outcome, as on the checks above
        rest.update(_read_keel(data_root(folder, manifest), keys))
        if rest.get(K_IDENTITY) != manifest["identity"]:
            raise CorruptCheckpointError(
                f"Checkpoint {str(folder / KEEL_FILE)!r} belongs to another save than its folder's manifest "
                f"({rest.get(K_IDENTITY)} vs {manifest['identity']})."
            )

    agreed(folder, read, collective=collective)
    return manifest, rest


def _on(rank: int, me: int, text: str) -> str:
    """A finding of ``rank``, as rank ``me`` reports it: another rank's names that rank."""
    return text if rank == me else f"rank {rank}: {text}"


def agreed(folder: AnyPath, read: Callable[[], None], *, collective: bool) -> None:
    """Run ``read`` (reads of the save ``folder``) on every rank and raise the same error on every rank when it
    failed on one (one rank raising alone would hang the others at the next collective): the store's failure
    first (:class:`StoreReadError`: never a fallback), else the first rank's damage or refusal. On object storage
    any error of the store's client that is not an absent object is the store's failure, never damage."""
    outcome: tuple[str, str] = ("", "")
    try:
        read()
    except StoreReadError as exc:
        outcome = ("store", str(exc.naming(folder)))
    except CorruptCheckpointError as exc:
        outcome = ("damage", str(exc))
    except CheckpointError as exc:
        outcome = ("refused", str(exc))
    except Exception as exc:
        if store_failed(folder, exc):
            outcome = ("store", str(StoreReadError.of(folder, [f"it could not be read ({describe_error(exc)})"])))
        elif not collective:
            raise
        else:  # raised on every rank, never on this one alone
            outcome = ("refused", f"{str(folder)!r} could not be read ({type(exc).__name__}: {exc})")
    if collective:
        me = comm.get_rank()
        outcomes = [(k, _on(r, me, text)) for r, (k, text) in enumerate(comm.all_gather_object(outcome))]
    else:
        outcomes = [outcome]
    for kind, error in (("store", StoreReadError), ("damage", CorruptCheckpointError), ("refused", CheckpointError)):
        text = next((text for k, text in outcomes if k == kind), None)
        if text is not None:
            raise error(text)


def _read_keel(folder: AnyPath, keys: set[str] | None = None) -> dict[str, Any]:
    """keel.pt of a save whose files are in ``folder``, after the DCP entries of its .metadata are put in
    ``keys``. On object storage each file is read whole first (:func:`read_object`): the store failing is a
    :class:`StoreReadError`, and only bytes that were read can be judged damaged."""
    metadata = folder / METADATA_FILE
    source: Any = None
    if isinstance(metadata, RemotePath):
        data = read_object(metadata)
        source = io.BytesIO(data) if data is not None else None
    elif metadata.is_file():
        source = metadata
    if source is None:
        raise CheckpointError(f"Checkpoint {str(folder)!r} has no {METADATA_FILE}: it was never committed.")
    try:
        from trainer.checkpoint.dcp_io import MetadataUnpickler

        with source if isinstance(source, io.BytesIO) else metadata.open("rb") as handle:
            entries = MetadataUnpickler(handle, str(metadata)).load().state_dict_metadata
        if keys is not None:
            keys.update(entries)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"Checkpoint metadata {str(metadata)!r} is truncated or corrupt ({exc}).") from exc
    return load_file(folder / KEEL_FILE, required=(K_FORMAT,))


def save_folder(path: str | os.PathLike) -> AnyPath:
    """The save a path names: a folder; ``<folder>/lightning.pt`` (what ``callbacks.lightning`` reports)
    names its folder; the ``last`` pointer names the newest save it records; a plain file (a weights file) itself.

    Raises:
        CheckpointError: a ``last`` pointer that names no save.
    """
    path = as_path(path)
    if path.name == POINTER_NAME and path.is_file():
        names = read_pointer(path.parent)
        if not names:
            raise CheckpointError(f"{str(path)!r} is a `last` pointer that names no save yet; pass a save folder.")
        path = path.parent / names[0]
    if isinstance(path, RemotePath):
        return path.parent if path.name in LIGHTNING_FILE_NAMES else path
    if path.is_symlink():  # last.ckpt -> a save folder, or its lightning.pt
        path = path.resolve()
    if path.name in LIGHTNING_FILE_NAMES and (path.parent / MANIFEST_FILE).exists():
        return path.parent
    return path


def load(
    path: str | os.PathLike, state: dict[str, Any], *, on_load: Callable[[dict[str, Any]], None], required: tuple = ()
) -> dict[str, Any]:
    """Load the save ``path`` into ``state`` (key -> object with ``load_state_dict``). A collective under a
    process group. Verifies the save first (the ranks share the files), checks the classes, reads the
    tensors into this run's layout (DCP reshards: any world size, any strategy), calls ``on_load`` (the
    ``on_load_checkpoint`` hooks) with the whole checkpoint dict, then loads every object; the callbacks' states
    load first, before the tensors are read. ``required``: checkpoint keys that must be present (a fit needs the
    optimizer and loop state). Returns the dict.

    Raises:
        CheckpointError: naming the damaged or unsafe part, a missing key, or the mismatched classes.
    """
    found: list[Any] = []

    def locate() -> None:  # reads the store (the pointer, the manifest): agreed on, as the reads that follow
        folder = save_folder(path)
        found[:] = [folder, _is_save_folder(folder)]

    if is_url(os.fspath(path)):
        agreed(as_path(path), locate, collective=True)
    else:
        locate()
    folder, is_folder = found
    if is_folder:
        saved: set[str] = set()
        manifest, checkpoint = _verified(folder, collective=True, keys=saved)
        _check(str(folder), checkpoint, state, tuple(k for k in required if k not in DCP_KEYS))
        if K_CALLBACKS in state and K_CALLBACKS in checkpoint:  # first, as in Lightning: a callback may rebuild the
            state[K_CALLBACKS].load_state_dict(checkpoint[K_CALLBACKS])  # param groups the read fills (BaseFinetuning)
            state = {k: v for k, v in state.items() if k != K_CALLBACKS}
        targets = {name: state[key].state_dict() for key, name in DCP_KEYS.items() if key in state}
        targets.update(_model_shaped(targets.get("model", {}), saved))
        from trainer.checkpoint import dcp_io  # on the first load: importing DCP takes 0.6 s (dcp_io's docstring)

        try:
            with quiet_dcp():
                dcp_io.dcp.load(
                    targets, storage_reader=dcp_io.reader(data_root(folder, manifest)), planner=dcp_io.SafePlanner()
                )
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise _load_error(folder, exc, "could not be loaded into this run's model and optimizers") from exc
        read = {**DCP_KEYS, **MODEL_SHAPED_KEYS}
        checkpoint.update({key: targets[name] for key, name in read.items() if name in targets})
    else:
        checkpoint = load_file(folder)
        _check(str(folder), checkpoint, state, required)
    on_load(checkpoint)
    for key, obj in state.items():
        if key in checkpoint:
            obj.load_state_dict(checkpoint[key])
    return checkpoint


def _model_shaped(model: dict[str, Any], saved: set[str]) -> dict[str, dict[str, Any]]:
    """Targets for the model-shaped entries the save holds beside the model (an averaged copy of the weights, say):
    fresh tensors shaped and sharded as the model's, for the entries of the model the save has."""
    targets: dict[str, dict[str, Any]] = {}
    for name in MODEL_SHAPED_KEYS.values():
        entries = {
            key: torch.empty_like(value)
            for key, value in model.items()
            if isinstance(value, torch.Tensor) and f"{name}.{key}" in saved
        }
        if entries:
            targets[name] = entries
    return targets


def _is_save_folder(folder: AnyPath) -> bool:
    """A save folder (this release's layout), not a plain file: on object storage, a prefix with a manifest."""
    if isinstance(folder, RemotePath):
        return (folder / MANIFEST_FILE).is_file() or not folder.is_file()
    return folder.is_dir()


def _load_error(folder: AnyPath, exc: BaseException, what: str) -> BaseException:
    """The error to raise for a failed DCP read: keel's own refusal (inside DCP's CheckpointException, which
    collects every rank's failures) as it is, anything else as a CheckpointError naming the folder."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, CheckpointError)):
        return exc
    failures = getattr(exc, "failures", {}).values()
    causes = [failure[0] if isinstance(failure, tuple) else failure for failure in failures]
    refusals: list[CheckpointError] = [c for c in causes if isinstance(c, StoreReadError)]
    refusals = refusals or [c for c in causes if isinstance(c, CheckpointError)]  # the store's failure first
    if refusals:
        return refusals[0].naming(folder) if isinstance(refusals[0], StoreReadError) else refusals[0]
    text = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(f"Checkpoint {str(folder)!r} {what} ({type(exc).__name__}: {text}).")


def _check(path: str, checkpoint: dict[str, Any], state: dict[str, Any], required: tuple) -> None:
    missing = [k for k in required if k not in checkpoint]
    if missing:
        raise CheckpointError(
            f"Checkpoint {path!r} has no {missing}: it holds weights only and cannot resume a fit "
            "(load it with TaskModule.load_from_checkpoint, or pass it to validate/test/predict)."
        )
    check_classes(path, checkpoint.get(K_CLASSES, {}), state)


def load_weights(path: str | os.PathLike) -> dict[str, Any]:
    """A save's checkpoint dict with ``K_STATE_DICT`` as one plain state dict of CPU tensors, whatever the
    strategy and world size it was written at; no process group needed (``export_weights``,
    ``load_from_checkpoint``). Every file is verified first."""
    folder = save_folder(path)
    if not _is_save_folder(folder):
        return load_file(folder)
    manifest, checkpoint = _verified(folder, collective=False)
    checkpoint[K_STATE_DICT] = read_model(folder, manifest)
    return checkpoint


def read_model(folder: AnyPath, manifest: dict[str, Any] | None, keys: Collection[str] = ("model",)) -> dict[str, Any]:
    """The model entries of a save already verified (:func:`_verified` gave ``manifest``), as CPU tensors, in one
    DCP read without a process group. ``keys``: DCP keys to read, ``"model"`` (every entry) or flattened ones
    (``"model.net.0.weight"``): only their bytes are read (trainer/checkpoint/hf.py reads a few at a time)."""
    tensors: dict[str, Any] = {}
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        from trainer.checkpoint import dcp_io

        with quiet_dcp():
            _load_state_dict(
                tensors,
                storage_reader=dcp_io.reader(data_root(folder, manifest)),
                planner=dcp_io.SafeEmptyPlanner(keys=set(keys)),
                no_dist=True,
            )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        raise _load_error(folder, exc, "could not be read") from exc
    return dict(tensors.get("model", {}))


def load_model_into(folder: AnyPath, manifest: dict[str, Any] | None, targets: dict[str, Any]) -> None:
    """Read the model entries ``targets`` names (model key -> tensor, DTensors included) of a verified save into
    those tensors in place: each rank reads only the saved pieces that overlap what it holds (DCP reshards). A
    collective under a process group."""
    from trainer.checkpoint import dcp_io

    try:
        with quiet_dcp():
            dcp_io.dcp.load(
                {"model": targets},
                storage_reader=dcp_io.reader(data_root(folder, manifest)),
                planner=dcp_io.SafePlanner(),
            )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        raise _load_error(folder, exc, "could not be read into the task") from exc


# ---------------------------------------------------------------------- which save
def committed(directory: str | os.PathLike) -> list[str]:
    """Names of the committed saves in ``directory``, newest first (by step, then time): folders with a
    manifest, and weights-only files. Reads manifests only."""
    return [name for name, _ in committed_runs(directory)]


def committed_runs(directory: str | os.PathLike) -> list[tuple[str, str]]:
    """:func:`committed`, each with the run that wrote it (its manifest's ``identity.run``; "" where unknown: a
    weights-only file, a save of an older keel)."""
    found: list[tuple[int, float, str, str]] = []
    root = as_path(directory)
    if not root.is_dir():
        return []
    for entry in root.iterdir():
        # last.ckpt is a candidate when it is a save (one made for save_last), never as the alias (a link) to one
        if entry.name.startswith(".") or entry.name == POINTER_NAME or entry.is_symlink():
            continue
        try:
            if (entry / MANIFEST_FILE).is_file():
                identity = read_manifest(entry)["identity"]
                step, run = int(identity.get("step", -1)), str(identity.get("run") or "")
                found.append((step, (entry / MANIFEST_FILE).stat().st_mtime, entry.name, run))
            elif entry.suffix == ".ckpt" and entry.is_file():
                found.append((-1, entry.stat().st_mtime, entry.name, ""))
        except StoreReadError:
            raise
        except (CorruptCheckpointError, ValueError):
            continue  # not committed, or damaged: never a candidate (the pointer's newest is reported)
        except CheckpointError:  # a newer format: the newest candidate, refused when loaded ("upgrade keel")
            found.append((1 << 62, entry.stat().st_mtime, entry.name, ""))
        except Exception as exc:
            if store_failed(entry, exc):  # the store failed, not the save: it cannot be judged now
                raise StoreReadError.reading(entry / MANIFEST_FILE, exc) from exc
            if not isinstance(exc, OSError):
                raise
            continue  # an unreadable local file: never a candidate
    return [(name, run) for _, _, name, run in sorted(found, reverse=True)]


def _step_of(directory: str | os.PathLike, name: str) -> int:
    try:
        return int(read_manifest(as_path(directory) / name)["identity"].get("step", -1))
    except (CheckpointError, OSError, ValueError) as exc:
        if store_failed(directory, exc):  # the store failed: it cannot decide which save is newer
            raise
        return -1


def resolve_last(directory: str | os.PathLike) -> list[str]:
    """``ckpt_path="last"``: the saves to try, in order (rank 0). Empty only when the folder has no pointer
    and no committed save: a first run. A pointer that cannot be read, or whose newest entry is missing or
    uncommitted, gives the newest committed save with a WARNING naming what was wrong.

    Raises:
        CheckpointError: a pointer exists (the run saved before) but no committed save is left: starting
            over would silently lose the run.
    """
    pointer = as_path(directory) / POINTER_NAME
    saves = committed(directory)
    try:
        names = read_pointer(directory)
        problem = None
    except StoreReadError:  # the store failed, not the pointer: never a guess at which save is the run's last
        raise
    except CheckpointError as exc:
        names, problem = [], str(exc)
    if names is None:
        if saves:
            log.warning(
                "ckpt_path='last': %s has no pointer but holds committed saves; resuming from the newest, %s.",
                directory,
                saves[0],
            )
        return [os.path.join(directory, n) for n in saves]
    if (
        names
        and names[0] in saves
        and saves[0] not in names
        and _step_of(directory, saves[0]) > _step_of(directory, names[0])
    ):  # committed after the pointer's last swap and never in its history: that swap failed; it is the run's last
        log.warning(
            "ckpt_path='last': the pointer names %s, but %s is newer and committed (its pointer update failed); "
            "resuming from it.",
            names[0],
            saves[0],
        )
        order = saves
    elif names and names[0] in saves:
        order = [names[0]] + [n for n in saves if n != names[0]]
    else:
        order = saves
        if problem is None:
            problem = f"The pointer {str(pointer)!r} names {names[0]!r}, which is missing or was never committed."
    if not order:
        raise CheckpointError(
            f"ckpt_path='last': {problem} No committed save is left in {str(directory)!r}, so keel will not start "
            "over silently. Restore the saves, or pass ckpt_path=None (or delete the folder) to start a new run."
        )
    if problem is not None:
        log.warning("ckpt_path='last': %s Resuming from the newest committed save, %s.", problem, order[0])
    return [os.path.join(directory, n) for n in order]


def resolve_best(
    directory: str | os.PathLike,
    state_key: Callable[[list[str]], str | None],
    best_k: dict[str, float] | None,
    mode: str,
) -> list[str]:
    """``ckpt_path="best"``: the callback's kept saves, best first (its state in this process, else the newest
    save's ``keel.pt``). Every candidate that is not a committed save in ``directory`` is logged and skipped."""
    saves = committed(directory)
    for name in saves if not best_k else []:  # a fresh process: the callback's state is in the newest save
        try:
            folder = as_path(directory) / name
            states = _read_keel(data_root(folder, read_manifest(folder))).get(K_CALLBACKS, {})
            key = state_key(list(states))
            saved = states.get(key, {}) if key is not None else {}
        except StoreReadError:
            raise
        except (CheckpointError, OSError) as exc:
            if store_failed(directory, exc):  # the store failed: the next save's state is not what 'best' means
                raise
            log.warning("ckpt_path='best': skipping %s for the callback's state: %s", name, exc)
            continue
        best_k = dict(saved.get("best_k_models") or {})
        break
    out = []
    for path, _ in sorted((best_k or {}).items(), key=lambda kv: kv[1], reverse=mode == "max"):
        name = save_folder(path).name  # looked up by name: the folder may be spelled otherwise, or have moved
        if name not in saves:
            log.warning("ckpt_path='best': skipping %s: it is not a committed save in %s.", path, directory)
        else:
            out.append(os.path.join(os.fspath(directory), name))
    return out
