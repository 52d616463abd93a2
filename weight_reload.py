"""The engine side of a weight push: what vLLM's engine-core process imports and runs.

GenerationWorker names `WeightReloadExtension` as vLLM's `worker_extension_cls`, so the engine
core imports this module (and only what it imports) and mixes the class into its worker; the
generation worker then calls `RELOAD_WEIGHTS_RPC` by name through `collective_rpc`, one
shared-memory safetensors file per reload bucket (weight_files.py). Keep it small and free of
Ray and of the worker: it runs inside vLLM.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator

logger = logging.getLogger(__name__)

# Name of the `WeightReloadExtension` method that collective_rpc calls inside the engine. vLLM
# mixes the extension into its worker class and refuses names the worker already has, hence
# the project prefix.
RELOAD_WEIGHTS_RPC = "grpo_reload_weights_from_file"
# HF names of the input embedding and output projection of decoder-only causal LMs.
_EMBED_WEIGHT = "model.embed_tokens.weight"
_LM_HEAD_WEIGHT = "lm_head.weight"
# vLLM loggers that warn, on every partial reload, about each module the bucket does not cover
# (those modules correctly keep their current weights).
_PARTIAL_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
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


class WeightReloadExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in the engine-core process.

    Called by name through `collective_rpc`, whose arguments cannot carry tensors: the weights
    travel as a safetensors file path. `model_runner.reload_weights` (not `model.load_weights`)
    is the loading path, because CPU and quantised kernels repack weights after loading and
    reload_weights re-runs that processing.
    """

    def grpo_reload_weights_from_file(self, path: str, partial: bool = False) -> int:
        """Load HF-named tensors from a safetensors file into the running model; returns their count.

        partial: the file holds some whole decoder layers of an update (reload_buckets), so the
        modules it does not cover keep their weights, which vLLM would otherwise warn about.
        """
        from safetensors.torch import load_file

        install_reload_warning_filter()
        weights = load_file(path, device="cpu")
        weights = with_tied_lm_head(weights, self.model_runner.model_config.hf_text_config)
        with _quiet_loggers(_PARTIAL_RELOAD_LOGGERS) if partial else contextlib.nullcontext():
            self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        return len(weights)


@contextlib.contextmanager
def _quiet_loggers(names: Iterable[str]) -> Iterator[None]:
    """Show only errors from these loggers for the duration."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


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
