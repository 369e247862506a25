"""Writing outputs: files safely (check that a path is writable before the work that fills it, and
write through a temp file renamed into place, so a reader never sees half a file; a folder written
whole the same way), and what a command prints (its summary, or its error) for both command lines,
``arithinterp`` and ``python -m arithinterp.sweep``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Union

from arithinterp.errors import ConfigError, OutputError

PathLike = Union[str, Path]


def _probe(directory: Path, what: str, path: PathLike) -> None:
    """Create and remove a temp file in ``directory`` (``os.access`` is wrong on some mounts)."""
    blocking = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{what}: cannot write to {path}: {blocking} is a file, not a folder; "
                          "give a path whose folders are folders")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".arithinterp-write-check-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f"{what}: cannot write to {path} ({reason}); give a path in a writable directory") from None


def check_writable_dir(path: PathLike, what: str = "out") -> Path:
    """Make sure ``path`` is (or can be made) a directory this process can write in.

    Args:
        path: The directory; created, with its parents, when missing.
        what: The option to name in the error message (``"out"``, ``"--out"``).

    Returns:
        The directory, ``~`` expanded.

    Raises:
        ConfigError: ``path`` is a file, lies under a file, or is not writable.
    """
    directory = Path(path).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what}: {path} exists and is not a directory; give a directory")
    _probe(directory, what, path)
    return directory


def check_free_dir(path: PathLike, what: str = "out", overwrite: bool = False) -> Path:
    """:func:`check_writable_dir`, and refuse a folder that already holds files unless ``overwrite``:
    checked before any work, so that nothing is computed that could not be saved.

    Args:
        path: The directory.
        what: The option to name in the error message.
        overwrite: Accept a folder that already holds files.

    Returns:
        The directory, ``~`` expanded.

    Raises:
        ConfigError: The directory is not writable, or holds files and ``overwrite`` is false.
    """
    directory = check_writable_dir(path, what)
    if not overwrite and directory.is_dir() and any(directory.iterdir()):
        raise ConfigError(f"{what}: {path} already holds files; pass overwrite=True (--overwrite) to replace them, "
                          "or give another folder")
    return directory


def check_new_dir(path: PathLike, what: str = "out", overwrite: bool = False) -> Path:
    """:func:`check_free_dir` for a folder :func:`atomic_dir` writes whole: ``path`` itself is not
    created (only its parent, to be probed), so a run that stops before the end leaves it as it was.

    Args:
        path: The directory.
        what: The option to name in the error message.
        overwrite: Accept a folder that already holds files (it is replaced whole at the end).

    Returns:
        The directory, ``~`` expanded.

    Raises:
        ConfigError: ``path`` is a file, its parent folder is not writable, or it holds files and
            ``overwrite`` is false.
    """
    directory = Path(path).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what}: {path} exists and is not a directory; give a directory")
    if not overwrite and directory.is_dir() and any(directory.iterdir()):
        raise ConfigError(f"{what}: {path} already holds files; pass overwrite=True (--overwrite) to replace them, "
                          "or give another folder")
    _probe(directory.parent, what, path)
    return directory


def check_writable_file(path: PathLike, what: str = "out", overwrite: bool = True) -> Path:
    """Make sure the file ``path`` can be written: its folder is writable, it is not a folder, and
    (unless ``overwrite``) it does not exist yet.

    Args:
        path: The file.
        what: The option to name in the error message.
        overwrite: Whether an existing file may be replaced.

    Returns:
        The file's path, ``~`` expanded.

    Raises:
        ConfigError: ``path`` is a directory, its folder is not writable, or it exists and
            ``overwrite`` is false.
    """
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"{what}: {path} is a directory; give a file name")
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash, and a file would take the folder's name
        raise ConfigError(f"{what}: {path} ends with {str(path)[-1]!r}, so it names a folder; give a file name "
                          f"inside it, such as {Path(path) / 'out.html'}")
    if not overwrite and target.exists():
        hint = "--overwrite" if what.startswith("--") else "overwrite=True"
        raise ConfigError(f"{what}: {path} already exists; pass {hint} to replace it, or give another file")
    _probe(target.parent, what, path)
    return target


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """A temp path next to ``path`` that replaces ``path`` in one step when the block succeeds.

    Args:
        path: The file to write; its folder is created when missing.

    Yields:
        The temp file to write to; removed when the block fails.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a normal file is what users expect
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """A temp folder next to ``path`` that takes the place of ``path`` when the block succeeds.

    Everything is written into the temp folder (a sibling, so the final rename stays on one file
    system); a block that fails or is interrupted (Ctrl-C) removes it and leaves ``path`` as it
    was: absent, or holding what it held.

    Args:
        path: The folder to write; its parent is created when missing.

    Yields:
        The temp folder to write into.

    Raises:
        OutputError: The finished folder could not be moved into place; ``path`` is unchanged.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        try:
            os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700; a normal folder is what users expect
            _move_into_place(tmp, path)
        except OSError as error:
            raise OutputError(f"cannot move the finished folder into {path}: {error.strerror or error}; "
                              f"{path} is unchanged") from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(folder: Path, path: Path) -> None:
    """Rename ``folder`` to ``path``. A folder cannot be renamed onto one that holds files, so an
    existing ``path`` is moved aside first and deleted once ``folder`` is in its place (or moved
    back if that rename fails); between the two renames ``path`` is briefly absent."""
    if not os.path.lexists(path):
        os.rename(folder, path)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.rename(path, aside / path.name)
    try:
        os.rename(folder, path)
    except BaseException:
        os.rename(aside / path.name, path)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def atomic_write(path: PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` and move ``tmp`` onto ``path`` atomically.

    Args:
        path: The file to write.
        write: Writes the content to the temp path it is given.

    Returns:
        ``path``, ``~`` expanded.

    Raises:
        OutputError: Writing failed (a full disk, a lost mount); whatever ``path`` held is left as it is.
    """
    try:
        with atomic_path(path) as tmp:
            write(tmp)
    except OutputError:
        raise
    except OSError as error:
        raise OutputError(f"cannot write {path}: {error.strerror or error}; the previous file (if any) is unchanged; "
                          "make room or choose another path and run again") from error
    return Path(path).expanduser()


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; done once, at import
    os.umask(mask)
    return mask


_UMASK = _umask()


def print_summary(summary: dict, as_json: bool) -> None:
    """Print a command's summary on stdout.

    Args:
        summary: The summary; a value that is a list of dicts prints as a table.
        as_json: Print JSON (non-finite numbers as ``null``) instead of one ``key: value`` line per entry.
    """
    if as_json:
        # JSON has no NaN: a number that was not measured (a fraction of a zero effect) is null.
        print(json.dumps(_json_safe(summary), indent=2, default=str, allow_nan=False))
        return
    for key, value in summary.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            import pandas as pd

            print(f"{key}:")
            print(pd.DataFrame(value).to_string(index=False))
        else:
            print(f"{key}: {value}")


def _json_safe(value):
    """``value`` with every non-finite float replaced by ``None``, through dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def fail(command: str, error: BaseException, code: int, as_json: bool) -> int:
    """Report a failed command: one line on stderr and, with ``as_json``, a JSON object on stdout.

    Args:
        command: The command's name, for the message.
        error: What went wrong.
        code: The exit code to return.
        as_json: Also print ``{command, error, error_type, exit_code}`` as JSON on stdout.

    Returns:
        ``code``.
    """
    print(f"arithinterp {command}: error: {error}", file=sys.stderr)
    if as_json:
        print(json.dumps(dict(command=command, error=str(error), error_type=type(error).__name__, exit_code=code),
                         indent=2))
    return code
