"""Starting, watching and stopping one SGLang server process; private to :mod:`rlhfkit.engines.sglang`.

:class:`SGLangServer` launches ``python -m sglang.launch_server`` (its own interpreter or site directory) with its
output in a log file, waits for ``/health`` within ``startup_timeout_s`` while checking that the process lives, and
quotes the log's tail in every start-up or death error. It can also attach to a server someone else started (then it
neither waits for a process nor stops one). Standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from rlhfkit._ports import free_listen_port
from rlhfkit.engines.sglang._config import SGLANG_VERSION, SGLangEngineConfig, server_command, server_environment
from rlhfkit.engines.sglang._http import SGLangClient, SGLangServerError, SGLangStartError

__all__ = ["SGLangNotInstalledError", "SGLangServer", "log_tail"]

logger = logging.getLogger(__name__)
_TAIL_LINES = 30


class SGLangNotInstalledError(ImportError):
    """The configured interpreter does not exist or cannot import ``sglang``."""


def log_tail(path: str | Path | None, lines: int = _TAIL_LINES) -> str:
    if path is None or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


def _install_hint(config: SGLangEngineConfig) -> str:
    return (f"install sglang=={SGLANG_VERSION} into an environment of its own (it cannot share one with vLLM): "
            f"python3 -m venv /opt/sglang && /opt/sglang/bin/pip install 'sglang=={SGLANG_VERSION}', then pass "
            "SGLangEngineConfig(python='/opt/sglang/bin/python'), or put its site directory in "
            "SGLangEngineConfig(env={'PYTHONPATH': ...}) (offline GPU machine: bench/peers/fetch-sglang-wheels.sh)")


class SGLangServer:
    """One SGLang server: started with :meth:`launch` or reached with :meth:`attach`; ``client`` talks to it."""

    def __init__(self, config: SGLangEngineConfig, url: str, *, engine_index: int,
                 process: subprocess.Popen | None = None, log_path: str | None = None) -> None:
        self.config, self.url, self.engine_index = config, url, engine_index
        self.process, self.log_path = process, log_path
        self.client = SGLangClient(url, engine_index=engine_index, describe_death=self.describe)

    @classmethod
    def attach(cls, config: SGLangEngineConfig, *, engine_index: int = 0) -> SGLangServer:
        """A server already running at ``config.url`` (checked with ``/health`` within ``health_timeout_s``)."""
        assert config.url is not None
        server = cls(config, config.url, engine_index=engine_index)
        server.client.request("/health", method="GET", timeout_s=config.health_timeout_s, expect_json=False)
        return server

    @classmethod
    def launch(cls, config: SGLangEngineConfig, *, engine_index: int = 0) -> SGLangServer:
        """Start the server and wait (``startup_timeout_s``) until ``/health`` answers 200."""
        env = server_environment(config, os.environ)
        cls._check_installed(config, env, engine_index)
        port = config.port or free_listen_port(host=config.host)
        if config.log_path is not None:
            log_path = config.log_path
        else:
            handle, log_path = tempfile.mkstemp(prefix=f"rlhfkit-sglang-{engine_index}-", suffix=".log")
            os.close(handle)
        command = server_command(config, port=port, engine_index=engine_index)
        logger.info("engine %d: starting SGLang: %s (log %s)", engine_index, " ".join(command), log_path)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = cls(config, f"http://{config.host}:{port}", engine_index=engine_index, process=process,
                     log_path=log_path)
        try:
            server._wait_healthy(time.monotonic() + config.startup_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    @staticmethod
    def _check_installed(config: SGLangEngineConfig, env: dict[str, str], engine_index: int) -> None:
        probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
        try:
            result = subprocess.run([config.python, "-c", probe], env=env, capture_output=True, timeout=60, check=False)
        except FileNotFoundError as error:
            raise SGLangNotInstalledError(f"engine {engine_index}: SGLangEngineConfig.python={config.python!r} does "
                                          f"not exist; {_install_hint(config)}") from error
        except subprocess.TimeoutExpired as error:
            raise SGLangNotInstalledError(f"engine {engine_index}: {config.python!r} did not answer within 60 s "
                                          "when asked whether it has sglang") from error
        if result.returncode != 0:
            raise SGLangNotInstalledError(f"engine {engine_index}: {config.python!r} cannot import sglang "
                                          f"(exit {result.returncode}); {_install_hint(config)}")

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            code = self.process.poll() if self.process is not None else None
            if code is not None:
                raise SGLangStartError(f"engine {self.engine_index}: the SGLang server exited with code {code} "
                                       f"during start-up; last lines of {self.log_path}:\n{log_tail(self.log_path)}",
                                       engine_index=self.engine_index)
            try:
                self.client.request("/health", method="GET", timeout_s=5.0, expect_json=False)
                return
            except SGLangServerError:
                pass  # not listening yet, or 503 while loading
            if time.monotonic() >= deadline:
                raise SGLangStartError(f"engine {self.engine_index}: the SGLang server at {self.url} did not answer "
                                       f"/health within startup_timeout_s={self.config.startup_timeout_s:g} s; last "
                                       f"lines of {self.log_path}:\n{log_tail(self.log_path)}",
                                       engine_index=self.engine_index)
            time.sleep(0.2)

    def describe(self) -> str:
        """What is known about the process: its exit code and log tail once it has exited."""
        if self.process is None:
            return ""
        code = self.process.poll()
        if code is None:
            return f"its process {self.process.pid} is still running"
        return f"its process {self.process.pid} exited with code {code}; last lines of {self.log_path}:\n" \
               f"{log_tail(self.log_path, 10)}"

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop a server this object started (its whole process group: SGLang's scheduler and detokenizer too)."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
