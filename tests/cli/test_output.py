"""lathe.cli.output: what the `lathe` command prints, and what it keeps transformers, huggingface_hub and Ray from
printing."""

from __future__ import annotations

import io
import logging
import os
import re

import pytest

from lathe.cli.output import RAY_AUTH_LOGGER, log_handler, quiet_libraries


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def env(monkeypatch):
    """A private copy of the environment, and transformers' / Ray's logging state restored afterwards."""
    from transformers.utils import logging as transformers_logging
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "RAY_COLOR_PREFIX", "NO_COLOR")})
    monkeypatch.setattr(transformers_logging, "_tqdm_active", True)
    monkeypatch.setattr(logging.getLogger(RAY_AUTH_LOGGER), "filters", [])
    return os.environ


def test_third_party_bars_are_off_and_ray_prefixes_plain_when_redirected(env):
    from transformers.utils import logging as transformers_logging
    quiet_libraries()                                   # (pytest's streams are no terminals)
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and not transformers_logging.is_progress_bar_enabled()
    assert env["RAY_COLOR_PREFIX"] == "0"


def test_ray_keeps_its_colours_on_a_terminal_unless_no_color(env, monkeypatch):
    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.setattr("sys.stderr", Terminal())
    quiet_libraries()
    assert "RAY_COLOR_PREFIX" not in env
    env["NO_COLOR"] = "1"
    quiet_libraries()
    assert env["RAY_COLOR_PREFIX"] == "0"


def test_a_users_choice_wins(env):
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "0"
    env["RAY_COLOR_PREFIX"] = "1"
    quiet_libraries()
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "0" and env["RAY_COLOR_PREFIX"] == "1"


def test_only_rays_notice_that_token_authentication_is_on_is_dropped(env):
    quiet_libraries()
    quiet_libraries()                                   # (twice: one filter)
    ray_auth = logging.getLogger(RAY_AUTH_LOGGER)
    record = lambda text: logging.LogRecord(RAY_AUTH_LOGGER, logging.WARNING, "x.py", 1, text, None, None)  # noqa: E731
    assert len(ray_auth.filters) == 1
    assert not ray_auth.filter(record("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=..."))
    assert ray_auth.filter(record("Token authentication is disabled for this Ray cluster. Anyone with network ..."))


def test_torchaos_import_notices_are_dropped_on_a_machine_without_cuda(env, monkeypatch):
    """transformers imports torchao when it is installed (lathe's fp8 extra): its CUDA libraries failing to load on
    a CPU machine, and torch's Enum-constant deprecation at its import, are not the user's to act on."""
    quiet_libraries()
    quiet_libraries()
    record = lambda name, text: logging.LogRecord(name, logging.WARNING, "x.py", 1, text, None, None)  # noqa: E731
    ao, tree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert len(ao.filters) == 1 and len(tree.filters) == 1
    missing = "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library: /x/torchao/_C_mxfp8.so"
    monkeypatch.setattr("lathe.device.device_count", lambda device_type=None: 0)
    assert not ao.filter(record("torchao", missing))
    assert ao.filter(record("torchao", "Float8Linear: something else"))
    monkeypatch.setattr("lathe.device.device_count", lambda device_type=None: 1)
    assert ao.filter(record("torchao", missing))                      # with CUDA a failed library is worth seeing
    assert not tree.filter(record("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now "
                                  "natively supported by torch.compile as an opaque value type."))
    assert tree.filter(record("torch.utils._pytree", "something else"))


def test_log_lines_are_stamped_and_a_repeated_warning_prints_once(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    handler = log_handler()
    for level, text in ((logging.INFO, "warm start: 80 supervised steps"), (logging.WARNING, "no effect on cpu"),
                        (logging.WARNING, "no effect on cpu")):
        handler.handle(logging.LogRecord("lathe", level, "x.py", 1, text, None, None))
    assert re.fullmatch(r"\d\d:\d\d:\d\d lathe: warm start: 80 supervised steps\n\d\d:\d\d:\d\d lathe: no effect on "
                        r"cpu\n", err.getvalue()), err.getvalue()
