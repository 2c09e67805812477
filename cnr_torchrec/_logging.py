"""What the library prints when the application has not configured logging: one line per event, with the rank.

Every module logs under the ``cnr_torchrec`` logger. A restore, a fallback to an older checkpoint,
a save that was skipped: these are INFO and WARNING records, and with Python's defaults an
application that configured no logging would see the warnings only, bare, and never the INFO
lines. :func:`install_default_handler` (called when a ``Checkpointer`` is built) therefore gives
the ``cnr_torchrec`` logger a handler of its own that writes to stderr::

    [cnr rank 1] restored checkpoint 4 (step 200, chain [1, 2, 3, 4])
    [cnr rank 0] WARNING: restored checkpoint 3 (step 150) instead of newer ones: ...

It gives way as soon as the application has a say:

- It is not added when the ``cnr_torchrec`` logger already has a handler, or the root logger has
  one that the application set up (``logging.basicConfig(format=..., force=True)``, a framework's
  set-up, pytest's capture). The one plain stderr handler that fbgemm_gpu's import leaves on the
  root (see :func:`_import_side_effect`) does not count.
- While it writes, the ``cnr_torchrec`` logger does not propagate, so that root handler does not
  print the record a second time.
- When the application configures logging later (after the Checkpointer was built), the handler
  retires at the next record: it goes silent, the logger propagates again and gets back the level
  it had, and from then on the application's handlers print each record once, at its levels.
- ``CNR_TORCHREC_LOG=off`` (or ``0``, ``false``, ``no``, ``none``) never adds it; a level name
  (``debug``, ``info``, ``warning``, ``error``) sets the least severe record it prints (``info``
  when unset). An application can also silence the library the standard way, with
  ``logging.getLogger("cnr_torchrec").addHandler(logging.NullHandler())`` or a level on that logger.

torchrun's own modules set their loggers' levels from ``LOGLEVEL`` and leave handlers to the
application; torchtitan's ``init_logger`` takes over the root logger. A library must not do the
latter, so this handler is the library's alone and gives way to any the application sets up.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from cnr_torchrec.errors import ConfigError

__all__ = ["ENV_VAR", "LOGGER_NAME", "install_default_handler"]

LOGGER_NAME = "cnr_torchrec"
ENV_VAR = "CNR_TORCHREC_LOG"

_OFF = frozenset({"0", "off", "false", "none", "no"})
_INSTALL_LOCK = threading.Lock()
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _rank() -> str | None:
    """This process's rank: the default process group's, else torchrun's ``RANK``; None for a lone process."""
    torch_dist = sys.modules.get("torch.distributed")  # never import torch for a log line
    try:
        if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
            return str(torch_dist.get_rank())
    except RuntimeError:  # a group being torn down
        pass
    return os.environ.get("RANK")


class _Formatter(logging.Formatter):
    """``[cnr rank R] message``; a warning or worse also names its level."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rank = _rank()
        prefix = f"[cnr rank {rank}]" if rank is not None else "[cnr]"
        level = f"{record.levelname}: " if record.levelno > logging.INFO else ""
        return f"{prefix} {level}{text}"


def _import_side_effect(root: logging.Logger) -> bool:
    """Whether the root logger's handlers are just what an argument-free ``logging.basicConfig()`` leaves.

    fbgemm_gpu logs through the root logger (``logging.info``) while it is imported; with no handler
    anywhere, that call runs ``basicConfig()``, which gives the root one plain stderr handler and
    keeps its WARNING level. Every process that imports torchrec has it, so it is no sign that the
    application configured logging; and a later ``basicConfig(level=logging.INFO)`` does nothing
    because of it (``force=True`` does).
    """
    if len(root.handlers) != 1 or root.level != logging.WARNING:
        return False
    handler = root.handlers[0]
    formatter = handler.formatter
    return (type(handler) is logging.StreamHandler and handler.level == logging.NOTSET and formatter is not None
            and formatter._fmt == logging.BASIC_FORMAT)


def _application_configured(library: logging.Logger, ours: logging.Handler | None = None) -> bool:
    """Whether the application set up logging: a handler on the library's logger, or on the root beyond
    the one an import leaves (see :func:`_import_side_effect`)."""
    if any(h is not ours for h in library.handlers):
        return True
    root = logging.getLogger()
    return bool(root.handlers) and not _import_side_effect(root)


class _DefaultHandler(logging.Handler):
    """Writes the library's records to the current ``sys.stderr`` until the application configures logging.

    While it writes, the library's logger does not propagate, so that the root handler an import left
    behind does not print a record a second time.
    """

    def __init__(self, level: int, logger: logging.Logger, *, level_set: bool, propagate: bool) -> None:
        super().__init__(level)
        self.setFormatter(_Formatter("%(message)s"))
        self._logger = logger
        self._level_set = level_set  # the logger's level is ours to give back
        self._propagate = propagate  # what the logger's propagate was
        self.retired = False

    def _retire(self, record: logging.LogRecord) -> None:
        # Not removed from the logger: this runs inside Logger.callHandlers, which is iterating over that list.
        self.retired = True
        if self._level_set and self._logger.level == self.level:
            self._logger.setLevel(logging.NOTSET)
        # The record in hand goes on to the application's handlers (propagating again) if its levels let it
        # through; else propagation comes back with the next record, which passed those levels.
        if logging.getLogger(record.name).isEnabledFor(record.levelno):
            self._logger.propagate = self._propagate

    def emit(self, record: logging.LogRecord) -> None:
        if self.retired:
            self._logger.propagate = self._propagate
            return
        if _application_configured(self._logger, self):
            self._retire(record)  # its handlers and levels decide from now on
            return
        try:
            stream = sys.stderr  # looked up each time, as logging.lastResort does: a redirected stderr is honoured
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - a log line must not break the job; reported as logging's handlers do
            self.handleError(record)


def _configured_level() -> int | None:
    """The level ``CNR_TORCHREC_LOG`` asks for: INFO when unset, None for off.

    Raises:
        ConfigError: a value that is neither off nor a level name; the message lists both.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return logging.INFO
    if value in _OFF:
        return None
    if value in _LEVELS:
        return _LEVELS[value]
    raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: give off (or 0) to keep the library's log lines off "
                      f"stderr, or one of {sorted(_LEVELS)} for the least severe line it prints")


def install_default_handler() -> bool:
    """Gives the ``cnr_torchrec`` logger its stderr handler, unless the application configured logging.

    Idempotent: later calls find the handler (or the application's) and do nothing. Call it when the
    library is first used rather than at import, so that a ``logging.basicConfig`` between the import
    and that use is seen.

    Returns:
        Whether the handler was added by this call.

    Raises:
        ConfigError: ``CNR_TORCHREC_LOG`` holds neither off nor a level name.
    """
    level = _configured_level()
    logger = logging.getLogger(LOGGER_NAME)
    with _INSTALL_LOCK:  # two Checkpointers built at once add one handler
        if level is None or logger.handlers or _application_configured(logger):
            return False
        level_set = logger.level == logging.NOTSET
        if level_set:  # INFO records must get past the root's WARNING to reach the handler
            logger.setLevel(level)
        logger.addHandler(_DefaultHandler(level, logger, level_set=level_set, propagate=logger.propagate))
        logger.propagate = False
    return True
