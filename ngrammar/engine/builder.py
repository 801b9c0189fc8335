"""The engine's parts, resolved from its config before ``LLMEngine`` starts: device, dtype,
context length, KV pages, quantization, tensor parallelism, and the runner that follows from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ngrammar.attention.factory import attention_backend
from ngrammar.config import EngineConfig
from ngrammar.distributed.driver import start_tensor_parallel
from ngrammar.engine.block_manager import BlockManager, PageAllocator
from ngrammar.engine.speculator import Speculator
from ngrammar.model.config import ModelConfig
from ngrammar.model.loader import Checkpoint, resolve_checkpoint
from ngrammar.model.parallel import check_tensor_parallel, tensor_parallel_quantization
from ngrammar.model.quant import notice
from ngrammar.model.tokenizer import Tokenizer
from ngrammar.runner.model_runner import (
    ModelRunner,
    kv_bytes_per_token,
    resolve_device,
    resolve_dtype,
    resolve_numerics,
    resolve_quantization,
)


@dataclass(frozen=True)
class EngineParts:
    """What an engine is assembled from (``build_parts``)."""

    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    runner: ModelRunner  # with tensor parallelism, rank 0's (``DriverRunner``)
    blocks: BlockManager


def engine_checkpoint(config: EngineConfig) -> Checkpoint:
    """``config.model``'s checkpoint (a GGUF converted once); a dummy load reads no weights, so a
    folder needs none. The engine, the server's front and its core launcher all resolve it here."""
    return resolve_checkpoint(config.model, weights=config.load_format != "dummy")


def build_parts(config: EngineConfig) -> EngineParts:
    """Resolve ``config`` and build the runner it names; raises ValueError for a config the model
    or the device cannot serve, before any process starts or weight is read."""
    if config.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size {config.data_parallel_size}: replicas run behind the server "
            "(ngrammar serve --dp N); one engine is one replica"
        )
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    dummy = config.load_format == "dummy"
    checkpoint = engine_checkpoint(config)
    model = checkpoint.config
    tokenizer = Tokenizer(
        checkpoint.tokenizer_dir, model.eos_token_ids
    )  # a bad one fails before any weight is read
    max_model_len = context_length(config.max_model_len, model)
    quantization = resolve_quantization(config.quantization, config.dtype, device)
    tp = config.tensor_parallel_size
    if tp > 1:
        check_tensor_parallel(model, tp, device, config.nnodes)
        quantization = tensor_parallel_quantization(quantization, tp)
    num_pages = kv_pages(config, model, device, dtype)
    # The pool gets one page past the allocator's range (page ``num_pages``): no sequence ever
    # owns it, so CUDA-graph padding rows write their K/V there.
    invariant = resolve_numerics(config.numerics, config.attention_backend, device, tp)
    if device.type == "cuda" and not invariant and config.numerics == "auto":
        notice(
            "numerics auto: per-shape kernels (fast), so outputs may change with the batch and "
            "speculation (the row-invariant ones need --tp 1 and Triton attention)"
        )
    if tp == 1:
        backend = attention_backend(config.attention_backend, device, invariant)
        runner = ModelRunner(
            checkpoint, device, dtype, num_pages + 1, config.page_size, backend, quantization,
            dummy=dummy, invariant=invariant,
        )  # fmt: skip
    else:  # rank 0's runner starts the other ranks and sends them every step
        runner = start_tensor_parallel(config, checkpoint, device, dtype, num_pages + 1)
    return EngineParts(
        device,
        dtype,
        model,
        checkpoint.name,
        tokenizer,
        max_model_len,
        runner,
        BlockManager(PageAllocator(num_pages, config.page_size), config.prefix_cache),
    )


