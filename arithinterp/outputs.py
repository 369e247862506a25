"""Writing outputs: the one guarded writer every file the package writes goes through, and what a
command prints (its summary, or its error) for both command lines, ``arithinterp`` and
``python -m arithinterp.sweep``.

**The writer.** :func:`write_file` (a file), :func:`write_folder` (a folder written whole) and
:func:`write_figure` (a plotly figure as one offline HTML file) are how results, the report's page,
figures, the other tools' formats, sweeps and transcoders reach the disk; new code that writes a
file calls them (``tests/test_files.py`` fails on a write made any other way). Each one:

* **refuses an occupied path** — a file that exists, a folder that holds anything — unless
  ``overwrite`` is ``True``; ``overwrite`` is a strict bool (``"no"``, ``1`` or ``None`` is a
  :class:`~arithinterp.errors.ConfigError`, never read as true);
* **never writes through a symbolic link out of its folder**: a path that is a link to somewhere
  outside the folder it sits in is refused; a link inside the folder is replaced, not followed;
* **writes atomically**: the content goes to a temporary sibling (a file, or a whole folder) that is
  renamed onto the path only once it is complete, so a reader, a crash or Ctrl-C sees the old
  content or the new, never half of either;
* **keeps the old content until the new is complete** with ``overwrite=True``: a writer that fails
  part way leaves the path as it was and no temporary file behind.

:func:`check_target` makes the same checks without writing, for a command to run before minutes of
work that end in a write. :func:`writes` registers a public function that writes, so that the test
of these guarantees walks every one of them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

from arithinterp.errors import ConfigError, OutputError

PathLike = Union[str, "os.PathLike[str]"]
_F = TypeVar("_F", bound=Callable[..., Any])

#: The ending of the writer's temporary files and folders (``.NAME.<random>.tmp`` beside ``NAME``): a process
#: killed mid-write leaves one behind, never a half-written ``NAME``.
TEMP_SUFFIX = ".tmp"
#: The public functions that write files, by qualified name (see :func:`writes`).
WRITERS: dict[str, Callable[..., Any]] = {}


def writes(fn: _F) -> _F:
    """Register ``fn`` as a public function that writes files through this module's writer (and so
    keeps its guarantees); ``tests/test_files.py`` checks each registered one.

    Args:
        fn: The function or method.

    Returns:
        ``fn``, unchanged.
    """
    WRITERS[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


def check_overwrite(overwrite: Any, what: str = "overwrite") -> bool:
    """Read ``overwrite`` strictly: ``True`` or ``False`` and nothing else.

    Args:
        overwrite: The value given.
        what: The parameter (or flag) to name in the error.

    Returns:
        ``overwrite``.

    Raises:
        ConfigError: ``overwrite`` is not a bool (``"no"``, ``1``, ``None``).
    """
    if not isinstance(overwrite, bool):
        raise ConfigError(f"{what} must be True or False, got {overwrite!r} ({type(overwrite).__name__}); "
                          "a path is replaced only when it is exactly True")
    return overwrite


def _flag(what: str) -> str:
    return "--overwrite" if what.startswith("--") else "overwrite=True"


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


def _link_out(path: Path) -> Union[Path, None]:
    """Where ``path`` leads when it is a symbolic link to a place outside its own folder, else None."""
    if not path.is_symlink():
        return None
    folder, target = path.parent.resolve(), path.resolve()
    return None if target.parent == folder or folder in target.parents else target


def check_target(path: PathLike, *, overwrite: Any, what: str = "out", folder: bool = False) -> Path:
    """Check that :func:`write_file` (or :func:`write_folder`, with ``folder``) may write ``path``,
    without writing it: run before the work whose output it is, so a bad path never costs the work.

    Args:
        path: The file (or folder) to write.
        overwrite: Whether an occupied path may be replaced; strictly a bool.
        what: The parameter or flag to name in the error (``"out"``, ``"--out"``).
        folder: ``path`` is a folder written whole, not a file.

    Returns:
        ``path``, ``~`` expanded.

    Raises:
        ConfigError: ``overwrite`` is not a bool; ``path`` is empty, a symbolic link out of its folder,
            a folder where a file is written or the reverse, occupied (a file that exists, a folder that
            holds anything) without ``overwrite``, or in a folder that cannot be written.
    """
    check_overwrite(overwrite, "--overwrite" if what.startswith("--") else "overwrite")
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ConfigError(f"{what}: {path!r} names no file or folder; give a path")
    target = Path(path).expanduser()
    outside = _link_out(target)
    if outside is not None:
        raise ConfigError(f"{what}: {path} is a symbolic link to {outside}, outside the folder it is in; "
                          "nothing is written through it: remove the link or give another path")
    if folder:
        if target.exists() and not target.is_dir():
            raise ConfigError(f"{what}: {path} exists and is not a directory; give a directory")
        if not overwrite and (target.is_symlink() or (target.is_dir() and any(target.iterdir()))):
            raise ConfigError(f"{what}: {path} already holds files; pass {_flag(what)} to replace them, "
                              "or give another folder")
    else:
        if target.is_dir() and not target.is_symlink():
            raise ConfigError(f"{what}: {path} is a directory; give a file name")
        if str(path).endswith(("/", os.sep)):  # Path() drops the slash, and a file would take the folder's name
            raise ConfigError(f"{what}: {path} ends with {str(path)[-1]!r}, so it names a folder; give a file name "
                              f"inside it, such as {Path(path) / 'out.html'}")
        if not overwrite and os.path.lexists(target):
            raise ConfigError(f"{what}: {path} already exists; pass {_flag(what)} to replace it, or give another file")
    _probe(target.parent, what, path)
    return target


@contextlib.contextmanager
def _temporary(path: Path, folder: bool) -> Iterator[Path]:
    """A temp file (or folder) beside ``path``, removed when the block leaves it behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def write_folder(path: PathLike, *, overwrite: Any, what: str = "out") -> Iterator[Path]:
    """Write a folder whole: fill the temp folder this yields; when the block ends it takes the place of
    ``path`` (see the module docstring for the guarantees).

    Args:
        path: The folder to write.
        overwrite: Replace a folder that holds files (strictly a bool).
        what: The parameter or flag to name in an error.

    Yields:
        The temp folder to write into (a sibling of ``path``, so the final rename stays on one file system).

    Raises:
        ConfigError: ``path`` may not be written (:func:`check_target`).
        OutputError: Writing failed (a full disk, a lost mount); ``path`` is unchanged.
    """
    target = check_target(path, overwrite=overwrite, what=what, folder=True)
    try:
        with _temporary(target, folder=True) as tmp:
            yield tmp
            os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700; a normal folder is what users expect
            check_target(target, overwrite=overwrite, what=what, folder=True)  # occupied meanwhile?
            _move_into_place(tmp, target)
    except OSError as error:
        if isinstance(error, OutputError):
            raise
        raise OutputError(f"cannot write {path}: {error.strerror or error}; {path} is unchanged; make room or "
                          "choose another path and run again") from error


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


