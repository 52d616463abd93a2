"""Helpers of the engine side of a weight push, free of vLLM so that tests import them cheaply.

worker_transfer_backend.ObjectStoreWeightTransferEngine (in vLLM's engine-core process) uses
them: the tied-lm_head fix and the filter for vLLM's uninformative reload warnings. Keep it
small and free of Ray and of the worker: it runs inside vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# HF names of the input embedding and output projection of decoder-only causal LMs.
_EMBED_WEIGHT = "model.embed_tokens.weight"
_LM_HEAD_WEIGHT = "lm_head.weight"
_LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_FAILED_TO_LOAD_MSG = "%s: Failed to load weights"
# Layers whose only tensors are buffers vLLM computes from the config (the rotary cos/sin cache):
# no checkpoint or push ever carries them, so vLLM's layerwise reload warns "Failed to load
# weights" for each of them on every push (once per decoder layer) while restoring them correctly.
_BUFFER_ONLY_LAYER_SUFFIXES = ("RotaryEmbedding",)


class UninformativeReloadWarnings(logging.Filter):
    """Drops vLLM's per-layer "<Layer>: Failed to load weights" warnings for buffer-only layers
    (_BUFFER_ONLY_LAYER_SUFFIXES), and only those: the same warning for any other layer means a
    pushed update missed its weights, and stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _FAILED_TO_LOAD_MSG or not record.args:
            return True
        layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
        return not layer.endswith(_BUFFER_ONLY_LAYER_SUFFIXES)


def install_reload_warning_filter() -> None:
    """Attach UninformativeReloadWarnings to vLLM's layerwise-reload logger, once per process."""
    reload_logger = logging.getLogger(_LAYERWISE_RELOAD_LOGGER)
    if not any(isinstance(f, UninformativeReloadWarnings) for f in reload_logger.filters):
        reload_logger.addFilter(UninformativeReloadWarnings())


def with_tied_lm_head(weights: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    """Add `lm_head.weight` (= the embedding) for a model with tied embeddings.

    HF checkpoints of tied models omit lm_head.weight. On vLLM's in-place reload a layer that
    receives no weights keeps its old processed kernel: on the CPU backend the lm_head's
    prepacked GEMM weight stays the old embedding even though the shared parameter changed.
    Feeding the tensor under the lm_head name makes vLLM reprocess that layer too.
    """
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if tied and _LM_HEAD_WEIGHT not in weights and _EMBED_WEIGHT in weights:
        return {**weights, _LM_HEAD_WEIGHT: weights[_EMBED_WEIGHT]}
    return weights