def attach_graphs(parts: EngineParts, config: EngineConfig, speculator: Speculator, capture: bool) -> None:
    """Serve uniform decode / verify steps from static buffers, replaying captured CUDA graphs,
    and (captured, one process) prefill and mixed steps from mixed-step graphs.

    capture=False runs the same static-buffer and padding path eagerly (how it is tested on CPU).
    Widths are every D the draft policy may pick, or a trimmed tree be verified at
    (``DraftProposer.propose``); all graphs are captured here, up front, so no capture lands inside
    a timed step, and each is replayed a few times to give the draft policy its device cost."""
    widths = speculator.graph_widths()
    parts.runner.attach_graphs(
        widths,
        max_batch_size=min(config.cuda_graph_max_bs, config.max_running_requests),
        kv_len_bound=parts.max_model_len + max(widths),
        dummy_page=parts.blocks.allocator.num_pages,
        capture=capture,
        acceptor=speculator.acceptor(config.tensor_parallel_size == 1),
    )
    graphs = parts.runner.graphs
    if capture and config.tensor_parallel_size == 1:
        # Prefill and mixed steps (a full batch's decode rows beside the prompt tokens): under
        # continuous arrivals nearly every step is one.
        budget = mixed_step_tokens(config, parts.device)
        seqs = min(config.max_running_requests, config.cuda_graph_max_bs)
        tokens = MIXED_GRAPH_MAX_TOKENS if budget is None else seqs + budget
        parts.runner.attach_mixed_graphs(
            min(tokens, MIXED_GRAPH_MAX_TOKENS),
            max_seqs=config.max_running_requests,
            kv_len_bound=parts.max_model_len + max(widths),
            dummy_page=parts.blocks.allocator.num_pages,
        )
    if capture and graphs is not None and config.tensor_parallel_size == 1 and max(widths) > 1:
        # Each width's device cost, so the policy prices a width before timing it in the engine
        # (a first verify step timed untrimmed costs what a trimmed one would not).
        speculator.set_step_profile(graphs.profile())


# The largest step served from mixed-step graphs (a full mixed step where smaller: the largest graphed
# decode batch plus the mixed-step budget): past that a step's launches no longer dominate its time,
# and the graphs' activations grow with it.
MIXED_GRAPH_MAX_TOKENS = 1024


def mixed_step_tokens(config: EngineConfig, device: torch.device) -> int | None:
    """The token budget of a mixed step (None: no mixed steps)."""
    if not config.mixed_steps:
        return None
    if config.mixed_step_tokens is not None:
        return config.mixed_step_tokens
    return 512 if device.type == "cuda" else 64


def prefill_wait_steps(config: EngineConfig, device: torch.device) -> int:
    """Decode steps an admissible prompt may wait for a mixed step (``Scheduler.admission_due``)."""
    if config.prefill_wait_steps is not None:
        return config.prefill_wait_steps
    return 4 if device.type == "cuda" else 0


def context_length(requested: int | None, model: ModelConfig) -> int:
    """``max_model_len``, or the model's whole context (capped at a sliding window, which is not
    implemented: within it attention is full). Asking for more is an error, as in vLLM."""
    if requested is None:
        return model.max_context
    if requested > model.max_context:
        why = (
            "its sliding window, not implemented here"
            if model.max_context < model.max_position
            else "its context"
        )
        raise ValueError(
            f"max_model_len {requested} is longer than the model's {model.max_context} tokens ({why})"
        )
    return requested


def kv_pages(config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype) -> int:
    """The KV pool's pages: ``kv_cache_tokens``, else a share of free GPU memory (CUDA) or
    ``cpu_kv_cache_tokens``."""
    tokens = config.kv_cache_tokens
    if tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # each rank's pool holds its share of the KV heads
            share = int(free * config.gpu_memory_utilization * config.tensor_parallel_size)
            tokens = share // kv_bytes_per_token(model, dtype)
        else:
            tokens = config.cpu_kv_cache_tokens
    if tokens < config.page_size:
        raise ValueError(f"the KV cache would hold {tokens} tokens, less than one page of {config.page_size}")
    return tokens // config.page_size
