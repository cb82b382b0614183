"""What the `lathe` command prints, and what it keeps other libraries from printing.

Every line lathe logs is stamped ``HH:MM:SS lathe: ...`` and goes above the live progress line of a terminal
(`lathe.track.progress`); a warning repeated word for word (by each role, rank or step) prints once. The libraries
lathe drives are quietened for the command only (importing lathe changes nothing): transformers' and
huggingface_hub's progress bars ("Loading weights", "Writing model shards") are off, Ray's worker-log prefixes
carry no colour codes unless both streams are terminals (and ``NO_COLOR`` is unset), Ray's notice that
token authentication is on for the local cluster it starts is not shown (authentication stays on), nor are torchao's
import-time notices (its CUDA libraries on a machine without CUDA, torch's Enum-constant deprecation).
A variable the user set wins over all of these.
"""

from __future__ import annotations

import logging
import os
import sys

from lathe.track.progress import LOG_FORMAT, TIME_FORMAT, LiveLineHandler, Once, is_terminal

# Ray logs this when ray.init() starts a local cluster with token authentication on (its default): a notice about
# a setting that protects the cluster, with nothing to do for the run. (Its warning that authentication is *off*
# is kept.)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_ON = "Token authentication is enabled"


def setup_output() -> None:
    """Log lines with timestamps above the live line, warnings once, no third-party bars or colours."""
    logging.basicConfig(level=logging.INFO, handlers=[log_handler()])   # (no-op where logging is set up already)
    quiet_libraries()


def log_handler() -> logging.Handler:
    """``HH:MM:SS lathe: message`` to stderr, above the live line; a warning repeated word for word once."""
    handler = LiveLineHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=TIME_FORMAT))
    handler.addFilter(Once())
    return handler


def quiet_libraries() -> None:
    """No progress bars from transformers / huggingface_hub, no colour codes in Ray's prefixes when the output is
    not a terminal, no Ray notice that token authentication is on; set in the environment, so Ray's workers
    inherit it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        if "huggingface_hub" in sys.modules:         # read at import: an imported module is told directly
            from huggingface_hub.utils import disable_progress_bars
            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging
            transformers_logging.disable_progress_bar()
    if os.environ.get("NO_COLOR") or not (is_terminal(sys.stdout) and is_terminal(sys.stderr)):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for name, drop in ((RAY_AUTH_LOGGER, _DropRayAuthOn), ("torchao", _DropTorchaoCudaLibs),
                       ("torch.utils._pytree", _DropEnumConstantNotice)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, drop) for f in logger.filters):
            logger.addFilter(drop())


class _DropRayAuthOn(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_AUTH_ON)


class _DropTorchaoCudaLibs(logging.Filter):
    """torchao (which transformers imports whenever it is installed: lathe's `fp8` extra) warns that its CUDA-only
    kernel libraries failed to load on a machine without CUDA; the import goes on without them, and nothing on such
    a machine uses them. Kept where CUDA is there (a broken install is worth seeing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from lathe import device
        return not ("Could not load this library" in record.getMessage() and device.device_count("cuda") == 0)


class _DropEnumConstantNotice(logging.Filter):
    """torch's deprecation notice, at torchao's import, that registering Enum subclasses as pytree constants is no
    longer needed: torchao's to act on, not the user's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()
