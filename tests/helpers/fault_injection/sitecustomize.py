"""Test-only fault injection for processes the tests cannot monkeypatch (a server's engine core): with
TEST_FAULT_TOKEN=N set and this folder on PYTHONPATH (`helpers.server.Server(fault_token=N)`), Python loads this
module at start-up in every process, and a model-runner step fails when a request's prompt holds token id N; with
TEST_SLOW_TOKEN=M (`slow_token=M`), a step holding token id M first sleeps TEST_SLOW_SECONDS (a long prefill); with
TEST_STALL_SECONDS=S (`stall_seconds=S`), the API server's POST /tokenize with an `X-Test-Stall` header sleeps S seconds
on its event loop (a stall of the server's own); with TEST_SERVER_FAULT_TOKEN=K (`server_fault_token=K`), the API server
raises a plain exception (a bug of its own) when a request is handed token id K.

Each patch is made when its module is first imported (never before: the API-server process, which never imports the
model runner, stays as it is, and the engine core never imports the API server)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

RUNNER = "kiln.engine.worker.model_runner"
API_SERVER = "kiln.engine.serving.api_server"
RESPONSES = "kiln.engine.serving.responses"


def failing_launch(launch, token: int):
    """`ModelRunner.launch`, failing a step when a request's prompt holds `token` (tests in-process patch with it)."""

    def launch_or_fail(self, batch):
        if any(token in request.prompt_token_ids for request in batch.requests):
            raise RuntimeError("injected fault (TEST_FAULT_TOKEN)")
        return launch(self, batch)

    return launch_or_fail


def slow_launch(launch, token: int, seconds: float):
    """`ModelRunner.launch`, sleeping `seconds` first in a step where a request's prompt holds `token`."""

    def launch_slowly(self, batch):
        if any(token in request.prompt_token_ids for request in batch.requests):
            time.sleep(seconds)
        return launch(self, batch)

    return launch_slowly


def stalling_tokenize(tokenize, seconds: float):
    """The API server's `_tokenize` handler, first blocking its event loop `seconds` for a request marked so."""

    async def tokenize_or_stall(request):
        if request.headers.get("X-Test-Stall"):
            time.sleep(seconds)  # NOTE: on the event loop, on purpose: nothing else in the server runs meanwhile
        return await tokenize(request)

    return tokenize_or_stall


def failing_apply_output(apply_output, token: int):
    """The API server's `responses.apply_output`, raising a RuntimeError when an output holds `token`."""

    def apply_or_fail(state, choice, out):
        if token in out.new_token_ids:
            raise RuntimeError("injected fault (TEST_SERVER_FAULT_TOKEN)")
        return apply_output(state, choice, out)

    return apply_or_fail


def _patch(module) -> None:
    if module.__name__ == RESPONSES:
        module.apply_output = failing_apply_output(module.apply_output, int(os.environ["TEST_SERVER_FAULT_TOKEN"]))
        return
    if module.__name__ == API_SERVER:
        module._tokenize = stalling_tokenize(module._tokenize, float(os.environ["TEST_STALL_SECONDS"]))
        return
    if os.environ.get("TEST_FAULT_TOKEN"):
        module.ModelRunner.launch = failing_launch(module.ModelRunner.launch, int(os.environ["TEST_FAULT_TOKEN"]))
    if os.environ.get("TEST_SLOW_TOKEN"):
        seconds = float(os.environ.get("TEST_SLOW_SECONDS", "5"))
        module.ModelRunner.launch = slow_launch(module.ModelRunner.launch, int(os.environ["TEST_SLOW_TOKEN"]), seconds)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str) -> None:
        self.target = target

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # find the real module below this finder, once
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("TEST_FAULT_TOKEN") or os.environ.get("TEST_SLOW_TOKEN"):
    sys.meta_path.insert(0, _PatchOnImport(RUNNER))
if os.environ.get("TEST_STALL_SECONDS"):
    sys.meta_path.insert(0, _PatchOnImport(API_SERVER))
if os.environ.get("TEST_SERVER_FAULT_TOKEN"):
    sys.meta_path.insert(0, _PatchOnImport(RESPONSES))
