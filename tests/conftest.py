"""Shared fixtures: tiny random-weight Hugging Face models, saved locally with a locally trained tokenizer."""

from __future__ import annotations

import os
import tempfile

# Compile caches of the tests live in a throwaway folder, never in the user's ~/.cache (set before Kiln reads its
# environment, once, at import).
os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-cache-"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.models import make_tiny_model_dir  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on the CPU; it must be chosen before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.fixture(scope="session")
def tiny_model_dir_qwen3(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def tiny_moe_dir(request, tmp_path_factory) -> Path:
    """Mixtral (every layer sparse), Qwen3-MoE (a dense layer by decoder_sparse_step) and Qwen2-MoE (a dense layer
    by mlp_only_layers, a gated shared expert)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def tiny_hybrid_dir(request, tmp_path_factory) -> Path:
    """The Gated DeltaNet hybrids: Qwen3.5 (dense, tied embeddings), Qwen3.5-MoE (every layer sparse, a shared
    expert) and Qwen3-Next (its fused projections; a dense layer by mlp_only_layers)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