Content = Union[str, bytes, Callable[[Path], object]]


def write_file(path: PathLike, content: Content, *, overwrite: Any, what: str = "out") -> Path:
    """Write one file through the guarded writer (see the module docstring).

    Args:
        path: The file.
        content: The text (UTF-8), the bytes, or a function that writes the content to the temp path
            it is given (``lambda tmp: save_file(tensors, str(tmp))``).
        overwrite: Replace a file that exists (strictly a bool).
        what: The parameter or flag to name in an error.

    Returns:
        ``path``, ``~`` expanded.

    Raises:
        ConfigError: ``path`` may not be written (:func:`check_target`).
        OutputError: Writing failed (a full disk, a lost mount); whatever ``path`` held is left as it is.
    """
    target = check_target(path, overwrite=overwrite, what=what)
    try:
        with _temporary(target, folder=False) as tmp:
            if isinstance(content, str):
                tmp.write_text(content, encoding="utf-8")
            elif isinstance(content, bytes):
                tmp.write_bytes(content)
            else:
                content(tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a normal file is what users expect
            if not overwrite and os.path.lexists(target):  # made meanwhile by another program
                raise ConfigError(f"{what}: {path} appeared while it was written; pass {_flag(what)} to replace "
                                  "it, or give another file")
            os.replace(tmp, target)
    except OutputError:
        raise
    except OSError as error:
        raise OutputError(f"cannot write {path}: {error.strerror or error}; the previous file (if any) is unchanged; "
                          "make room or choose another path and run again") from error
    return target


def write_tensors(path: PathLike, tensors: dict, *, overwrite: Any, metadata: Optional[dict] = None,
                  what: str = "out") -> Path:
    """Write tensors to one safetensors file through :func:`write_file` (the package's only weight format).

    Args:
        path: The file.
        tensors: The tensors by name (contiguous).
        overwrite: Replace an existing file (strictly a bool).
        metadata: The header's string metadata.
        what: The parameter or flag to name in an error.

    Returns:
        The file's path.
    """
    from safetensors.torch import save_file

    return write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), overwrite=overwrite,
                      what=what)


def write_figure(figure: Any, path: PathLike, *, overwrite: Any, what: str = "figure") -> Path:
    """Write a plotly figure as one self-contained HTML file (plotly.js inlined: it opens offline).

    Args:
        figure: A plotly ``Figure`` (anything with ``write_html``).
        path: The ``.html`` file.
        overwrite: Replace a file that exists (strictly a bool).
        what: The parameter or flag to name in an error.

    Returns:
        ``path``, ``~`` expanded.

    Raises:
        ConfigError: ``figure`` has no ``write_html``, or ``path`` may not be written.
        OutputError: Writing failed.
    """
    if not callable(getattr(figure, "write_html", None)):
        raise ConfigError(f"{what}: a plotly Figure is written, got {type(figure).__name__}")
    return write_file(path, lambda tmp: figure.write_html(str(tmp), include_plotlyjs=True), overwrite=overwrite,
                      what=what)


writes(write_file)
writes(write_figure)


def check_writable_dir(path: PathLike, what: str = "out") -> Path:
    """Make sure ``path`` is (or can be made) a directory this process can write in: for a folder a
    command adds its own files to (a sweep's results, memory-mapped activations).

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
